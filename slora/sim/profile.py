"""Calibration: measure a real engine's step latencies and adapter copies, fit the cost model.

    slora profile --model DIR -o profile.json          (on the GPU the simulation is about)

What it measures, on the engine as it serves (the same `Engine.step()` a replay runs, so
scheduling, batch metadata, the forward, sampling and output building are all in the time):

1. Steps over a grid of batch shapes: for each (batch size, prompt length, adapter mix), half
   the requests arrive first and the rest one step later, so the steps are pure prefill, mixed
   prefill + decode, then pure decode at growing context. Adapter mixes: base model only, one
   adapter for all, distinct adapters of mixed ranks. `Engine.warmup()` runs first, so kernel
   compilation, graph captures and allocator growth land before any timed step. Steps that
   copied an adapter are left out: copies are measured on their own. With
   `EngineConfig.async_scheduling` the steps are timed in its order, between collections
   (`slora.sim.steplog.logged_steps`), and the profile says so (`Profile.async_scheduling`):
   simulate in the order the profile was measured in.
2. Steps over context already in the pages (`measure_context`): a long prompt's later chunks,
   and prompts whose prefix the prefix cache holds, whose new tokens attend to more context
   than they are; the grid's whole prompts alone would leave the attention term to the
   shortest contexts.
3. Steps of serving: a short synthetic trace replayed on the wall clock (`measure_serving`),
   for the steps a server runs that the grid's batches, arriving together, do not.
4. Host -> device copies of adapters of each rank into their pool pages, and host-cache misses
   (the runner's read-and-pack path; for synthetic adapters that is the pinned host copy),
   fitted as overhead + bytes / bandwidth.
5. Prefetch overlap: a decode step timed alone, with an adapter copy injected as prefetch, and
   the copy alone; the overlap fraction is how much of the shorter one hides under the other.

Then `cost.fit_max` gives the coefficients. With `progress`, each of these shows a tqdm bar
named for it. torch is imported only here (through the engine).
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slora.config import cdiv
from slora.replay import register_adapters, replay
from slora.sim.cost import CostModel, Profile, fit_bandwidth, fit_max, sample_row
from slora.sim.steplog import PlanTap, logged_steps, read_step_log, write_step_log

__all__ = ["Grid", "GPU_GRID", "CPU_GRID", "measure_steps", "measure_context", "measure_serving",
           "measure_transfers", "measure_overlap", "profile_engine", "run_profile",
           # the step log, which calibration reads its steps with (slora.sim.steplog)
           "PlanTap", "logged_steps", "read_step_log", "write_step_log"]


@dataclass(frozen=True)
class Grid:
    """The batch shapes a profile measures. Cases whose tokens exceed `max_case_tokens` or the
    pool are skipped."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    prompt_lens: tuple[int, ...] = (16, 128, 512, 1024)
    mixes: tuple[str, ...] = ("base", "one", "distinct")
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    decode_steps: int = 4  # decode steps per case after the prefill
    max_case_tokens: int = 65536
    max_adapters: int = 128  # distinct adapters registered for the "distinct" mix
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    transfer_repeats: int = 5
    overlap_repeats: int = 5
    # serving steps (see measure_serving): seconds of a synthetic trace, its rate, adapter
    # count and lengths (uniform, inclusive), and the most of its decode steps the fit takes
    serve_s: float = 40.0
    serve_rate: float = 8.0
    serve_adapters: int = 500
    serve_lengths: tuple[int, int] = (8, 511)
    serve_max_steps: int = 600
    # steps over context already in the pages (see measure_context): single prompts of these
    # lengths, prefilled in the engine's chunks; and batches of `cached_batches` requests of
    # `cached_new` new tokens each after a cached prefix of each of `cached_prefixes` tokens
    long_prompts: tuple[int, ...] = (3584, 8192)
    cached_prefixes: tuple[int, ...] = (512, 2048)
    cached_batches: tuple[int, ...] = (1, 8, 32)
    cached_new: int = 64


