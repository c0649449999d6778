"""Capacity planning: the fewest replicas, and the router, that meet a first-token SLO on a trace.

    for each router:
        doubling   1, 2, 4, ... replicas until one meets the SLO (or max_replicas fails)
        bisection  between the last count that failed and the first that met it
    answer: the fewest replicas over the routers; among routers that tie, the largest margin,
            then the lowest first-token p99, then the fewest adapter loads

Each candidate is one cluster simulation (`slora.sim.cluster.simulate_cluster`) of the whole
trace. The search assumes that more replicas never lower the attainment, which holds for
these routers up to the noise of a random router's draws; `exhaustive` (every count, for a
check of that assumption on a trace) gives the same answer whenever it holds. A candidate
that is certain to miss (its requests that missed the SLO already exceed what the target
allows) stops early (`stop_below`): the search needs only to know that it failed, and its
row shows the most it could still have reached.

margin = attainment - target: positive for a candidate that meets the SLO.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from slora.sim.cluster import simulate_cluster
from slora.sim.router import ROUTERS


@dataclass(frozen=True)
class Candidate:
    """One simulated (router, replicas): its attainment (an upper bound when `stopped`)."""

    router: str
    replicas: int
    attainment: float
    target: float
    stopped: bool = False
    ttft_p99_s: float | None = None
    adapter_loads: int | None = None
    wall_s: float = 0.0

    @property
    def meets(self) -> bool:
        return not self.stopped and self.attainment >= self.target

    @property
    def margin(self) -> float:
        return self.attainment - self.target

    def to_dict(self) -> dict:
        return {"router": self.router, "replicas": self.replicas, "attainment": self.attainment,
                "margin": self.margin, "meets": self.meets, "stopped": self.stopped,
                "ttft_p99_s": self.ttft_p99_s, "adapter_loads": self.adapter_loads,
                "wall_s": self.wall_s}


@dataclass
class Plan:
    """The search's candidates in the order simulated, and its answer (None: no router met
    the SLO within max_replicas)."""

    target: float
    slo_ttft_s: float
    candidates: list[Candidate] = field(default_factory=list)
    fewest: dict[str, int | None] = field(default_factory=dict)  # per router

    @property
    def answer(self) -> Candidate | None:
        best = [c for c in self.candidates if c.meets and c.replicas == self.fewest.get(c.router)]
        # fewest replicas; then the largest margin, the lowest first-token p99, the
        # fewest adapter loads
        return min(best, key=lambda c: (c.replicas, -c.margin, c.ttft_p99_s, c.adapter_loads,
                                        ROUTERS.index(c.router)), default=None)

    def to_dict(self) -> dict:
        answer = self.answer
        return {"slo_ttft_s": self.slo_ttft_s, "slo_attainment": self.target,
                "answer": None if answer is None else answer.to_dict(),
                "fewest": self.fewest, "candidates": [c.to_dict() for c in self.candidates]}

    def table(self) -> str:
        """The candidates as a text table, by router then replicas, the answer marked."""
        answer = self.answer
        rows = [("router", "replicas", "attainment", "margin", "ttft p99", "loads/replica",
                 "sim wall", "")]
        for c in sorted(self.candidates, key=lambda c: (ROUTERS.index(c.router), c.replicas)):
            attain = f"<={c.attainment:.4f}" if c.stopped else f"{c.attainment:.4f}"
            p99 = "-" if c.ttft_p99_s is None else f"{c.ttft_p99_s:.3f} s"
            loads = "-" if c.adapter_loads is None else f"{c.adapter_loads / c.replicas:.0f}"
            mark = "<- answer" if c == answer else "meets" if c.meets else ""
            rows.append((c.router, str(c.replicas), attain, f"{c.margin:+.4f}", p99, loads,
                         f"{c.wall_s:.1f} s", mark))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) if i in (0, 7) else v.rjust(w)
                           for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        summary = ("no router meets the SLO within the replicas tried" if answer is None else
                   f"answer: {answer.replicas} replica{'s' * (answer.replicas > 1)} with "
                   f"{answer.router} ({100 * answer.attainment:.2f}% of first tokens within "
                   f"{self.slo_ttft_s:g} s; target {100 * self.target:g}%)")
        return "\n".join(lines + ["", summary])


def fewest_replicas(meets: Callable[[int], bool], max_replicas: int) -> int | None:
    """The smallest n in [1, max_replicas] with meets(n), assuming meets is monotone: doubling
    from 1 (then max_replicas itself), then bisection. None if max_replicas does not meet."""
    failed, n = 0, 1
    while True:
        if meets(n):
            break
        failed = n
        if n == max_replicas:
            return None
        n = min(2 * n, max_replicas)
    while n - failed > 1:
        mid = (failed + n) // 2
        if meets(mid):
            n = mid
        else:
            failed = mid
    return n


def plan_capacity(trace, profile, *, slo_ttft_s: float, target: float,
                  routers: tuple[str, ...] = ROUTERS, max_replicas: int = 1024,
                  exhaustive: bool = False, engine_options: dict | None = None,
                  on_candidate: Callable[[Candidate], None] | None = None, **cluster) -> Plan:
    """Search the fewest replicas meeting `target` (a fraction of requests whose first token
    comes within `slo_ttft_s`) for each router (see the module).

    exhaustive: simulate every count 1..max_replicas for each router instead (no early stop),
        to check the search on a small trace.
    engine_options: each replica's EngineConfig fields; slo_ttft_s is set to `slo_ttft_s`.
    on_candidate: called with each candidate as it is simulated (progress lines).
    cluster: the other arguments of `simulate_cluster` (poll_s, router_options, num_pages,
        gpu_memory_gb, model, default_rank, seed, workers, progress).
    """
    if not 0 < target <= 1:
        raise ValueError(f"slo attainment target {target} must be in (0, 1]")
    if slo_ttft_s <= 0:
        raise ValueError(f"slo_ttft_s={slo_ttft_s} must be positive")
    if max_replicas < 1:
        raise ValueError(f"max_replicas={max_replicas} must be at least 1")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or not routers:
        raise ValueError(f"routers {unknown or '(none)'}: choose among {', '.join(ROUTERS)}")
    options = {**(engine_options or {}), "slo_ttft_s": slo_ttft_s}
    plan = Plan(target, slo_ttft_s)
    for router in routers:
        seen: dict[int, Candidate] = {}

        def meets(n: int, router=router, seen=seen) -> bool:
            if n not in seen:
                run = simulate_cluster(trace, profile, replicas=n, router=router,
                                       engine_options=options,
                                       stop_below=None if exhaustive else target, **cluster)
                r = run.result
                c = Candidate(router, n, r["slo_attainment_max"] if run.stopped else
                              r["slo_attainment"], target, run.stopped, r.get("ttft_p99_s"),
                              None if run.stopped else r["stats"]["adapter_loads"],
                              r["stats"]["sim_wall_s"])
                seen[n] = c
                plan.candidates.append(c)
                if on_candidate is not None:
                    on_candidate(c)
            return seen[n].meets

        if exhaustive:
            passing = [n for n in range(1, max_replicas + 1) if meets(n)]
            plan.fewest[router] = min(passing, default=None)
        else:
            plan.fewest[router] = fewest_replicas(meets, max_replicas)
    return plan
