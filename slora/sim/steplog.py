"""Step logs: every step a real engine runs, as the cost model sees it, with its measured time.

    with logged_steps(engine) as steps:     # engine.step() timed; each entry:
        ...                                 # {"features", "seconds", "copies", "load_bytes",
    write_step_log(steps, "steps.jsonl")    #  "prefetch_bytes", "gc_s", "graphs", "compiles"}

Calibration (`slora.sim.profile`) fits the cost model to such steps; a replay
(`slora.replay.run_replay(step_log=...)`) writes them, so a disagreement between a replay and
its simulation can be traced to the steps the model mispredicts, and `slora profile --refit
--add-steps` fits them too.

The log wraps the engine's methods for the duration of the block and puts them back after it;
nothing else about the engine changes. torch is imported only to read CUDA allocator
statistics when asked (`allocs`).
"""

from __future__ import annotations

import gc
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from slora.sim.cost import FEATURES, plan_features


class PlanTap:
    """Wraps `engine.scheduler.schedule` to see each plan's features as it is made (before
    update changes the requests), and optionally to inject a prefetch copy. `on_plan`, if
    set, is called with each plan once its record is taken."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.schedule = engine.scheduler.schedule
        self.features = None
        self.copies = False
        self.load_bytes: list[int] = []  # this step's blocking adapter copies, bytes each
        self.prefetch_bytes: list[int] = []  # and its prefetch copies
        self.empty = True
        self.inject: tuple[str, list[int]] | None = None
        self.on_plan: Callable | None = None
        engine.scheduler.schedule = self

    def __call__(self, now):
        plan = self.schedule(now)
        if self.inject is not None:
            plan.prefetch.append(self.inject)
        self.features = plan_features(plan, self.engine.adapters,
                                      self.engine.runner.mixed_graph_tokens)
        self.copies = bool(plan.adapter_loads or plan.prefetch)
        infos = self.engine.adapters.adapters
        self.load_bytes = [infos[name].nbytes for name, _ in plan.adapter_loads]
        self.prefetch_bytes = [infos[name].nbytes for name, _ in plan.prefetch]
        self.empty = plan.empty
        if self.on_plan is not None:
            self.on_plan(plan)
        return plan

    def record(self) -> dict:
        """The last plan's step-log fields: copies, features, load_bytes, prefetch_bytes."""
        return {"copies": self.copies, "features": dict(zip(FEATURES, self.features)),
                "load_bytes": self.load_bytes, "prefetch_bytes": self.prefetch_bytes}

    def close(self) -> None:
        self.engine.scheduler.schedule = self.schedule