GPU_GRID = Grid()
# The CPU grid: small shapes for tiny models (the tests calibrate on it in seconds).
CPU_GRID = Grid(batches=(1, 2, 4, 8, 16), prompt_lens=(4, 16, 48), ranks=(4, 8, 16), decode_steps=3,
                max_case_tokens=2048, max_adapters=16, transfer_repeats=3, overlap_repeats=3,
                serve_s=1.5, serve_rate=40.0, serve_adapters=8, serve_lengths=(8, 48),
                serve_max_steps=200, long_prompts=(96,), cached_prefixes=(32,),
                cached_batches=(1, 4), cached_new=8)


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.runner.device)


def _graph_memory(engine) -> str:
    """", N graphs, device memory reserved beyond the pool" on CUDA; "" elsewhere."""
    graphs = engine.runner.graphs
    if graphs is None or engine.runner.device.type != "cuda":
        return ""
    import torch

    runner = engine.runner
    extra = torch.cuda.memory_reserved(runner.device) - runner.pool.numel() * runner.pool.element_size()
    return f", {len(graphs.graphs)} graphs, {extra / 2**30:.1f} GiB reserved besides the pool (weights, graphs, cache)"


def measure_serving(engine, grid: Grid, log: Callable[[str], None] = print,
                    seed: int = 7, progress: bool = False) -> list[dict]:
    """Steps of serving: a short synthetic trace (S-LoRA's S2 shape, with its own seed, rate
    and adapter count) replayed on the wall clock, its steps logged as the grid's are.

    The grid's steps come from batches that arrive together. A server's come from a running
    batch of mixed contexts and adapters that one arrival at a time joins and one finish at a
    time leaves; such steps take longer than grid steps of the same features, so a fit to the
    grid alone under-predicts a replay. Steps that copied adapters are left out, as in the
    grid. Every step with prompts is kept (a first token waits on one, and they are a small
    share of the steps); of the decode steps at most `serve_max_steps`, evenly spaced, so the
    grid's shapes keep their weight in the fit. `progress`: a bar over the trace's requests."""
    if grid.serve_s <= 0:
        return []
    from slora.workload import synthesize

    trace = synthesize(num_adapters=grid.serve_adapters, rate=grid.serve_rate, cv=1, alpha=1,
                       duration=grid.serve_s, input_len=grid.serve_lengths,
                       output_len=grid.serve_lengths, ranks=grid.ranks, seed=seed)
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    # The trace's adapters resident first, as many as half the free pages hold: a server's
    # steps mostly run adapters already in the pool, and a step that copies one is left out.
    infos, room, resident = engine.adapters.adapters, engine.allocator.num_free // 2, []
    for name in dict.fromkeys(r.adapter for r in trace.requests if r.adapter is not None):
        if infos[name].num_pages <= room:
            room -= infos[name].num_pages
            resident.append(name)
    _warm_adapters(engine, resident)
    with logged_steps(engine) as steps:
        replay(engine, trace, vocab_size=engine.model_config.vocab_size, seed=seed,
               progress=progress, label="profile: serving trace")
    steps = [s for s in steps if not s["copies"]]
    prompts = [s for s in steps if s["features"]["prefill_tokens"]]
    decode = [s for s in steps if not s["features"]["prefill_tokens"]]
    stride = max(1, cdiv(len(decode), grid.serve_max_steps))
    samples = [{"features": s["features"], "seconds": s["seconds"], "case": {"step": "serve"}}
               for s in prompts + decode[::stride]]
    log(f"  served {len(trace)} requests over {trace.duration:.0f} s: {len(steps)} steps "
        f"without copies, {len(samples)} kept")
    return samples


def _timed_step(engine, tap: PlanTap) -> float:
    _sync(engine)
    t = time.perf_counter()
    engine.step()
    _sync(engine)
    return time.perf_counter() - t


