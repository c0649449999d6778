"""Simulated replicas behind a router: capacity planning for a fleet of engines.

    every poll_s seconds of simulated time (a scrape):
        each replica runs its replay loop up to that time     SimEngine: the real scheduler on
                                                              its own virtual clock, the
                                                              profile's cost model
        the router reads every replica's /metrics             queue lengths, resident adapters
    the requests arriving before the next scrape:
        router.route(adapter) -> replica, into its inbox      the router's own count grows
    after the last arrival: every replica runs to the end

Each replica is a `SimEngine`, driven by the loop `slora.replay.replay` runs (requests enter at
their arrival times, an idle engine jumps to its next arrival), split at scrape times: a
replica runs the loop's iterations that start before the next scrape, which add only requests
that arrived before it, all routed by then. So a replica's steps are exactly those of one
engine simulated alone with the requests it was sent, and one replica equals `simulate`.

What the router knows is what a router in front of real servers can know (`slora.sim.router`):
each server's queue length, running requests and resident adapters as of the last scrape, and
the requests it sent since. Each replica registers an adapter when its first request is routed
there (its `adapters_registered` counts those), with the rank the trace header gives.

Each replica takes its quiet steps at once (`SimEngine.fast_forward`: the same result, most
of the steps of a fleet at moderate load); `workers` processes (forked, so they share the
trace) simulate the replicas between scrapes, the router and the scrapes staying in this one.
The cyclic garbage collector is paused while a fleet runs: it makes no reference cycles, and
each full pass would walk its millions of requests and records.

Prompt token ids are a shared list of FAKE_TOKEN per length: the simulator reads only their
count (`simulate` draws random ids, as a replay does; the timing is the same), and such a
request skips the prefix cache, as a replay's random prompt does (`cache_prefix=False`).
Token-id prompts of the trace are looked up and cached as given.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial

from slora.config import ModelConfig
from slora.metrics import RequestRecord, result_dict, summarize
from slora.replay import _failed, _progress_bar, _record
from slora.request import SamplingParams
from slora.sim import simulator
from slora.sim.cost import Profile
from slora.sim.router import DEFAULT_POLL_S, ReplicaMetrics, Router, make_router
from slora.sim.simulator import (CLUSTER_KEYS, DEFAULT_TARGETS, FAKE_TOKEN, SimEngine,
                                 engine_config, result_config)
from slora.workload import Trace, TraceRequest, paused_gc

STOP_CHECK_S = 1.0  # with stop_below: simulated seconds between counts of certain misses
# stats of one replica that hold for each (not summed over the fleet)
_PER_REPLICA = ("pages_total", "page_bytes", "block_size")


class Replica:
    """One simulated server: a SimEngine, the requests routed to it and not yet added (its
    inbox, in arrival order), and the records of those that ended."""

    def __init__(self, index: int, engine: SimEngine, ranks: dict[str, int],
                 default_rank: int | None, fast_forward: bool = True) -> None:
        self.index = index
        self.fast_forward = fast_forward  # take quiet steps at once (SimEngine.fast_forward)
        self.changed: set[str] = set()  # adapters loaded or evicted since the last scrape
        self.slo = engine.config.slo_ttft_s
        self.missed = 0  # ended requests that missed the first-token SLO (rejected ones too)
        self.engine = engine
        engine.scheduler.token_gaps = Counter()  # the inter-token latencies, counted throughout
        self.inbox: deque[TraceRequest] = deque()
        self.records: dict[str, RequestRecord] = {}  # by request id, in finish order
        self.rejected: list[RequestRecord] = []
        self.submitted: dict[str, TraceRequest] = {}  # added, not yet ended
        self.routed = 0
        self._ranks = ranks
        self._default_rank = default_rank
        self._prompts: dict[int, list[int]] = {}  # length -> the shared fake prompt
        self._sampling: dict[int, SamplingParams] = {}  # output_len -> its (frozen) params

    def deliver(self, req: TraceRequest) -> None:
        """A request the router sent here; its adapter is registered on first use."""
        name = req.adapter
        if name is not None and name not in self.engine.adapters.adapters:
            self.engine.add_synthetic_adapter(name, self._ranks.get(name, self._default_rank),
                                              DEFAULT_TARGETS)
        self.inbox.append(req)
        self.routed += 1

    def metrics(self) -> ReplicaMetrics:
        """What this replica's server would report now: queued (received, not scheduled),
        running, and the adapters resident in its pool (the live set: read it before the
        replica runs on)."""
        sched = self.engine.scheduler
        return ReplicaMetrics(len(self.inbox) + len(sched.waiting), len(sched.running),
                              self.engine.adapters.resident)

    def run_until(self, t: float) -> int:
        """Run the replay loop's iterations that start before `t` (each adds the requests that
        arrived by its start, then steps); the requests arriving before `t` must all be in the
        inbox. Returns the number of requests that ended."""
        eng, inbox, clock = self.engine, self.inbox, self.engine.clock
        ended = len(self.records)
        while True:
            now = clock.now
            if not eng.has_unfinished():
                if not inbox or inbox[0].arrival_time >= t:
                    break
                due = inbox[0].arrival_time
                if due > now:  # idle: jump to the next arrival
                    clock.sleep(due - now)
                    now = max(clock.now, due)
            elif now >= t:
                break
            while inbox and inbox[0].arrival_time <= now:
                self._add(inbox.popleft())
            if eng.has_unfinished():
                outs = eng.fast_forward(min(t, inbox[0].arrival_time) if inbox else t) \
                    if self.fast_forward else None
                for out in eng.step() if outs is None else outs:
                    if out.finished:
                        rec = self.records[out.request_id] = _record(out, 0.0)
                        del self.submitted[out.request_id]
                        if rec.failed or rec.ttft > self.slo:
                            self.missed += 1
                if outs is not None:
                    continue  # quiet steps load and evict nothing
                plan = eng.last_plan
                if plan.adapter_loads or plan.prefetch or plan.evicted:
                    changed = self.changed
                    changed.update(name for name, _ in plan.adapter_loads)
                    changed.update(name for name, _ in plan.prefetch)
                    changed.update(plan.evicted)
        return len(self.records) - ended

    def _add(self, req: TraceRequest) -> None:
        n = req.prompt_len if req.prompt is None else len(req.prompt)
        own = isinstance(req.prompt, list)
        prompt = req.prompt if own else self._prompts.get(n)
        if prompt is None:
            prompt = self._prompts[n] = [FAKE_TOKEN] * n
        sampling = self._sampling.get(req.output_len)
        if sampling is None:
            sampling = self._sampling[req.output_len] = SamplingParams(
                max_tokens=req.output_len, ignore_eos=True)
        try:
            rid = self.engine.add_request(prompt, sampling, adapter=req.adapter,
                                          arrival_time=req.arrival_time,
                                          cache_prefix=own)
        except ValueError as e:
            self.rejected.append(_failed(req, f"rejected at submission: {e}"))
            self.missed += 1
            return
        self.submitted[rid] = req

    def late(self, cutoff: float) -> int:
        """Requests here that arrived before `cutoff` and have no first token yet."""
        return (sum(1 for r in self.inbox if r.arrival_time < cutoff)
                + sum(1 for r in self.engine.scheduler.waiting
                      if r.metrics.first_token_time is None and r.arrival_time < cutoff))

    def all_records(self) -> list[RequestRecord]:
        """Every request routed here: ended ones in finish order, then those refused at
        submission, then any the engine never reported ended (failed)."""
        never = [_failed(r, "the engine never reported this request finished")
                 for r in self.submitted.values()]
        return list(self.records.values()) + self.rejected + never

    def summary(self, slo_ttft_s: float) -> dict:
        """This replica's load and service: requests, attainment, adapter traffic, busy time."""
        records = self.all_records()
        s = self.engine.stats()
        met = sum(1 for r in records if not r.failed and r.ttft is not None and r.ttft <= slo_ttft_s)
        return {"replica": self.index, "requests": self.routed,
                "completed": sum(1 for r in records if not r.failed),
                "slo_attainment": met / len(records) if records else None,
                "adapters_routed": s["adapters_registered"], "adapter_loads": s["adapter_loads"],
                "adapter_evictions": s["adapter_evictions"], "host_loads": s["host_loads"],
                "preemptions": s["preemptions"], "steps": s["sim_steps"],
                "busy_s": s["sim_busy_s"], "end_s": self.engine.clock.now}


