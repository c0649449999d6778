"""Queue orders: which waiting requests the scheduler tries to admit first.

A policy sees the waiting queue (arrival order, preempted requests at the front) and
returns the order to try. `blocking` policies stop admitting at the first request that
does not fit (strict FCFS: no overtaking); the others try the rest.

- fcfs:    arrival order, head-of-line blocking.
- cluster: requests whose adapter is already resident first (no load, no eviction), so a
           batch clusters on few adapters; a request passed over `max_skips` times goes first,
           which bounds starvation.
- abort:   S-LoRA's early abort: fcfs, but a request whose first token can no longer meet
           the SLO (waited longer than `slo_ttft_s`) is aborted instead of served, so the
           others still meet theirs.
- fair:    a fair share across adapters (virtual token counters, VTC): the adapter that has
           received the fewest tokens so far goes first; counters of newly active adapters
           are lifted to the current minimum so idle time earns no credit.
- priority: vLLM's priority scheduling: the lowest `Request.priority` first, arrival order
           among equals, head-of-line blocking; the running requests are kept in that order
           too (`ranks_running`), so a preemption takes the lowest priority, the latest
           admitted among equals.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter
from typing import Iterable

from slora.request import Request


class Policy:
    name = "fcfs"
    blocking = True
    reads_resident = False  # `order` reads its `resident` set (the scheduler makes it only then)
    ranks_running = False  # the running list is kept in `Request.priority` order

    def __init__(self, max_skips: int = 64, slo_ttft_s: float = 6.0) -> None:
        self.max_skips = max_skips
        self.slo_ttft_s = slo_ttft_s
        self.counters: dict[str, int] = {}

    def order(self, waiting: Iterable[Request], resident: set[str | None]) -> list[Request]:
        return list(waiting)

    def expired(self, req: Request, now: float) -> bool:
        """True if the request should be aborted rather than admitted (early-abort only)."""
        return False

    def served(self, req: Request, tokens: int) -> None:
        """Account tokens computed for a request (fair share only)."""

    def stats(self) -> dict:
        return {}


class ClusterPolicy(Policy):
    name = "cluster"
    blocking = False
    reads_resident = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.starving_first = 0  # times a starving request was moved ahead of adapter hits

    def order(self, waiting, resident):
        waiting = list(waiting)
        starving = [r for r in waiting if r.skipped >= self.max_skips]
        self.starving_first += bool(starving)
        hits = [r for r in waiting if r.skipped < self.max_skips and r.adapter in resident]
        misses = [r for r in waiting if r.skipped < self.max_skips and r.adapter not in resident]
        return starving + hits + misses

    def stats(self):
        return {"cluster_starving_first": self.starving_first}


class AbortPolicy(Policy):
    name = "abort"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aborted = 0

    def expired(self, req, now):
        late = req.num_preemptions == 0 and now - req.arrival_time > self.slo_ttft_s
        self.aborted += late
        return late

    def stats(self):
        return {"slo_aborted": self.aborted}


class FairPolicy(Policy):
    name = "fair"
    blocking = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counters = defaultdict(int)

    def order(self, waiting, resident):
        waiting = list(waiting)
        active = {r.adapter or "" for r in waiting}
        floor = min((self.counters[a] for a in active if a in self.counters), default=0)
        for a in active:
            self.counters[a] = max(self.counters[a], floor)
        # sorted() is stable: arrival order within one adapter.
        return sorted(waiting, key=lambda r: self.counters[r.adapter or ""])

    def served(self, req, tokens):
        self.counters[req.adapter or ""] += tokens

    def stats(self):
        return {"fair_counter_spread": (max(self.counters.values()) - min(self.counters.values()))
                if self.counters else 0}


class PriorityPolicy(Policy):
    name = "priority"
    ranks_running = True

    def order(self, waiting, resident):
        return sorted(waiting, key=_priority)  # (stable: arrival order among equals)


_priority = attrgetter("priority")

POLICIES = {p.name: p for p in (Policy, ClusterPolicy, AbortPolicy, FairPolicy, PriorityPolicy)}


def make_policy(name: str, max_skips: int = 64, slo_ttft_s: float = 6.0) -> Policy:
    try:
        return POLICIES[name](max_skips=max_skips, slo_ttft_s=slo_ttft_s)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