@contextmanager
def logged_steps(engine, allocs: bool = False):
    """Within the block, time every non-empty step of `engine` and note its plan's cost-model
    features and the adapter copies it made (bytes of each blocking load and prefetch); yields
    the list the steps are appended to, in launch order. Three notes for finding stalls,
    which no fit reads: `gc_s`, the garbage collector's time within the step's seconds,
    `graphs`, the CUDA graphs captured within them (a bucket the warm-up missed; their keys
    in `graph_keys`), and `compiles`, the Triton kernels compiled within them (a new
    specialization: a class of an integer argument, a pointer's alignment or a constexpr the
    warm-up did not meet), each as Triton writes its name and specialization. `allocs` (CUDA; off by default, as reading the
    allocators' statistics costs each step tens of microseconds) adds a fourth: `allocs`, the
    device allocator's cudaMalloc calls and the pinned host allocator's new blocks within the
    step, with the milliseconds those host allocations took.

    A step's seconds: without async scheduling, the time of the `engine.step()` call that ran
    it. With it (`EngineConfig.async_scheduling`) a call launches one step and collects
    another, so the time goes to the step collected, as `SimEngine._step_async` runs it: from
    the collect of the step before it, or the start of the call that scheduled it if that came
    later (the engine was idle), to the return of its own collect; in steady decode, the
    period between collections. Its gc_s and graphs are those of that interval (a graph
    captured at the next step's launch shows on the step whose collect it delayed). On a CPU
    the launch computes the step, so there step N's time holds step N+1's forward."""
    tap, steps = PlanTap(engine), []
    gc_time = [0.0, 0.0]  # [start of the collection in progress, total]

    def on_gc(phase, info):
        if phase == "start":
            gc_time[0] = time.perf_counter()
        else:
            gc_time[1] += time.perf_counter() - gc_time[0]

    def captured():
        graphs = engine.runner.graphs
        return 0 if graphs is None else len(graphs.graphs)

    compiled: list[str] = []  # Triton kernels compiled so far within the block
    knobs = _triton_runtime_knobs()
    chained = knobs.jit_post_compile_hook if knobs is not None else None

    def on_compile(*, fn, **kw):
        # its name and specialization (argument types, 16-byte alignment, constexprs)
        compiled.append(kw.get("repr") or fn.name)
        return chained(fn=fn, **kw) if chained is not None else None

    alloc_stats = _alloc_stats(engine.runner.device) if allocs else None

    def mark():
        counts = alloc_stats() if alloc_stats else ()
        return time.perf_counter(), gc_time[1], captured(), len(compiled), counts

    def entry(start, end, record):
        e = {"seconds": end[0] - start[0], **record, "gc_s": end[1] - start[1],
             "graphs": end[2] - start[2], "compiles": compiled[start[3]:end[3]]}
        if end[2] > start[2]:  # which graphs: their keys, as captured
            e["graph_keys"] = [repr(k) for k in list(engine.runner.graphs.graphs)[start[2]:end[2]]]
        if alloc_stats:
            d = [b - a for a, b in zip(start[4], end[4])]
            e["allocs"] = {"device": d[0], "host": d[1], "host_ms": d[2] / 1e3}
        return e

    def step():
        start = mark()
        out = type(engine).step(engine)
        if not tap.empty:
            steps.append(entry(start, mark(), tap.record()))
        return out

    # async scheduling: the plans launched but not collected, id -> (plan, record, mark at the
    # start of the call that scheduled it); and the mark of the last collect
    made, call, last = {}, [None], [(float("-inf"), 0.0, 0)]

    def on_plan(plan):
        if not plan.empty:
            made[id(plan)] = (plan, tap.record(), call[0])

    def async_step():
        call[0] = mark()
        return type(engine).step(engine)

    runner = engine.runner
    collect = runner.collect

    def timed_collect(flight):
        out = collect(flight)
        if flight is not None:
            now = mark()
            _, record, start = made.pop(id(flight.plan), (None, None, None))
            if record is not None:  # (None: launched before the block)
                steps.append(entry(max(last[0], start, key=lambda m: m[0]), now, record))
            last[0] = now
        return out

    is_async = engine.config.async_scheduling
    own_collect = "collect" in vars(runner)  # an instance attribute already (a test's wrapper)
    if is_async:
        tap.on_plan, runner.collect, engine.step = on_plan, timed_collect, async_step
    else:
        engine.step = step
    gc.callbacks.append(on_gc)
    if knobs is not None:
        knobs.jit_post_compile_hook = on_compile
    try:
        yield steps
    finally:
        gc.callbacks.remove(on_gc)
        if knobs is not None:
            knobs.jit_post_compile_hook = chained
        del engine.step  # the class's method again
        if is_async:
            if own_collect:
                runner.collect = collect
            else:
                del runner.collect
        tap.close()


def _alloc_stats(device):
    """A function giving (cudaMalloc calls, pinned host blocks created, microseconds spent
    creating them) so far on a CUDA `device`; None elsewhere."""
    import torch

    if torch.device(device).type != "cuda":
        return None

    host_stats = getattr(torch.cuda, "host_memory_stats", dict)  # (a torch without it: none)

    def stats():
        dev = torch.cuda.memory_stats(device)
        host = host_stats()
        return (dev.get("num_device_alloc", 0), host.get("num_host_alloc", 0),
                host.get("host_alloc_time.total", 0))
    return stats


def _triton_runtime_knobs():
    """Triton's runtime knobs (its compile hooks), or None without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def write_step_log(steps: list[dict], path: str | Path) -> None:
    """`logged_steps`' list as JSONL, one step a line."""
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in steps)


def read_step_log(path: str | Path) -> list[dict]:
    """A step log (`write_step_log`): [{"features", "seconds", "copies", "load_bytes",
    "prefetch_bytes", "gc_s", "graphs", "compiles"}, ...], checked. Only "features" and
    "seconds" are required: a missing "copies" reads as False, missing copy bytes as None
    (unknown), missing stall notes as 0 and no compiles."""
    steps = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                step = json.loads(line)
                steps.append({"features": dict(step["features"]), "seconds": float(step["seconds"]),
                              "copies": bool(step.get("copies", False)),
                              **{k: None if step.get(k) is None else [int(b) for b in step[k]]
                                 for k in ("load_bytes", "prefetch_bytes")},
                              "gc_s": float(step.get("gc_s", 0.0)),
                              "graphs": int(step.get("graphs", 0)),
                              "compiles": [str(k) for k in step.get("compiles", [])]})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"step log {path} line {n}: not a step ({e}); expected "
                                 '{"features": {...}, "seconds": s, "copies": bool}') from None
    return steps