def measure_steps(engine, grid: Grid, log: Callable[[str], None] = print, seed: int = 0,
                  progress: bool = False) -> list[dict]:
    """Step samples over `grid`: [{"features": {...}, "seconds": t, "case": ...}, ...].

    Each case's prompts run whole (`Scheduler.prompts_whole`), so its steps are the prefill,
    mixed and decode steps the case is made of; `measure_context` measures chunks. Steps are
    timed by `logged_steps`, so with async scheduling each is timed as the device runs it,
    between collections. Either way a case's steps come out in launch order: its
    prefill, its mixed step (when part of the batch arrived late), then decode.
    `progress`: bars over the warm-up's steps and the grid's cases (instead of a line per
    case)."""
    from slora.request import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    names = _profile_adapters(engine, grid)
    _warm_adapters(engine, names)
    # Compiles and graph captures off the clock: every decode bucket at every rank bucket of
    # the profiling adapters, so no timed step compiles or captures.
    log(f"  warm-up: {engine.warmup(progress=progress):.1f} s{_graph_memory(engine)}")
    samples = []
    bs = engine.config.block_size
    free_tokens = engine.allocator.num_free * bs  # without evicting the profiling adapters
    cases = [(n, plen, mix) for mix in grid.mixes for plen in grid.prompt_lens for n in grid.batches
             if n * (plen + grid.decode_steps + bs) <= min(grid.max_case_tokens, free_tokens // 2)
             and plen + grid.decode_steps + 1 < engine.max_model_len]
    bar = _bar(len(cases), "profile: batch shapes", "case", progress)
    # Prompts whole and no prefix cache, so a case's steps are the prefill, mixed and decode
    # steps it names: chunks would split its prompts over steps of other shapes, and with
    # async scheduling a chunk step's host time can land in the interval of the step before
    # it (`logged_steps` times steps between collections).
    sched = engine.scheduler
    with sched.prefix_cache_off(), sched.prompts_whole(), logged_steps(engine) as steps, bar:
        for i, (n, plen, mix) in enumerate(cases):
            adapters = [None] * n if mix == "base" else (
                [names[i % len(names)]] * n if mix == "one"
                else [names[(i + j) % len(names)] for j in range(n)])
            prompts = [[rng.randrange(vocab) for _ in range(plen)] for _ in range(n)]
            sp = SamplingParams(max_tokens=grid.decode_steps + 1, ignore_eos=True)
            # Half the batch arrives a step late (a mixed step of n/2 decode rows and n/2
            # prompts), or, every other case, one request does: the mixed step a server sees
            # most, a running batch and one arrival.
            first = max(1, n // 2 if i % 2 == 0 else n - 1)
            for p, a in zip(prompts[:first], adapters[:first]):
                engine.add_request(p, sp, a)
            pending = list(zip(prompts[first:], adapters[first:]))
            done = len(steps)
            while engine.has_unfinished():
                engine.step()
                for p, a in pending:
                    engine.add_request(p, sp, a)
                pending = []
            # (every step of the case is collected by now: the engine is idle)
            kinds = ["prefill", "mixed" if first < n else "decode"]
            for k, step in enumerate(steps[done:]):
                if not step["copies"]:
                    samples.append({"features": step["features"], "seconds": step["seconds"],
                                    "case": {"batch": n, "prompt_len": plen, "mix": mix,
                                             "step": kinds[k] if k < 2 else "decode"}})
            last = steps[-1]["seconds"] * 1e3 if len(steps) > done else float("nan")
            case = f"batch {n}, prompt {plen}, {mix}: last step {last:.2f} ms"
            if progress:
                bar.set_postfix_str(case, refresh=False)
                bar.update()
            else:
                log(f"  case {i + 1}/{len(cases)}: {case}")
    return samples


def measure_context(engine, grid: Grid, log: Callable[[str], None] = print, seed: int = 1,
                    progress: bool = False) -> list[dict]:
    """Step samples whose prompts attend to context already in their pages: each of
    `grid.long_prompts` alone, prefilled in the engine's chunks (`max_prefill_chunk`), each
    chunk over the ones before it; then, with prefix caching on, for each prefix length in
    `grid.cached_prefixes` one request computes the prefix and batches of `cached_batches`
    requests follow, each the prefix and `cached_new` tokens of its own, so a step computes
    few tokens over a long context. Each case runs on the base model and on one adapter.
    Cases beyond the model's length or half the free pool are skipped; steps that copied an
    adapter are left out, as in the grid. `progress`: a bar over the cases."""
    from slora.request import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    adapter = _profile_adapters(engine, grid)[0]
    room = engine.allocator.num_free * engine.config.block_size // 2  # (no page cached yet)
    fits = lambda tokens, longest: tokens <= room and longest + 2 < engine.max_model_len  # noqa: E731
    cases = [("long", n, 0, 1) for n in grid.long_prompts if fits(n, n)]
    if engine.config.enable_prefix_caching:
        cases += [("cached", grid.cached_new, c, n) for c in grid.cached_prefixes
                  for n in grid.cached_batches
                  if fits(c + n * (c + grid.cached_new), c + grid.cached_new)]
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    samples = []
    with logged_steps(engine) as steps, _bar(2 * len(cases), "profile: long context", "case",
                                             progress) as bar:
        for kind, new, cached, n in cases:
            for name in (None, adapter):
                prefix = tokens(cached)
                if cached:  # computes the prefix, cached for the batch
                    engine.generate([prefix + tokens(new)], sp, adapters=[name])
                done = len(steps)
                engine.generate([prefix + tokens(new) for _ in range(n)], sp, adapters=[name] * n)
                samples += [{"features": s["features"], "seconds": s["seconds"],
                             "case": {"step": kind, "batch": n, "prompt_len": cached + new,
                                      "cached": cached, "mix": "base" if name is None else "one"}}
                            for s in steps[done:] if not s["copies"]]
                bar.update()
    engine.reset_prefix_cache()  # the cases' prefixes are no later step's
    log(f"  {len(cases)} long-context cases: {len(samples)} steps")
    return samples


def _bar(total: int, label: str, unit: str, enabled: bool):
    """A tqdm bar on stderr (a no-op one when not `enabled`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit=unit, disable=not enabled, dynamic_ncols=True)


def _profile_adapters(engine, grid: Grid) -> list[str]:
    names = []
    for j in range(grid.max_adapters):
        name = f"__profile_{j}"
        if name not in engine.adapters.adapters:
            engine.add_synthetic_adapter(name, grid.ranks[j % len(grid.ranks)], grid.targets)
        names.append(name)
    return names


def _warm_adapters(engine, names: list[str]) -> None:
    """Make every profiling adapter resident (and its host copy built) before timing."""
    from slora.request import SamplingParams

    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    for start in range(0, len(names), 16):
        engine.generate([[1, 2]] * len(names[start:start + 16]), sp, adapters=names[start:start + 16])


def measure_transfers(engine, grid: Grid, log: Callable[[str], None] = print,
                      progress: bool = False) -> dict:
    """Adapter copies: host -> pool pages, and host-cache misses. Returns the fitted numbers
    and the points: {"h2d": [[bytes, s], ...], "disk": [...], ...}. `progress`: a bar over
    the ranks, the line per rank after it."""
    names = {}
    for name, info in engine.adapters.adapters.items():
        if name.startswith("__profile_") and info.resident:
            names.setdefault(info.layout.max_rank, name)
    h2d, disk, lines = [], [], []
    runner, adapters = engine.runner, engine.adapters
    with _bar(len(names), "profile: adapter copies", "rank", progress) as bar:
        for rank, name in sorted(names.items()):
            _time_copies(engine, grid, name, h2d, disk)
            info = adapters.adapters[name]
            lines.append(
                f"  rank {rank}: {info.nbytes / 1e6:.1f} MB, copy "
                f"{statistics.median(t for b, t in h2d if b == info.nbytes) * 1e3:.3f} ms, host "
                f"miss {statistics.median(t for b, t in disk if b == info.nbytes) * 1e3:.3f} ms")
            bar.update()
    for line in lines:
        log(line)
    overhead, h2d_gbps = fit_bandwidth(h2d)
    _, disk_gbps = fit_bandwidth(disk)
    return {"load_overhead_s": overhead, "h2d_gbps": h2d_gbps or 1e4, "disk_gbps": disk_gbps,
            "h2d": [list(p) for p in h2d], "disk": [list(p) for p in disk]}


def _time_copies(engine, grid: Grid, name: str, h2d: list, disk: list) -> None:
    """Append (bytes, seconds) of `name`'s host -> pool copies to `h2d` (the first, a warm-up,
    left out) and of its host-cache misses to `disk`."""
    runner, adapters = engine.runner, engine.adapters
    info = adapters.adapters[name]
    runner.host_tier.host_copy(info, adapters)  # ensure a host copy
    for _ in range(grid.transfer_repeats + 1):
        _sync(engine)
        t = time.perf_counter()
        runner.host_tier.load([(name, info.pages)], adapters)
        _sync(engine)
        h2d.append((info.nbytes, time.perf_counter() - t))
    del h2d[-grid.transfer_repeats - 1]  # the first of each size warms up
    for _ in range(grid.transfer_repeats):
        runner.host_tier.drop(name)
        adapters.drop_host(name)
        t = time.perf_counter()
        runner.host_tier.host_copy(info, adapters)
        disk.append((info.nbytes, time.perf_counter() - t))


def measure_overlap(engine, grid: Grid, log: Callable[[str], None] = print, seed: int = 0,
                    progress: bool = False) -> dict:
    """How much of a prefetch copy hides under a decode step: 0 (they add) .. 1 (max of the two).
    `progress`: a bar over the timed steps."""
    from slora.request import SamplingParams

    rng = random.Random(seed)
    adapters, runner = engine.adapters, engine.runner
    resident = [(i.num_pages, n) for n, i in adapters.adapters.items()
                if n.startswith("__profile_") and i.resident]
    name = max(resident)[1]
    info = adapters.adapters[name]
    runner.host_tier.host_copy(info, adapters)
    n = max(b for b in grid.batches if b <= 64)
    plen = sorted(grid.prompt_lens)[len(grid.prompt_lens) // 2]
    steps = 2 * grid.overlap_repeats + 2
    cfg = engine.config
    budget = min(cfg.max_batch_tokens, cfg.max_prefill_chunk or cfg.max_batch_tokens)
    sp = SamplingParams(max_tokens=steps + 2 + n * plen // budget, ignore_eos=True)
    for _ in range(n):
        engine.add_request([rng.randrange(engine.model_config.vocab_size) for _ in range(plen)], sp)
    tap = PlanTap(engine)
    alone, both, copy = [], [], []
    bar = _bar(steps, "profile: prefetch overlap", "step", progress)
    try:
        engine.step()
        sched = engine.scheduler
        # prefill everyone (every chunk): the timed steps are pure decode
        while sched.waiting or any(r.num_new > 1 for r in sched.running):
            engine.step()
        for k in range(steps):
            tap.inject = (name, info.pages) if k % 2 else None
            t = _timed_step(engine, tap)
            if k >= 2:
                (both if k % 2 else alone).append(t)
            _sync(engine)
            t = time.perf_counter()
            runner.host_tier.load([(name, info.pages)], adapters)
            _sync(engine)
            copy.append(time.perf_counter() - t)
            bar.update()
        while engine.has_unfinished():
            tap.inject = None
            engine.step()
    finally:
        tap.close()
        bar.close()
    t_step, t_both, t_copy = (statistics.median(x) for x in (alone, both, copy))
    hidden = (t_step + t_copy - t_both) / min(t_step, t_copy)
    # A copy far shorter than the step cannot be told from timing noise; call it serial (the
    # conservative choice, and what a copy on the compute stream is). It matters little then.
    overlap = min(1.0, max(0.0, hidden)) if t_copy >= 0.1 * t_step else 0.0
    log(f"  decode step {t_step * 1e3:.2f} ms, copy {t_copy * 1e3:.2f} ms, step with prefetch "
        f"{t_both * 1e3:.2f} ms: overlap {overlap:.2f}")
    return {"prefetch_overlap": overlap, "step_s": t_step, "copy_s": t_copy, "both_s": t_both}


def load_pieces(engine) -> int:
    """In how many pieces of layers the runner copies a step's own adapters (see CostModel)."""
    if engine.runner.host_tier.copy_stream is None:  # on the compute stream, before the forward
        return 1
    return len(engine.runner.piece_starts)


def device_name(engine) -> str:
    dev = engine.runner.device
    if dev.type == "cuda":
        import torch

        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()})"