class Partition:
    """The replicas one process simulates. `run` delivers the requests routed to them since the
    last call and runs them to the next scrape, then reports what the router may read: each
    replica's queue and batch sizes, and the adapters whose residency may have changed (those a
    step loaded or evicted) with whether each is resident now. `finish` runs them to the end."""

    def __init__(self, indices: list[int], trace: Trace, config, model: ModelConfig, cost,
                 default_rank: int | None, check: bool = False, fast_forward: bool = True) -> None:
        self.requests = trace.requests
        self.replicas = [Replica(i, SimEngine(config, model, cost, config.dtype, check=check),
                                 trace.adapters, default_rank, fast_forward) for i in indices]
        self._at = {rep.index: k for k, rep in enumerate(self.replicas)}

    def run(self, deliveries: list[tuple[int, int]], until: float, late_before: float | None):
        """deliveries: (replica, request index) in arrival order. late_before: also count the
        requests waiting without a first token that arrived before it. Returns (loads
        [(replica, waiting, running)], residency [(replica, adapter, resident)], requests that
        ended, ended ones that missed the SLO, late waiting ones)."""
        requests, at, replicas = self.requests, self._at, self.replicas
        for i, k in deliveries:
            replicas[at[i]].deliver(requests[k])
        ended = sum(rep.run_until(until) for rep in replicas)
        loads, residency = [], []
        for rep in replicas:
            m, changed = rep.metrics(), rep.changed
            loads.append((rep.index, m.waiting, m.running))
            if changed:
                resident = m.resident
                residency += [(rep.index, name, name in resident) for name in changed]
                changed.clear()
        late = 0 if late_before is None else sum(rep.late(late_before) for rep in replicas)
        return loads, residency, ended, sum(rep.missed for rep in replicas), late

    def finish(self, deliveries: list[tuple[int, int]]):
        """Deliver the last requests and run every replica to the end. Returns, per replica,
        (index, its records, its summary, its engine's stats, its final clock, its token
        gaps)."""
        self.run(deliveries, math.inf, None)
        out = []
        for rep in self.replicas:
            out.append((rep.index, rep.all_records(), rep.summary(rep.slo), rep.engine.stats(),
                        rep.engine.clock.now, dict(rep.engine.scheduler.token_gaps)))
        return out


