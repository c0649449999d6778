"""Routers: which replica serves a request, from what a real router in front of them can know.

A router in front of N servers knows two things, and the simulated routers use nothing else:

- what each server's `/metrics` reported at the last scrape (`ReplicaMetrics`): its queue
  length (waiting requests, those received but not yet scheduled included), its running
  requests, and the adapters resident in its pool;
- the requests it has sent itself since that scrape.

So a replica's load, as a router sees it, is `waiting + running` at the last scrape plus the
requests routed to it since (`Router.load`). `observe` is a scrape; `route` picks a replica for
one request and counts it. The cluster simulator (`slora.sim.cluster`) scrapes every
`poll_s` seconds of simulated time and routes the requests that arrive in between.

- random:           uniform, seeded.
- round-robin:      replicas in turn.
- least-loaded:     the smallest load (the lowest index among equals).
- power-of-two:     two distinct replicas at random, the less loaded (the first drawn among
                    equals): near least-loaded balance from two looks.
- adapter-affinity: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam):
                    replicas own `vnodes` points each on a hash ring (256: a replica's share
                    of the ring then varies by about 1/16 = sqrt(1/256)), an adapter hashes to a
                    point and its requests go to the first replica clockwise whose load stays
                    within `ceil(load_factor * (total load + 1) / N)`, spilling to the next
                    ones under load. Among the first `probes` replicas within the bound, one
                    that reports the adapter resident goes first. An adapter's requests thus
                    stay on its home replica and the few after it on the ring, and no replica's
                    load passes the bound (some replica is always within it: the loads sum to
                    less than N times the bound). Base-model requests go to the least loaded.

Every router is deterministic for its seed. Hashes are blake2b, stable across processes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from typing import Collection, NamedTuple

ROUTERS = ("random", "round-robin", "least-loaded", "power-of-two", "adapter-affinity")
DEFAULT_POLL_S = 0.05  # simulated seconds between a router's scrapes of the replicas' metrics


class ReplicaMetrics(NamedTuple):
    """One replica's state as its server's `/metrics` reports it."""

    waiting: int  # requests received and not yet scheduled
    running: int  # requests in its batch
    resident: Collection[str]  # adapters holding pages of its pool


class Router:
    """Base: the load view (last scrape + own dispatches); subclasses choose in `pick`."""

    name = ""

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        if num_replicas < 1:
            raise ValueError(f"router: num_replicas={num_replicas} must be at least 1")
        self.n = num_replicas
        self.rng = random.Random(seed)
        self.load = [0] * num_replicas  # waiting + running at the last scrape, + sent since
        self.resident: list[Collection[str]] = [()] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica, in all

    def observe(self, metrics: list[ReplicaMetrics]) -> None:
        """A scrape of every replica's metrics: the load view restarts from them."""
        self.load = [m.waiting + m.running for m in metrics]
        self.resident = [m.resident for m in metrics]

    def route(self, adapter: str | None) -> int:
        """The replica for one request on `adapter` (None: the base model); counted as sent."""
        i = self.pick(adapter)
        self.load[i] += 1
        self.routed[i] += 1
        return i

    def pick(self, adapter: str | None) -> int:
        raise NotImplementedError

    def least_loaded(self) -> int:
        load = self.load
        return load.index(min(load))


class RandomRouter(Router):
    name = "random"

    def pick(self, adapter):
        return self.rng.randrange(self.n)


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.next = 0

    def pick(self, adapter):
        i, self.next = self.next, (self.next + 1) % self.n
        return i


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def pick(self, adapter):
        return self.least_loaded()


class PowerOfTwoRouter(Router):
    name = "power-of-two"

    def pick(self, adapter):
        if self.n == 1:
            return 0
        a = self.rng.randrange(self.n)
        b = self.rng.randrange(self.n - 1)
        b += b >= a  # two distinct replicas, uniformly
        return b if self.load[b] < self.load[a] else a


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text`, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class AdapterAffinityRouter(Router):
    """Consistent hashing with bounded loads over adapter names (see the module docstring)."""

    name = "adapter-affinity"

    def __init__(self, num_replicas: int, seed: int = 0, load_factor: float = 1.25,
                 vnodes: int = 256, probes: int = 2) -> None:
        super().__init__(num_replicas, seed)
        if load_factor < 1:
            raise ValueError(f"adapter-affinity: load_factor={load_factor} must be >= 1 (at 1 "
                             "every replica is filled to the mean)")
        if vnodes < 1 or probes < 1:
            raise ValueError(f"adapter-affinity: vnodes={vnodes} and probes={probes} must be >= 1")
        self.load_factor = load_factor
        self.probes = probes
        ring = sorted((stable_hash(f"replica-{i}-{j}-{seed}"), i)
                      for i in range(num_replicas) for j in range(vnodes))
        self._points = [h for h, _ in ring]
        self._owners = [i for _, i in ring]
        self._start: dict[str, int] = {}  # adapter -> its ring position (cached)
        self.total = 0  # sum(self.load), kept with it

    def observe(self, metrics):
        super().observe(metrics)
        self.total = sum(self.load)

    def route(self, adapter):
        i = super().route(adapter)
        self.total += 1
        return i

    def bound(self) -> int:
        """The most load a replica may reach with the next request: ceil(c * (total + 1) / N)."""
        return math.ceil(self.load_factor * (self.total + 1) / self.n)

    def pick(self, adapter):
        if adapter is None:
            return self.least_loaded()
        start = self._start.get(adapter)
        if start is None:
            start = bisect.bisect(self._points, stable_hash(adapter)) % len(self._points)
            self._start[adapter] = start
        bound, load, owners = self.bound(), self.load, self._owners
        first, seen, fits = None, set(), 0
        ring = len(owners)
        for k in range(ring):
            i = owners[(start + k) % ring]
            if i in seen:
                continue
            seen.add(i)
            if load[i] + 1 > bound:
                if len(seen) == self.n:
                    break
                continue
            if adapter in self.resident[i]:
                return i
            if first is None:
                first = i
            fits += 1
            if fits >= self.probes or len(seen) == self.n:
                break
        assert first is not None, "bounded loads: some replica is always within the bound"
        return first


ROUTER_CLASSES = {cls.name: cls for cls in (RandomRouter, RoundRobinRouter, LeastLoadedRouter,
                                            PowerOfTwoRouter, AdapterAffinityRouter)}


def make_router(name: str, num_replicas: int, seed: int = 0, **options) -> Router:
    """A router by name (`ROUTERS`); options go to its constructor (adapter-affinity's
    load_factor, vnodes, probes)."""
    try:
        cls = ROUTER_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}") from None
    return cls(num_replicas, seed, **options)