def device_memory_gb(engine) -> float | None:
    dev = engine.runner.device
    if dev.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(dev).total_memory / (1 << 30)


def profile_engine(engine, grid: Grid | None = None, model_name: str | None = None,
                   log: Callable[[str], None] = print, progress: bool = False) -> Profile:
    """Measure `engine` over `grid` (default: GPU_GRID on CUDA, CPU_GRID on CPU) and fit a Profile.

    The engine should be fresh (nothing queued); profiling adapters named `__profile_<j>` are
    registered on it. `log` gets the header, the measured copies and overlap and the fit's
    errors; `progress` shows a labelled bar over each of the six measurements in turn (the
    engine's warm-up, the grid's cases, the long-context cases, the serving trace, the
    copies, the overlap steps).
    """
    import json

    grid = grid or (GPU_GRID if engine.runner.device.type == "cuda" else CPU_GRID)
    t0 = time.perf_counter()
    order = ", async scheduling" if engine.config.async_scheduling else ""
    log(f"profiling {model_name or engine.config.model} on {device_name(engine)}{order}")
    heading = (lambda _: None) if progress else log  # the bars name each measurement
    heading("steps over the grid of batch shapes")
    samples = measure_steps(engine, grid, log, progress=progress)
    heading("steps over long context")
    samples += measure_context(engine, grid, log, progress=progress)
    heading("serving steps")
    samples += measure_serving(engine, grid, log, progress=progress)
    heading("adapter copies")
    transfers = measure_transfers(engine, grid, log, progress=progress)
    heading("prefetch overlap")
    overlap = measure_overlap(engine, grid, log, progress=progress)
    graph_tokens = engine.runner.mixed_graph_tokens
    coeffs, host, stats = fit_max([(sample_row(s["features"], graph_tokens), s["seconds"])
                                   for s in samples])
    stats["overlap"] = overlap
    stats["profile_s"] = time.perf_counter() - t0
    cost = CostModel(coeffs=coeffs, host_coeffs=host, h2d_gbps=transfers["h2d_gbps"],
                     disk_gbps=transfers["disk_gbps"], load_overhead_s=transfers["load_overhead_s"],
                     prefetch_overlap=overlap["prefetch_overlap"], load_pieces=load_pieces(engine))
    model_config = json.loads((Path(engine.config.model) / "config.json").read_text())
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    log(f"fit over {len(samples)} steps: mean relative error {stats['mean_rel_err']:.1%}, max "
        f"{stats['max_rel_err']:.1%}; h2d {cost.h2d_gbps:.1f} GB/s, host miss "
        f"{'free' if cost.disk_gbps is None else f'{cost.disk_gbps:.1f} GB/s'}")
    return Profile(model=model_name or str(engine.config.model), gpu=device_name(engine), cost=cost,
                   model_config=model_config, dtype=dtype, quantization=weights_format(engine),
                   block_size=engine.config.block_size,
                   num_pages=engine.runner.num_pages, gpu_memory_gb=device_memory_gb(engine),
                   mixed_graph_tokens=engine.runner.mixed_graph_tokens,
                   async_scheduling=engine.config.async_scheduling,
                   tensor_parallel_size=engine.config.tensor_parallel_size, fit_stats=stats,
                   samples=samples,
                   transfer_samples={"h2d": transfers["h2d"], "disk": transfers["disk"]})


def weights_format(engine) -> str | None:
    """"fp8" when the engine's base linear weights are FP8 (`EngineConfig.quantization`, or a
    pre-quantized checkpoint, which loads as FP8 without it), else None."""
    from slora.model.quant import LINEAR_FIELDS, Fp8Weight

    layer = engine.runner.model.w.layers[0]
    return "fp8" if any(isinstance(getattr(layer, f), Fp8Weight) for f in LINEAR_FIELDS) else None


def run_profile(model: str, output: str | Path | None = None, *, engine_options: dict | None = None,
                grid: Grid | None = None, model_name: str | None = None,
                log: Callable[[str], None] = print, progress: bool = False) -> Profile:
    """Build an engine for `model` (a directory with config.json; weights, or load_format="dummy"
    for random ones), profile it (`profile_engine`), and write the profile to `output` if given."""
    from slora import Engine, EngineConfig

    options = dict(engine_options or {})
    engine = Engine(EngineConfig(model=str(model), **options))
    profile = profile_engine(engine, grid, model_name or Path(model).name, log, progress)
    if output is not None:
        log(f"wrote {profile.save(output)}")
    return profile