class _Remote:
    """A `Partition` in a worker process (forked: it shares the trace as it was when forked),
    called through a pipe: `call` sends a method's arguments, `result` waits for its return."""

    def __init__(self, context, *args) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, args), daemon=True)
        self.process.start()
        child.close()

    def call(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def result(self):
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self.conn.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()


def _serve(conn, args) -> None:
    """A worker process: a Partition of `args`, its methods called by messages until "finish"."""
    try:
        part = Partition(*args)
    except BaseException as e:  # reported at the first call
        part, error = None, e
    while True:
        try:
            method, call_args = conn.recv()
        except EOFError:
            return
        try:
            if part is None:
                raise error
            reply = getattr(part, method)(*call_args)
        except BaseException as e:
            reply = e
        conn.send(reply)
        if method == "finish" or isinstance(reply, BaseException):
            return


class _Local:
    """A `Partition` in this process, with `_Remote`'s interface."""

    def __init__(self, *args) -> None:
        self.part = Partition(*args)
        self._call = None

    def call(self, method: str, *args) -> None:
        self._call = (method, args)

    def result(self):
        method, args = self._call
        return getattr(self.part, method)(*args)

    def close(self) -> None:
        pass


@dataclass
class ClusterRun:
    """A finished (or stopped) cluster simulation.

    result: `simulate`'s result dict over all requests, plus "per_replica" (each replica's
        `Replica.summary`) and the cluster settings in its config ("replicas", "router",
        "router_poll_s", "workers"). A stopped run's result holds "stopped",
        "slo_attainment_max", "num_requests", "slo_ttft_s" and the config.
    router: the router, with its count of requests sent to each replica (`routed`).
    stopped: True when `stop_below` ended it early: its attainment is then certain to be at
        most result["slo_attainment_max"], below the target.
    token_gaps: every replica's inter-token gaps -> tokens (`Scheduler.token_gaps`).
    """

    result: dict
    records: list[RequestRecord]
    router: Router
    stopped: bool = False
    token_gaps: dict[float, int] = field(default_factory=dict)


def simulate_cluster(trace: Trace, profile: Profile, *, replicas: int, router: str = "round-robin",
                     poll_s: float = DEFAULT_POLL_S, router_options: dict | None = None,
                     engine_options: dict | None = None, num_pages: int | None = None,
                     gpu_memory_gb: float | None = None, model: ModelConfig | None = None,
                     default_rank: int | None = None, trace_path: str | None = None,
                     seed: int = 0, workers: int = 1, fast_forward: bool = True,
                     check: bool = False,
                     progress: bool = False, stop_below: float | None = None,
                     extra_config: dict | None = None) -> ClusterRun:
    """Simulate `trace` on `replicas` engines of `profile` behind `router` (see the module).

    router: a name of `slora.sim.router.ROUTERS`; router_options go to it (adapter-affinity's
        load_factor, vnodes, probes); seed seeds it.
    poll_s: the router's scrape interval in simulated seconds.
    engine_options, num_pages, gpu_memory_gb, model: each replica's engine, as for `simulate`.
    default_rank: the rank of adapters the requests use and the trace header does not rank.
    workers: processes that simulate the replicas (replica i in process i % workers; this one
        is the first). Replicas meet only at scrapes, so the result is the same for any number.
    fast_forward: take each replica's quiet steps at once (`SimEngine.fast_forward`): the same
        result, sooner; False steps every step through the scheduler.
    stop_below: an SLO attainment target; the simulation stops as soon as the requests that
        missed the first-token SLO (`engine_options["slo_ttft_s"]`) make it unreachable
        (`ClusterRun.stopped`). A capacity search (`slora.sim.plan`) skips the rest of a run
        that already failed.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be at least 1")
    if poll_s <= 0:
        raise ValueError(f"poll_s={poll_s} must be positive (seconds between scrapes)")
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    workers = min(workers, replicas)
    config, model = engine_config(profile, engine_options, num_pages, gpu_memory_gb, model)
    unranked = [n for n in trace.adapter_names() if n not in trace.adapters]
    if unranked and default_rank is None:
        raise ValueError(f"the trace header gives no rank for {len(unranked)} adapter(s) the "
                         f"requests use (e.g. {unranked[0]!r}): add them to its \"adapters\" map, "
                         "or give a default rank (--adapter-rank)")
    options = dict(router_options or {}) if router == "adapter-affinity" else {}
    chooser = make_router(router, replicas, seed, **options)
    allowed = None if stop_below is None else len(trace) - math.ceil(stop_below * len(trace) - 1e-9)

    with paused_gc():  # the workers, forked inside, inherit it
        return _run(trace, profile, config, model, chooser, replicas=replicas, router=router,
                    poll_s=poll_s, options=options, workers=workers, default_rank=default_rank,
                    check=check, fast_forward=fast_forward, progress=progress, allowed=allowed,
                    trace_path=trace_path, seed=seed, gpu_memory_gb=gpu_memory_gb,
                    extra_config=extra_config)


def _run(trace, profile, config, model, chooser, *, replicas, router, poll_s, options, workers,
         default_rank, check, fast_forward, progress, allowed, trace_path, seed, gpu_memory_gb,
         extra_config) -> ClusterRun:
    """`simulate_cluster`'s loop (see the module), its arguments checked."""
    slo = config.slo_ttft_s
    wall = time.perf_counter()
    groups = [list(range(w, replicas, workers)) for w in range(workers)]
    context = multiprocessing.get_context("fork") if workers > 1 else None
    parts = [_Local(groups[0], trace, config, model, profile.cost, default_rank, check,
                    fast_forward)]
    parts += [_Remote(context, g, trace, config, model, profile.cost, default_rank, check,
                      fast_forward)
              for g in groups[1:]]
    owner = [0] * replicas
    for w, g in enumerate(groups):
        for i in g:
            owner[i] = w
    resident: list[set[str]] = [set() for _ in range(replicas)]  # as the last scrape reported
    waiting, running = [0] * replicas, [0] * replicas
    deliveries: list[list[tuple[int, int]]] = [[] for _ in parts]
    requests, n, k = trace.requests, len(trace), 0
    stopped, missed, next_check, done = False, 0, 0.0, 0
    bar = _progress_bar(n, progress, f"simulate {replicas} replicas")
    try:
        while k < n and not stopped:
            # the scrape at the start of the epoch holding the next arrival, then its arrivals
            epoch = math.floor(requests[k].arrival_time / poll_s)
            start, end = epoch * poll_s, (epoch + 1) * poll_s
            check_now = allowed is not None and start >= next_check
            for part, sent in zip(parts, deliveries):
                part.call("run", sent, start, start - slo if check_now else None)
            deliveries = [[] for _ in parts]
            missed = 0
            for part in parts:
                loads, residency, ended, part_missed, late = part.result()
                for i, w, r in loads:
                    waiting[i], running[i] = w, r
                for i, name, here in residency:
                    (resident[i].add if here else resident[i].discard)(name)
                bar.update(ended)
                done += ended
                missed += part_missed + late
            chooser.observe([ReplicaMetrics(waiting[i], running[i], resident[i])
                             for i in range(replicas)])
            while k < n and requests[k].arrival_time < end:
                i = chooser.route(requests[k].adapter)
                deliveries[owner[i]].append((i, k))
                k += 1
            if check_now:
                stopped = missed > allowed
                next_check = start + STOP_CHECK_S
        if not stopped:
            for part, sent in zip(parts, deliveries):
                part.call("finish", sent)
            finals = sorted((f for part in parts for f in part.result()), key=lambda f: f[0])
            bar.update(n - done)
    finally:
        bar.close()
        for part in parts:
            part.close()
    wall = time.perf_counter() - wall

    extra = {"replicas": replicas, "router": router, "router_poll_s": poll_s,
             "router_options": options, "workers": workers, **(extra_config or {})}
    config_out = result_config(trace, profile, config, trace_path=trace_path, seed=seed,
                               gpu_memory_gb=gpu_memory_gb, extra=extra)
    if stopped:
        result = {"stopped": True, "slo_attainment_max": 1 - missed / n, "slo_ttft_s": slo,
                  "num_requests": n, "source": "simulate", "config": config_out,
                  "stats": {"sim_wall_s": wall}}
        return ClusterRun(result, [], chooser, stopped=True)
    records = [r for f in finals for r in f[1]]
    gaps = Counter()
    for f in finals:
        gaps.update(f[5])
    summary = summarize(records, slo_ttft_s=slo, duration_s=max(f[4] for f in finals),
                        token_gaps=gaps)
    stats = fleet_stats([f[3] for f in finals])
    stats["sim_wall_s"] = wall
    result = result_dict(summary, source="simulate", config=config_out, stats=stats,
                         records=records, token_gaps=gaps)
    latencies = result.pop("latencies")  # kept last, as `result_dict` orders it
    result["per_replica"] = [f[2] for f in finals]
    result["latencies"] = latencies
    return ClusterRun(result, records, chooser, token_gaps=dict(gaps))


def simulate_point(trace: Trace, profile: Profile, point: dict, *, cluster: dict | None = None,
                   **kwargs) -> ClusterRun:
    """`slora.sim.simulator.simulate_point` on replicas: `cluster` holds `simulate_cluster`'s
    arguments (replicas: 1 unless given), and a point's replicas and router override them."""
    cluster = {k: v for k, v in (cluster or {}).items() if k not in point or k not in CLUSTER_KEYS}
    if "replicas" not in point:
        cluster.setdefault("replicas", 1)
    return simulator.simulate_point(trace, profile, point, run=partial(simulate_cluster, **cluster),
                                    **kwargs)


def fleet_stats(stats: list[dict]) -> dict:
    """The replicas' engine counters summed (`_PER_REPLICA` keys: replica 0's; the fair
    policy's counter spread: the largest)."""
    out = {}
    for key, value in stats[0].items():
        if key in _PER_REPLICA or not isinstance(value, (int, float)) or isinstance(value, bool):
            out[key] = value
        elif key.endswith("spread"):
            out[key] = max(s[key] for s in stats)
        else:
            out[key] = sum(s[key] for s in stats)
    return out
