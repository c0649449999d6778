"""Throughput as adapters grow (S-LoRA's S2); decode steps against their byte floor.

A Llama-2-7B-shaped model with random bf16 weights (EngineConfig(load_format="dummy")), one
engine for both parts (the pool sized by gpu_memory_fraction unless --num-pages is given).

scaling: S-LoRA's S2 setting (`slora.workload.synthesize`, seed 42): --num-requests requests,
    adapter popularity alpha 1 (uniform) over N adapters, N in --adapters, ranks 64/32/16/8
    round-robin over adapters, prompt and output lengths uniform in [8, 511] (S-LoRA's
    [8, 512)). Offline: all requests submitted at once (prompts of random token ids,
    ignore_eos, max_tokens = output_len); output tok/s and req/s over the whole
    `generate` call. Synthetic adapters target q/k/v/o, then all seven modules. The no-LoRA
    row replays the same lengths with every request on the base model; ratio = lora / no-LoRA.
    The S2 trace draws popularity before lengths, so every N gets the same lengths. --alpha
    takes a list (S-LoRA's skewed popularity draws, alpha 0.1-1: most requests on a few
    adapters), each alpha a row per adapter count of two or more (one adapter takes every
    draw: its row runs once, at the first alpha); "used" counts the adapters drawn.
    Inter-token latency (ITL): the time between a request's successive tokens as the engine
    resolves them (`Scheduler.count_token_gaps`, what `slora replay` and `slora simulate`
    report), over every request's tokens after its first; p50, p99 and max per row.
    --max-prefill-chunk C1,C2,...: the rows again at each EngineConfig.max_prefill_chunk (0:
    prompts whole, unchunked), on the one engine, warmed up unchunked (every graph bucket),
    so one call sets chunk sizes side by side (throughput and p99 ITL).
    --repeats R: every row's trace R times, the rows of a chunk size interleaved (all rows
    once, then again), so drift falls on each alike; a row is its median run by tok/s
    (the lower middle one of an even count), with every run's tok/s beside it ("runs") and
    its ratio over the no-LoRA row's median run (--step-logs: each run's steps in a file of
    its own).
long: one prompt of --long-prompt tokens (random ids) and --long-output new tokens, after a
    short request that compiles the kernels: its first-token time (the chunked prefill),
    the decode time per token and the steps. For a 128k-context shape, e.g. --model
    experiments/models/llama-3-8b.
decode: at batch B in --batches, B requests with --context-token prompts, each on its own
    rank --decode-rank adapter (--decode-modules: none, q/k/v/o, all seven, or "vocab": q/k/v/o
    with embed_tokens and lm_head; with --dora, DoRA adapters on q/k/v/o and on all seven too:
    rows "qkvo-dora", "all-dora").
    Timed: the first --decode-tokens whole `engine.step()` calls (synchronised) in which all
    B requests decode and none prefills (the requests run until then, however many steps
    their prompts take, and are then aborted); median. Byte floor = bytes a decode step must
    read / measured copy bandwidth:
    weights (every linear layer and the lm_head; the embedding table is only gathered; of a
    mixture of experts, the experts the batch picks in expectation under uniform routing), the
    batch's KV (sum of context lengths x layers x 2 x kv_heads x head_dim x dtype bytes) and
    the distinct adapters' rows (rank x (d_in + d_out) per module per layer x dtype bytes; an
    embedding LoRA once, its A read one column a token: rank x (1 + hidden)).
    With --quantization fp8 the linear layers' weights count one byte each plus a 4-byte scale
    per output channel (`ModelConfig.weight_bytes`); the lm_head, KV and adapters stay in
    --dtype.

shared: the decode step when requests share adapters: at batch B in --shared-batches, B
    requests on N rank --decode-rank q/k/v/o adapters, N in --shared-adapters (0: every
    request its own), requests assigned round-robin, and with --shared-hot F a share F of
    the B requests on one adapter and each other request on its own (skewed popularity),
    timed as in decode; beside the no-LoRA row at the same batch, from the same run (vs_none:
    its step time over the row's).
--decode-lora: the decode LoRA path of every LoRA row (EngineConfig.decode_lora: auto, mbgmv,
    segments, hybrid); a list runs each row under each, MBGMV against the rows grouped by
    adapter in one call (the engine is made with "auto", whose warm-up captures the graphs of
    every path).

Synthetic adapters share one seed, so adapters of one (rank, modules) shape share one pinned
host buffer (2000 distinct ones of rank 64 on seven modules would need 640 GB of host memory);
every adapter still has its own pool pages and every load copies its full size to the device.

Writes bench_scaling.json under --out: the harness's header (GPU, commit, command, ceilings),
then the rows of each part ("scaling": output_tok_s and ratio; "decode": step_ms, floor_ms and
ratio; "shared": those and vs_none). The ceilings are measured for the decode and shared parts
alone, before the engine sizes its pool: scaling's peer is its no-LoRA row. --quantization fp8: the engine's base weights in FP8
(EngineConfig.quantization), recorded in the result; the rows keep their names, so gpu_table.py
sets an FP8 run beside a bf16 one row by row.

    python experiments/bench_scaling.py --part all
    python experiments/bench_scaling.py --part scaling --adapters 2000 --num-requests 400 --modules qkvo
    python experiments/bench_scaling.py --part scaling --adapters 2000 --num-requests 400 \
        --modules qkvo --max-prefill-chunk 0,512,1024,2048,4096
    python experiments/bench_scaling.py --part long --model experiments/models/llama-3-8b \
        --long-prompt 100000
    python experiments/bench_scaling.py --part scaling,shared --adapters 2000 --num-requests 400 \
        --modules qkvo --alpha 0.1,0.5,1 --decode-lora mbgmv,auto
    python experiments/bench_scaling.py --part decode --batches 32 --breakdown ''
    python experiments/bench_scaling.py --part decode --batches 32 --breakdown '' --quantization fp8
    python experiments/bench_scaling.py --part decode --batches 32 --breakdown '' --dora
    python experiments/bench_scaling.py --part decode --batches 32 --breakdown '' \
        --decode-modules qkvo,vocab
    python experiments/bench_scaling.py --part decode --batches 1,32 --model DIR --device cpu \
        --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_engine import MODELS, prompts  # noqa: E402
from harness import add_out_arg, ceilings, header, sync, write_result  # noqa: E402
import slora.graphs  # noqa: E402
import slora.kernels.pdl  # noqa: E402
from slora import Engine, EngineConfig, SamplingParams  # noqa: E402
from slora.config import DECODE_LORA, LORA_MODULES, VOCAB_MODULES, ModelConfig  # noqa: E402
from slora.metrics import itl_stats  # noqa: E402
from slora.sim.profile import logged_steps  # noqa: E402
from slora.sim.steplog import write_step_log  # noqa: E402
from slora.workload import synthesize  # noqa: E402

# name -> target modules of a row's synthetic adapters (None: no adapters, the base model)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
MODULE_SETS = {"none": None, "qkvo": QKVO, "all": LORA_MODULES, "vocab": QKVO + VOCAB_MODULES}
ADAPTER_SEED = 0  # one host buffer per (rank, modules); see the docstring
DORA = "-dora"  # a decode row's key suffix: DoRA adapters on the module set


def module_set(key: str):
    """(target modules or None, DoRA) of a row's key: a MODULE_SETS name, or one + DORA."""
    return MODULE_SETS[key.removesuffix(DORA)], key.endswith(DORA)


def adapter_bytes(cfg: ModelConfig, rank: int, modules, dtype_bytes: int,
                  dora: bool = False) -> int:
    """Bytes of an adapter's rows a decode token reads (no page or alignment padding): A and B
    of the linear modules in every layer (and their DoRA rows with `dora`), lm_head's once,
    embed_tokens' B and one column of its A."""
    linear = [m for m in modules if m in LORA_MODULES]
    rows = rank * sum(sum(cfg.module_dims(m)) for m in linear)
    if dora:
        rows += sum(cfg.module_dims(m)[1] for m in linear)
    vocab = sum(1 + cfg.hidden_size if m == "embed_tokens" else sum(cfg.module_dims(m))
                for m in modules if m in VOCAB_MODULES)
    return (cfg.num_layers * rows + rank * vocab) * dtype_bytes


def weight_read_bytes(cfg: ModelConfig, dtype_bytes: int, quantization: str | None = None,
                      tokens: int | None = None) -> int:
    """Weights a decode step of `tokens` rows reads: all of them but an untied embedding table
    (gathered) and, in a mixture of experts, the experts no row picks: of E experts with k
    picked a row, E (1 - (1 - k / E)^tokens) are picked in expectation under uniform routing
    (every expert where `tokens` is None); `quantization` "fp8": the linear layers' in FP8
    with their scales."""
    emb = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * dtype_bytes
    idle = 0.0
    if cfg.num_experts and tokens is not None:
        e, k = cfg.num_experts, cfg.experts_per_token
        per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size * dtype_bytes
        layers = sum(cfg.experts_in(layer) for layer in range(cfg.num_layers))
        idle = layers * per_expert * e * (1 - k / e) ** tokens
    return cfg.weight_bytes(dtype_bytes, quantization) - emb - int(idle)


def add_adapters(eng: Engine, ranks: dict[str, int], modules, dora: bool = False) -> None:
    for name, rank in ranks.items():
        eng.add_synthetic_adapter(name, rank, modules, seed=ADAPTER_SEED, dora=dora)


def remove_adapters(eng: Engine, names) -> None:
    for name in names:
        eng.remove_adapter(name)  # frees its pool pages: the next row starts from an empty pool


class StepLog:
    """Wraps the runner's launch to record what each step ran, and the device time of its
    launch (None with async scheduling, whose steps must not be synchronised)."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.last = eng, None
        launch, timed = eng.runner.launch, not eng.config.async_scheduling

        def logged(plan, adapters, prev=None):
            if timed:
                sync(eng.runner.device)
            t0 = time.perf_counter()
            out = launch(plan, adapters, prev)
            if timed:
                sync(eng.runner.device)
            self.last = {"execute_ms": (time.perf_counter() - t0) * 1e3 if timed else None,
                         "decode": len(plan.decode), "prefill": len(plan.prefill),
                         "loads": len(plan.adapter_loads) + len(plan.prefetch),
                         "kv_tokens": sum(r.num_tokens for r in plan.decode)}
            return out

        eng.runner.launch = logged

    def close(self) -> None:
        del self.eng.runner.launch  # back to the class's method


HOST_BOUND_MS = 0.5  # a collect that waited less for the device found it idle (`_tail`)


class HostPhases:
    """The host's time in each phase of every step, added to the step log's entries as
    "host_ms" {phase: ms}: scheduling, adapter staging, launch (and within it: the batch's
    preparation, the graph's inputs fed and its replay, the step's own adapter loads and its
    prefetches), the collect's wait for the device ("wait": the sampled tokens' event) and
    the rest of the collect, the scheduler's resolve. A step whose time exceeds its device
    work shows here where the host spent it. Each step gets its own phases: with async
    scheduling one `engine.step()` call schedules and launches a step and collects an earlier
    one, so the phases up to a launch go to the plan launched (`pending`, by plan) and join
    its entry at its collect. Wraps instance attributes over whatever the methods are now;
    `close()` puts them back."""

    def __init__(self, eng: Engine, steps: list[dict]) -> None:
        self.eng, self.steps, self.cur = eng, steps, {}
        self.is_async = bool(eng.config.async_scheduling)
        self.pending: dict[int, dict] = {}  # async: id(plan) -> its phases up to its launch
        self.last: dict | None = None  # async: the phases of the step collected last
        run, graphs = eng.runner, eng.runner.graphs
        self.targets = [(eng.scheduler, "schedule", "schedule"), (eng, "_stage", "stage"),
                        (run, "launch", "launch"), (run.batches, "prepare", "prepare"),
                        (run.host_tier, "load_for_step", "loads"),
                        (run.host_tier, "prefetch", "prefetch"),
                        (run, "collect", "collect"), (eng.scheduler, "resolve", "resolve")]
        if graphs is not None:
            self.targets += [(graphs, "feed", "feed"), (graphs, "replay", "replay")]
        self.saved = [(obj, name, name in vars(obj), getattr(obj, name))
                      for obj, name, _ in self.targets]
        for obj, name, phase in self.targets:
            setattr(obj, name, self._timed(getattr(obj, name), phase))
        self.step = eng.step
        eng.step = self._step

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            n = len(self.steps)
            try:
                if phase == "collect" and args and getattr(args[0], "done", None) is not None:
                    args[0].done.synchronize()  # the device's part of the collect, alone
                    t1 = time.perf_counter()
                    self.cur["wait"] = self.cur.get("wait", 0.0) + (t1 - t0) * 1e3
                    t0 = t1
                return fn(*args, **kwargs)
            finally:
                self.cur[phase] = self.cur.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
                if self.is_async:
                    self._attribute(phase, args, len(self.steps) > n)
        return timed

    def _attribute(self, phase: str, args, logged: bool) -> None:
        """Async scheduling: a launch closes its plan's phases so far; a collect that logged
        its step gives the entry them and its own; the resolve after it adds to that entry."""
        if phase == "launch" and args:
            self.pending[id(args[0])], self.cur = self.cur, {}
        elif phase == "collect" and args and args[0] is not None:
            own = self.pending.pop(id(args[0].plan), {})
            if logged:
                self.last = self.steps[-1]["host_ms"] = {**own, **self.cur}
            self.cur = {}
        elif phase == "resolve" and self.last is not None:
            self.last["resolve"] = self.last.get("resolve", 0.0) + self.cur.pop("resolve")

    def _step(self):
        self.cur, self.last = {}, None
        n = len(self.steps)
        out = self.step()
        if not self.is_async and len(self.steps) > n:
            self.steps[-1]["host_ms"] = self.cur
        return out

    def close(self) -> None:
        self.eng.step = self.step
        for obj, name, own, fn in self.saved:
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)


def itl_ms(gaps) -> dict:
    """A run's inter-token latencies (`Scheduler.count_token_gaps`: seconds between a request's
    successive tokens as the engine resolves them -> tokens) as p50, p99 and max in ms."""
    return {k.replace("_s", "_ms"): v * 1e3 if v is not None else 0.0
            for k, v in itl_stats(gaps).items()} | {"itl_tokens": sum(gaps.values())}


def set_prefill_chunk(eng: Engine, chunk: int) -> None:
    """Run the engine on with EngineConfig.max_prefill_chunk = `chunk`: a setting only the
    scheduler reads, step by step (one engine and one warm-up for every chunk size swept)."""
    eng.config = eng.config.replace(max_prefill_chunk=chunk)
    eng.scheduler.config = eng.scheduler.config.replace(max_prefill_chunk=chunk)


# ----------------------------------------------------------------------------- scaling

def decode_lora(eng: Engine, mode: str) -> None:
    """Run the engine's next decode steps' LoRA by `mode` (EngineConfig.decode_lora's values),
    where its backend has the choice (the torch backend has one path)."""
    if eng.runner.batches.decode_lora is not None:
        eng.runner.batches.decode_lora = mode


def s2_trace(args, num_adapters: int, alpha: float = 1.0):
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    return synthesize(num_adapters=num_adapters, rate=args.num_requests, cv=1.0, alpha=alpha,
                      duration=1.0, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out),
                      ranks=args.ranks, seed=args.seed)


class StepTrace:
    """torch.profiler over an engine's steps `skip` to `skip + n` (host and device, or the
    device alone: CUPTI's kernels and copies, without the per-op host overhead that stretches
    the host's gaps), for S2's stalls: `table()` lists the ops with the most host time and
    with the most device time. Wraps whatever `eng.step` is now (`logged_steps`' wrapper,
    inside its block) and puts it back after them or at `close()`."""

    def __init__(self, eng: Engine, n: int, skip: int = 0, device_only: bool = False) -> None:
        cuda = eng.runner.device.type == "cuda"
        acts = ([] if device_only and cuda else [torch.profiler.ProfilerActivity.CPU]) + \
            ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.eng, self.n, self.skip, self.count = eng, n, skip, 0
        self.own = "step" in vars(eng)  # an instance attribute already (a wrapper)
        self.step = eng.step
        self.prof, self.events = torch.profiler.profile(activities=acts), None
        if skip == 0:
            self.prof.start()
        eng.step = self.traced

    def traced(self):
        out = self.step()
        self.count += 1
        if self.count == self.skip:
            self.prof.start()
        elif self.count == self.skip + self.n:
            self.close()
        return out

    def close(self) -> None:
        if self.events is not None:
            return
        sync(self.eng.runner.device)
        if self.count < self.skip:  # the run ended before the traced steps began
            self.prof.start()
        self.prof.stop()
        self.events = self.prof.key_averages()
        if self.own:
            self.eng.step = self.step
        else:
            del self.eng.step  # the class's method again

    def export(self, path: str) -> None:
        """The traced steps' timeline, for chrome://tracing or Perfetto (gzipped: *.json.gz)."""
        self.close()
        self.prof.export_chrome_trace(path)

    def table(self, rows: int = 12) -> str:
        keys = ["self_cpu_time_total"] + (["self_device_time_total"]
                                          if any(e.self_device_time_total for e in self.events)
                                          else [])
        return "\n".join(self.events.table(sort_by=k, row_limit=rows, max_name_column_width=60)
                         for k in keys)


def scaling_row(eng: Engine, args, trace, modules_key: str, ref_lens, run: int = 1) -> dict:
    """One S2 run of `trace` (`run`: its number among the point's --repeats, which names its
    step log and timeline when there are several)."""
    modules = MODULE_SETS[modules_key]
    lens = [(r.prompt_len, r.output_len) for r in trace.requests]
    assert lens == ref_lens, "the S2 trace should give every adapter count the same lengths"
    if modules is not None:
        add_adapters(eng, trace.adapters, modules)
    vocab = eng.model_config.vocab_size
    longest = prompts(len(lens), max(n for n, _ in lens), vocab, args.seed)
    ps = [p[:n] for p, (n, _) in zip(longest, lens)]
    sps = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lens]
    names = [r.adapter for r in trace.requests] if modules is not None else None
    # every row and repeat runs the same prompts: a cold prefix cache, so none finds another
    # run's KV (a row counts only the hits within its own trace, `prefix_hit_tokens`)
    eng.reset_prefix_cache()
    before = eng.stats()
    sync(eng.runner.device)
    t0 = time.perf_counter()
    traced = None
    with logged_steps(eng, allocs=True) as steps:  # where the time goes: with prompts or not
        if args.trace_steps:
            traced = StepTrace(eng, args.trace_steps, args.trace_skip, args.trace_device_only)
        phases = HostPhases(eng, steps) if args.step_logs else None
        with eng.scheduler.count_token_gaps() as gaps:
            outs = eng.generate(ps, sps, adapters=names, use_tqdm=sys.stderr.isatty())
        if phases is not None:
            phases.close()
        if traced is not None:
            traced.close()
    sync(eng.runner.device)
    wall = time.perf_counter() - t0
    mixed = [s["seconds"] for s in steps if s["features"]["prefill_tokens"]]
    eager = [s["seconds"] for s in steps if s["features"]["eager"]]
    after = eng.stats()
    if modules is not None:
        remove_adapters(eng, trace.adapters)
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"scaling: {len(failed)} of {len(outs)} requests failed, the first "
                           f"with: {failed[0].error}")
    out_toks = sum(len(o.token_ids) for o in outs)
    itl = itl_ms(gaps)
    out = Path(args.out)
    tag = (f"chunk{eng.config.max_prefill_chunk}-"
           f"{len(trace.adapters) if modules is not None else 0}-{modules_key}"
           + (f"-run{run}" if args.repeats > 1 else ""))
    if args.step_logs:  # every step's features and time, for `slora profile --add-steps` or study
        out.mkdir(parents=True, exist_ok=True)
        write_step_log(steps, out / f"steps-{tag}.jsonl")
    if traced is not None:
        # the timeline and every step's features, for finding where a row's time goes
        out.mkdir(parents=True, exist_ok=True)
        traced.export(str(out / f"timeline-{tag}.json.gz"))
        (out / f"steps-{tag}.json").write_text(json.dumps(steps))
        print(f"trace of steps {args.trace_skip}-{args.trace_skip + args.trace_steps - 1}, modules {modules_key}, "
              f"{len(trace.adapters) if modules is not None else 0} adapters (step ms: "
              + ", ".join(f"{s['seconds'] * 1e3:.0f}" for s in steps[args.trace_skip:args.trace_skip + args.trace_steps][:40])
              + ")\n" + traced.table(), flush=True)
    return {
        "adapters": len(trace.adapters) if modules is not None else 0,
        "modules": modules_key, "max_prefill_chunk": eng.config.max_prefill_chunk,
        "requests": len(outs), **itl,
        "adapters_used": len(trace.adapter_names()) if modules is not None else 0,
        "prompt_tokens": sum(n for n, _ in lens), "output_tokens": out_toks,
        "wall_s": wall, "output_tok_s": out_toks / wall, "req_s": len(outs) / wall,
        "steps": len(steps), "mixed_steps": len(mixed), "mixed_s": sum(mixed),
        "eager_steps": len(eager), "eager_s": sum(eager),  # steps past the graphs (a subset of mixed)
        # stalls: graphs captured while serving, the garbage collector, the longest steps
        "captures": sum(s["graphs"] for s in steps), "gc_s": sum(s["gc_s"] for s in steps),
        "compiles": [k for s in steps for k in s["compiles"]],
        "cuda_mallocs": sum(s["allocs"]["device"] for s in steps if s.get("allocs")),
        "longest": [{"ms": s["seconds"] * 1e3, "compiles": s["compiles"],
                     "allocs": s.get("allocs"), **_copies(s), **s["features"]}
                    for s in sorted(steps, key=lambda s: -s["seconds"])[:5]],
        "tail": _tail(steps, itl["itl_p99_ms"]),
        "not_length": sum(o.finish_reason != "length" for o in outs),
        **{k: after[k] - before[k] for k in ("adapter_loads", "adapter_evictions", "preemptions",
                                             "prefix_hit_tokens")},
    }


def _copies(step: dict) -> dict:
    """A logged step's adapter copies (blocking loads, prefetches: count and MB) and its
    garbage-collector time."""
    loads, prefetch = step.get("load_bytes") or [], step.get("prefetch_bytes") or []
    return {"loads": len(loads), "load_mb": sum(loads) / 1e6, "prefetches": len(prefetch),
            "prefetch_mb": sum(prefetch) / 1e6, "gc_ms": step.get("gc_s", 0.0) * 1e3}


def _tail(steps: list[dict], p99_ms: float) -> dict:
    """The steps that make the inter-token latency's tail: those at least as long as its p99,
    counted by what they hold (prompt tokens, blocking adapter loads, prefetches) and split by
    kind, with their mean time; with host phases recorded (`HostPhases`), `host_bound`: those
    whose collect found the device done (under HOST_BOUND_MS of wait), so the host's work,
    not the device's, set their time (None without them)."""
    slow = [s for s in steps if p99_ms and s["seconds"] * 1e3 >= p99_ms]
    timed = all("host_ms" in s for s in slow)
    kinds = {"with_prompts": lambda s: s["features"]["prefill_tokens"] > 0,
             "with_loads": lambda s: bool(s.get("load_bytes")),
             "with_prefetch": lambda s: bool(s.get("prefetch_bytes")),
             "decode_only_no_copies": lambda s: not (s["features"]["prefill_tokens"]
                                                     or s.get("load_bytes")
                                                     or s.get("prefetch_bytes"))}
    return {"steps": len(slow),
            "mean_ms": sum(s["seconds"] for s in slow) * 1e3 / len(slow) if slow else 0.0,
            **{k: sum(map(test, slow)) for k, test in kinds.items()},
            "host_bound": (sum(s["host_ms"].get("wait", 0.0) < HOST_BOUND_MS for s in slow)
                           if timed and slow else None)}


def _stall(step: dict) -> str:
    """One of the longest steps, for the table's notes: its time, tokens, the adapter copies
    it made and, on CUDA, the allocator growth within it."""
    a = step.get("allocs")
    grew = (f", cudaMalloc x{a['device']}, pinned blocks x{a['host']} ({a['host_ms']:.1f} ms)"
            if a else "")
    copies = "".join(f", {step[n]} {n} ({step[mb]:.0f} MB)"
                     for n, mb in (("loads", "load_mb"), ("prefetches", "prefetch_mb")) if step.get(n))
    return (f"{step['ms']:.0f} ms ({step['prefill_tokens']} prompt tokens, "
            f"{step['decode_seqs']} decode rows{copies}{grew})")


def graph_pool_gib() -> float:
    """GiB the CUDA graphs' private memory pools hold (segments of this device's allocator
    owned by a pool other than the default one)."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)) / 2**30


RUN_PARTS = ("output_tok_s", "wall_s", "mixed_s", "eager_s", "gc_s", "captures", "cuda_mallocs")


def median_run(runs: list[dict]) -> dict:
    """The median of one point's runs by output tok/s (the lower middle one of an even count),
    with every run's tok/s in run order as "runs", and where each run's time went as
    "run_parts" (RUN_PARTS of each, and its compiles while serving)."""
    tok_s = [r["output_tok_s"] for r in runs]
    row = min(runs, key=lambda r: abs(r["output_tok_s"] - statistics.median_low(tok_s)))
    parts = [{**{k: r.get(k) for k in RUN_PARTS}, "compiles": len(r["compiles"])} for r in runs]
    return {**row, "runs": tok_s, "run_parts": parts}


def part_scaling(eng: Engine, args) -> list[dict]:
    t0 = time.perf_counter()
    if args.max_prefill_chunk:
        set_prefill_chunk(eng, 0)  # the warm-up's prompts whole: every graph bucket, every size
    # kernel compiles and every graph (each bucket, base and each rank and module set) off the clock
    t = eng.warmup(ranks=args.ranks, modules=[MODULE_SETS[m] for m in args.modules])
    mem = ""
    if eng.runner.device.type == "cuda":  # what the graphs and activations left free
        free, total = torch.cuda.mem_get_info(eng.runner.device)
        mem = (f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, graph pools "
               f"{graph_pool_gib():.2f} GiB")
    print(f"scaling: warm-up {t:.1f} s{mem}", flush=True)
    base_trace = s2_trace(args, 0)
    ref_lens = [(r.prompt_len, r.output_len) for r in base_trace.requests]
    # one adapter takes every draw whatever the popularity: its trace runs at the first alpha
    # alone, not again back to back at the others
    points = [(base_trace, "none", 1.0, None)] + [
        (s2_trace(args, n, a), m, a, mode) for mode in args.decode_lora for m in args.modules
        for n in args.adapters for a in (args.alpha if n > 1 else args.alpha[:1])]
    rows = []
    for chunk in args.max_prefill_chunk or [eng.config.max_prefill_chunk]:
        set_prefill_chunk(eng, chunk)
        runs = [[] for _ in points]  # each point's runs, the points interleaved
        for run in range(1, args.repeats + 1):
            for i, (trace, key, alpha, mode) in enumerate(points):
                if mode is not None:
                    decode_lora(eng, mode)
                row = scaling_row(eng, args, trace, key, ref_lens, run)
                row.update(alpha=alpha, decode_lora=mode)
                runs[i].append(row)
                print(f"scaling: chunk {chunk}, {row['adapters']} adapters, modules {key}, "
                      f"alpha {alpha}, decode LoRA {mode}: {row['output_tok_s']:.0f} tok/s "
                      f"{row['req_s']:.2f} req/s, ITL p99 {row['itl_p99_ms']:.1f} ms "
                      f"({row['wall_s']:.1f} s; {time.perf_counter() - t0:.0f} s into the part)",
                      flush=True)
        chosen = [median_run(r) for r in runs]
        for row in chosen:  # (the first point is the no-LoRA row at this chunk size)
            row["ratio"] = row["output_tok_s"] / chosen[0]["output_tok_s"]
        rows += chosen
    decode_lora(eng, eng.config.decode_lora)
    print(f"\nS2 offline throughput, {args.num_requests} requests, lengths in "
          f"{args.input_len}/{args.output_len}, ranks {args.ranks}")
    print(f"{'chunk':>6}{'adapters':>9}{'modules':>8}{'alpha':>6}{'path':>9}{'used':>6}"
          f"{'tok/s':>9}{'req/s':>8}{'ratio':>7}{'ITL p50':>8}{'p99':>7}{'max ms':>7}"
          f"{'loads':>7}{'evict':>7}{'preempt':>8}{'wall s':>8}{'steps':>7}{'mixed':>7}"
          f"{'mixed s':>8}{'eager':>6}{'eager s':>8}{'graphs':>7}{'compiles':>9}{'longest ms':>11}")
    for r in rows:
        print(f"{r['max_prefill_chunk']:>6}{r['adapters']:>9}{r['modules']:>8}{r['alpha']:>6}"
              f"{r['decode_lora'] or '-':>9}{r['adapters_used']:>6}{r['output_tok_s']:>9.0f}"
              f"{r['req_s']:>8.2f}{r['ratio']:>7.3f}{r['itl_p50_ms']:>8.1f}{r['itl_p99_ms']:>7.1f}"
              f"{r['itl_max_ms']:>7.0f}{r['adapter_loads']:>7}"
              f"{r['adapter_evictions']:>7}{r['preemptions']:>8}{r['wall_s']:>8.1f}"
              f"{r['steps']:>7}{r['mixed_steps']:>7}{r['mixed_s']:>8.1f}"
              f"{r['eager_steps']:>6}{r['eager_s']:>8.1f}{r['captures']:>7}"
              f"{len(r['compiles']):>9}"
              f"{r['longest'][0]['ms'] if r['longest'] else 0:>11.1f}")
    print(f"(chunk: max_prefill_chunk, 0 = prompts whole; ITL: inter-token latency; "
          f"mixed: steps with prompts, graphed up to {eng.runner.mixed_graph_tokens} tokens, "
          "eager past that; mixed s: their wall time; eager: the eager ones; graphs, compiles: "
          "CUDA graphs captured and Triton kernels compiled while serving)")
    for r in rows:
        if len(r["runs"]) > 1:
            print(f"  runs, chunk {r['max_prefill_chunk']}, {r['adapters']} adapters "
                  f"{r['modules']}, alpha {r['alpha']}: "
                  + ", ".join(f"{t:.0f}" for t in r["runs"])
                  + f" tok/s (spread {(max(r['runs']) - min(r['runs'])) / r['output_tok_s']:.1%})")
            for i, p in enumerate(r["run_parts"]):  # where a slow run's time went
                print(f"    run {i + 1}: {p['output_tok_s']:.0f} tok/s, {p['wall_s']:.2f} s: "
                      f"with prompts {p['mixed_s']:.2f} s (eager {p['eager_s']:.2f} s), "
                      f"the rest (decode alone) {p['wall_s'] - p['mixed_s']:.2f} s, "
                      f"gc {p['gc_s']:.3f} s, "
                      f"{p['captures']} captures, {p['compiles']} compiles, "
                      f"{p['cuda_mallocs']} cudaMalloc")
        if r["compiles"]:
            print(f"  compiled while serving, {r['adapters']} adapters {r['modules']}: "
                  + ", ".join(sorted({c.split("[")[0] for c in r["compiles"]})))
        print(f"  longest steps, {r['adapters']} adapters {r['modules']}: "
              + "; ".join(_stall(s) for s in r["longest"][:3]))
        t = r["tail"]
        print(f"  steps at or past the ITL p99, chunk {r['max_prefill_chunk']}, {r['adapters']} "
              f"adapters {r['modules']}: {t['steps']} (mean {t['mean_ms']:.1f} ms): "
              f"{t['with_prompts']} with prompts, {t['with_loads']} with adapter loads, "
              f"{t['with_prefetch']} with prefetches, {t['decode_only_no_copies']} decode alone"
              + ("" if t.get("host_bound") is None else f", {t['host_bound']} host-bound"))
    return rows


# ----------------------------------------------------------------------------- decode

def decode_row(eng: Engine, args, batch: int, modules_key: str, copy_GBps: float,
               adapters: int = 0, hot: float = 0.0) -> dict:
    """The first --decode-tokens steps in which all `batch` requests decode (no prompt, no
    adapter load), on `adapters` adapters of `modules_key` (0: one each), assigned
    round-robin, or with `hot` > 0 a share `hot` of the rows on one adapter and every other
    row on its own; the byte floor counts each distinct adapter once. The requests run until
    those steps are timed, however many steps their prompts take, and are then aborted."""
    modules, dora = module_set(modules_key)
    cfg, dev = eng.model_config, eng.runner.device
    nbytes = eng.runner.pool.element_size()
    n_hot = round(hot * batch)
    n = batch - n_hot + 1 if n_hot else adapters or batch
    ranks = {f"dec-{i}": args.decode_rank for i in range(n)} if modules is not None else {}
    add_adapters(eng, ranks, modules, dora)
    # (more tokens than the prefill of one prompt token a step would leave them to decode)
    sp = SamplingParams(max_tokens=args.decode_tokens + batch * args.context, ignore_eos=True)
    # (the scheduler orders a step's decode rows by adapter size: the order here is moot)
    order = [0] * n_hot + list(range(1, n)) if n_hot else [i % n for i in range(batch)]
    names = [f"dec-{a}" for a in order] if ranks else [None] * batch
    ids = [eng.add_request(p, sp, adapter=name)
           for p, name in zip(prompts(batch, args.context, cfg.vocab_size, seed=batch), names)]
    log, timed = StepLog(eng), []
    try:
        while eng.has_unfinished() and len(timed) < args.decode_tokens:
            if not eng.config.async_scheduling:  # (async: each call waits for the last step)
                sync(dev)
            t0 = time.perf_counter()
            eng.step()
            ms = (time.perf_counter() - t0) * 1e3
            s = log.last
            if s and s["decode"] == batch and not s["prefill"] and not s["loads"]:
                timed.append({**s, "step_ms": ms})
    finally:
        log.close()
    for rid in ids:
        if rid in eng.requests and not eng.requests[rid].finished:
            eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    remove_adapters(eng, ranks)
    if not timed:
        raise RuntimeError(f"decode batch {batch}: no step decoded all {batch} requests at once "
                           "(raise --max-num-seqs or --num-pages)")
    kv_tokens = statistics.median(s["kv_tokens"] for s in timed)
    weights = weight_read_bytes(cfg, nbytes, eng.config.quantization, tokens=batch)
    kv = int(kv_tokens * cfg.num_layers * 2 * cfg.kv_size * nbytes)
    lora = len(ranks) * adapter_bytes(cfg, args.decode_rank, modules, nbytes, dora) if modules \
        else 0
    floor_ms = (weights + kv + lora) / (copy_GBps * 1e9) * 1e3
    step_ms = statistics.median(s["step_ms"] for s in timed)
    return {"batch": batch, "modules": modules_key, "rank": args.decode_rank if modules else 0,
            "adapters": len(ranks),
            "steps_timed": len(timed), "ctx_mean": kv_tokens / batch, "step_ms": step_ms,
            "execute_ms": (None if eng.config.async_scheduling
                           else statistics.median(s["execute_ms"] for s in timed)),
            "weight_bytes": weights, "kv_bytes": kv, "adapter_bytes": lora,
            "floor_ms": floor_ms, "ratio": step_ms / floor_ms,
            "tok_s": batch / step_ms * 1e3}


GAP_US = 50  # a GPU idle gap this long or longer is the host between launches, not a graph's


def _gaps(prof, steps: int) -> dict[str, float]:
    """The GPU's idle time per step between its activities (kernels, copies), in two parts:
    gaps under GAP_US (between the nodes of a graph, or kernels launched back to back) and
    longer ones (the GPU waiting for the host: between steps, or an eager launch sequence)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    short = long = 0.0
    end = None
    for a, b in spans:
        if end is not None and a > end:
            gap = a - end
            if gap < GAP_US:
                short += gap
            else:
                long += gap
        end = b if end is None else max(end, b)
    return {"short_gaps_ms_per_step": short / 1e3 / steps, "long_gaps_ms_per_step": long / 1e3 / steps}


def _profiled(eng: Engine, step, steps: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(wall ms per step, {kernel: GPU ms per step}, `_gaps`) of `steps` calls of `step` under
    torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.runner.device.type == "cuda"
    sync(eng.runner.device)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        sync(eng.runner.device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels = {}
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0 and e.device_type.name == "CUDA":
            kernels[e.key] = kernels.get(e.key, 0.0) + dev_us / 1e3 / steps
    return wall_ms, kernels, _gaps(prof, steps)


def _host_profile(step, steps: int, top: int = 20) -> list[dict]:
    """Where the host's time goes in `steps` calls of `step`: cProfile's top functions by
    own time (ms per step), Python and Triton's launch path included."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(i)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"func": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_ms_per_step": tt * 1e3 / steps, "cum_ms_per_step": ct * 1e3 / steps}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def kernel_breakdown(eng: Engine, args, batch: int, modules_key: str, steps: int = 8) -> dict:
    """Where a step's time goes, under torch.profiler: `steps` steady decode steps (every
    request decoding: the CUDA-graph path), then `steps` mixed steps (the same batch plus
    `--mixed-prompts` new prompts of `--mixed-prompt-len` tokens each, one 128-token prompt by
    default: a graph replay up to mixed_graph_tokens, eager past it). GPU busy time per
    step against its wall time shows the idle share, split into short gaps (between a graph's
    kernels) and long ones (the GPU waiting while the CPU schedules, builds the batch, launches
    eager kernels and samples); the kernel table shows the GPU's. With LoRA the requests take
    `--breakdown-adapters` adapters in turn (0: one each), and so do the mixed prompts."""
    modules, dora = module_set(modules_key)
    cfg = eng.model_config
    n_adapters = min(args.breakdown_adapters or batch, batch)
    ranks = ({f"kb-{i}": args.decode_rank for i in range(n_adapters)}
             if modules is not None else {})
    add_adapters(eng, ranks, modules, dora)
    sp = SamplingParams(max_tokens=args.decode_tokens + 3 * steps, ignore_eos=True)
    names = [f"kb-{i % n_adapters}" for i in range(batch)] if ranks else [None] * batch
    for p, name in zip(prompts(batch, args.context, cfg.vocab_size, seed=batch), names):
        eng.add_request(p, sp, adapter=name)
    while eng.scheduler.waiting or any(r.num_new > 1 for r in eng.scheduler.running):
        eng.step()
    for _ in range(2):  # steady state (graph captured, adapters resident)
        eng.step()
    k = args.mixed_prompts
    extra = prompts((2 * steps + 1) * k, args.mixed_prompt_len, cfg.vocab_size, seed=7)

    def mixed(i):  # k prompts join, each with the next adapter in turn
        for j in range(i * k, (i + 1) * k):
            eng.add_request(extra[j], SamplingParams(max_tokens=1, ignore_eos=True),
                            adapter=names[j % len(names)])
        eng.step()

    mixed(2 * steps)  # off the clock: a mixed-step graph bucket is captured on first use

    res = {"batch": batch, "modules": modules_key, "adapters": len(ranks)}
    for kind, fn in (("decode", lambda i: eng.step()), ("mixed", mixed)):
        wall_ms, kernels, gaps = _profiled(eng, fn, steps)
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
        res[kind] = {"wall_ms_per_step": wall_ms, "gpu_busy_ms_per_step": sum(kernels.values()),
                     **gaps, "kernels": [{"name": k[:90], "ms_per_step": v} for k, v in top]}
    res["decode"]["host"] = _host_profile(lambda i: eng.step(), steps)
    res["mixed"]["host"] = _host_profile(lambda i: mixed(steps + i), steps)
    while eng.has_unfinished():
        eng.step()
    remove_adapters(eng, ranks)
    return res


def print_breakdown(b: dict) -> None:
    for kind in ("decode", "mixed"):
        k = b[kind]
        busy, wall = k["gpu_busy_ms_per_step"], k["wall_ms_per_step"]
        print(f"\nkernel breakdown, {kind} steps, batch {b['batch']}, modules {b['modules']}"
              f"{', %d adapters' % b['adapters'] if b.get('adapters') else ''}: "
              f"{wall:.2f} ms/step wall (profiled), GPU busy {busy:.2f} ms ({busy / wall:.0%}); "
              f"GPU idle in gaps < {GAP_US} us {k['short_gaps_ms_per_step']:.2f} ms, "
              f"longer {k['long_gaps_ms_per_step']:.2f} ms")
        for row in k["kernels"]:
            print(f"  {row['ms_per_step']:8.3f} ms  {row['name']}")
    for kind in ("decode", "mixed"):
        print(f"\nhost, {kind} steps (cProfile, own ms/step, cumulative ms/step, calls/step):")
        for row in b[kind]["host"]:
            print(f"  {row['own_ms_per_step']:8.3f} {row['cum_ms_per_step']:8.3f} "
                  f"{row['calls_per_step']:7.0f}  {row['func']}")


def part_decode(eng: Engine, args, copy_GBps: float) -> list[dict]:
    t0 = time.perf_counter()
    rows = []
    for b in args.batches:
        for key in list(args.decode_modules) + ([k + DORA for k in ("qkvo", "all")]
                                                 if args.dora else []):
            rows.append(decode_row(eng, args, b, key, copy_GBps))
            r = rows[-1]
            print(f"decode: batch {b}, modules {key}: {r['step_ms']:.2f} ms/step, floor "
                  f"{r['floor_ms']:.2f} ms ({time.perf_counter() - t0:.0f} s into the part)",
                  flush=True)
    weights = "FP8 base weights" if args.quantization == "fp8" else f"{args.dtype} weights"
    print(f"\ndecode step vs byte floor, {weights}, context ~{args.context}, rank "
          f"{args.decode_rank}, one adapter per request; copy {copy_GBps:.0f} GB/s")
    print(f"{'batch':>6}{'modules':>10}{'ms/step':>9}{'exec ms':>9}{'floor ms':>9}{'ratio':>7}"
          f"{'weights GB':>11}{'KV GB':>7}{'LoRA GB':>8}{'tok/s':>8}")
    for r in rows:
        exec_ms = "-" if r["execute_ms"] is None else f"{r['execute_ms']:.2f}"
        print(f"{r['batch']:>6}{r['modules']:>10}{r['step_ms']:>9.2f}{exec_ms:>9}"
              f"{r['floor_ms']:>9.2f}{r['ratio']:>7.2f}{r['weight_bytes'] / 1e9:>11.2f}"
              f"{r['kv_bytes'] / 1e9:>7.2f}{r['adapter_bytes'] / 1e9:>8.2f}{r['tok_s']:>8.0f}")
    return rows


# ----------------------------------------------------------------------------- long

def part_long(eng: Engine, args) -> dict:
    """One prompt of --long-prompt tokens through chunked prefill, then --long-output tokens."""
    n, vocab, dev = args.long_prompt, eng.model_config.vocab_size, eng.runner.device
    if n + args.long_output > eng.max_model_len:
        raise SystemExit(f"--long-prompt {n} + --long-output {args.long_output} exceed the "
                         f"engine's max_model_len {eng.max_model_len} (the model's or the pool's)")
    sp = SamplingParams(max_tokens=args.long_output, ignore_eos=True)
    chunk = eng.config.max_prefill_chunk or eng.config.max_batch_tokens
    t = time.perf_counter()
    eng.generate(prompts(1, min(n, 2 * chunk + 7), vocab, seed=1), sp)  # compiles, off the clock
    warm = time.perf_counter() - t
    sync(dev)
    t0 = time.perf_counter()
    steps = 0
    rid = eng.add_request(prompts(1, n, vocab, seed=2)[0], sp)
    first = out = None
    with eng.scheduler.count_token_gaps() as gaps:
        while eng.has_unfinished():
            steps += 1
            for o in eng.step():
                if o.request_id == rid:
                    out = o
                    if first is None and o.token_ids:
                        first = time.perf_counter() - t0
    sync(dev)
    wall = time.perf_counter() - t0
    row = {"prompt_tokens": n, "output_tokens": len(out.token_ids), "finish": out.finish_reason,
           "max_prefill_chunk": eng.config.max_prefill_chunk, "steps": steps,
           "ttft_s": first, "wall_s": wall, "warmup_s": warm,
           "prefill_tok_s": n / first if first else None,
           "decode_ms_per_token": (wall - first) * 1e3 / max(1, len(out.token_ids) - 1),
           **itl_ms(gaps)}
    print(f"\nlong prompt: {n} tokens, chunk {row['max_prefill_chunk']}, {row['steps']} steps: "
          f"first token {first:.2f} s ({row['prefill_tok_s']:.0f} prompt tok/s), "
          f"{row['output_tokens']} tokens ({row['finish']}) in {wall:.2f} s, decode "
          f"{row['decode_ms_per_token']:.1f} ms/token; max_model_len {eng.max_model_len}")
    return row


def part_shared(eng: Engine, args, copy_GBps: float) -> list[dict]:
    """The shared-adapter decode table: per batch, the no-LoRA row, then q/k/v/o rows on
    each --shared-adapters count under each --decode-lora path."""
    t0 = time.perf_counter()
    rows = []
    for b in args.shared_batches:
        none = decode_row(eng, args, b, "none", copy_GBps)
        rows.append({**none, "decode_lora": None, "vs_none": 1.0, "hot": 0.0})
        for mode in args.decode_lora:
            decode_lora(eng, mode)
            for n, hot in [(n, 0.0) for n in args.shared_adapters] + \
                    [(0, h) for h in args.shared_hot]:
                r = decode_row(eng, args, b, "qkvo", copy_GBps, adapters=n, hot=hot)
                rows.append({**r, "decode_lora": mode, "vs_none": r["step_ms"] / none["step_ms"],
                             "hot": hot})
                print(f"shared: batch {b}, {r['adapters']} adapters{_hot(hot)}, {mode}: "
                      f"{r['step_ms']:.2f} ms/step, no LoRA {none['step_ms']:.2f} "
                      f"({time.perf_counter() - t0:.0f} s into the part)", flush=True)
    decode_lora(eng, eng.config.decode_lora)
    print(f"\ndecode step with shared adapters, q/k/v/o rank {args.decode_rank}, context "
          f"~{args.context}; vs none: its time over the no-LoRA step's (same batch, same run)")
    print(f"{'batch':>6}{'adapters':>9}{'hot':>5}{'path':>9}{'ms/step':>9}{'vs none':>8}"
          f"{'floor ms':>9}{'ratio':>7}{'LoRA GB':>8}{'tok/s':>8}")
    for r in rows:
        hot = f"{r['hot']:.2f}" if r.get("hot") else "-"
        print(f"{r['batch']:>6}{r['adapters']:>9}{hot:>5}{r['decode_lora'] or '-':>9}"
              f"{r['step_ms']:>9.2f}"
              f"{r['vs_none']:>8.3f}{r['floor_ms']:>9.2f}{r['ratio']:>7.2f}"
              f"{r['adapter_bytes'] / 1e9:>8.3f}{r['tok_s']:>8.0f}")
    return rows


def _hot(hot: float) -> str:
    return f" ({hot:.0%} of the rows on one)" if hot else ""


# ----------------------------------------------------------------------------- main

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", type=lambda t: t.split(","), default=["all"],
                    help="of scaling,decode,shared,long (all: scaling and decode)")
    ap.add_argument("--model", default=str(MODELS / "llama-2-7b"),
                    help="a model dir (config.json is enough)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", choices=("fp8",),
                    help="EngineConfig.quantization: fp8 = the base model's linear layers in FP8 "
                         "E4M3 (default: --dtype)")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="default: gpu_memory_fraction of free memory")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--mixed-graph-tokens", type=int,
                    help="EngineConfig.mixed_graph_tokens: steps with prompts of at most this "
                         "many tokens replay CUDA graphs (default: the engine's, 2048; 0: eager)")
    ap.add_argument("--adapters", type=ints, default=[1, 100, 1000, 2000],
                    help="scaling: adapter counts")
    ap.add_argument("--modules", type=lambda t: t.split(","), default=["qkvo", "all"],
                    help="scaling: target module sets, of qkvo,all (each beside the no-LoRA row)")
    ap.add_argument("--ranks", type=ints, default=[64, 32, 16, 8],
                    help="scaling: ranks, round-robin over adapters")
    ap.add_argument("--alpha", type=floats, default=[1.0],
                    help="scaling: popularity, a list (1 = uniform; smaller: more skewed)")
    ap.add_argument("--num-requests", type=int, default=600, help="scaling: requests per row")
    ap.add_argument("--repeats", type=int, default=1,
                    help="scaling: runs of each row, interleaved; a row is its median run")
    ap.add_argument("--input-len", type=ints, default=[8, 511], help="scaling: lo,hi (inclusive)")
    ap.add_argument("--output-len", type=ints, default=[8, 511], help="scaling: lo,hi (inclusive)")
    ap.add_argument("--seed", type=int, default=42, help="scaling: the trace's seed")
    ap.add_argument("--max-prefill-chunk", type=ints, default=None,
                    help="EngineConfig.max_prefill_chunk: scaling runs its rows at each value "
                         "(0: prompts whole, unchunked); the other parts run at the first "
                         "(default: the engine's)")
    ap.add_argument("--long-prompt", type=int, default=100_000, help="long: prompt tokens")
    ap.add_argument("--long-output", type=int, default=16, help="long: new tokens")
    ap.add_argument("--batches", type=ints, default=[1, 32, 128, 256], help="decode: batch sizes")
    ap.add_argument("--context", type=int, default=256, help="decode: prompt tokens")
    ap.add_argument("--decode-tokens", type=int, default=32,
                    help="decode: steps timed per row (all requests decoding)")
    ap.add_argument("--decode-rank", type=int, default=16)
    ap.add_argument("--decode-modules", type=lambda s: s.split(","), default=["none", "qkvo", "all"],
                    help="decode: module sets, of none,qkvo,all,vocab (vocab: q/k/v/o with "
                         "embed_tokens and lm_head)")
    ap.add_argument("--shared-batches", type=ints, default=[32, 128],
                    help="shared: batch sizes")
    ap.add_argument("--shared-adapters", type=ints, default=[1, 4, 0],
                    help="shared: adapters the batch's requests share (0: one each)")
    ap.add_argument("--shared-hot", type=floats, default=[],
                    help="shared: also rows with this share of the batch on one adapter and "
                         "every other row on its own (skewed popularity), e.g. 0.5")
    ap.add_argument("--decode-lora", type=lambda t: t.split(","), default=["auto"],
                    help="the LoRA rows' decode path, a list of auto,mbgmv,segments,hybrid "
                         "(EngineConfig.decode_lora): each LoRA row runs under each")
    ap.add_argument("--breakdown", type=ints, default=[32],
                    help="decode: batch sizes to profile kernel by kernel (empty: none)")
    ap.add_argument("--breakdown-modules", type=lambda s: s.split(","), default=["none", "qkvo"],
                    help="breakdown: module sets to profile, of none,qkvo,all,vocab,qkvo-dora,"
                         "all-dora")
    ap.add_argument("--breakdown-adapters", type=int, default=0,
                    help="breakdown: adapters the batch's requests (and the mixed prompts) take "
                         "in turn (0: one each; 1: every row on one adapter)")
    ap.add_argument("--dora", action="store_true",
                    help="decode: rows of DoRA adapters too (qkvo-dora, all-dora), beside the "
                         "plain LoRA rows of the same rank and modules")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                    help="EngineConfig.async_scheduling: launch each step before collecting the "
                         "last (default: the engine's, on with CUDA)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.enable_prefix_caching (default on, the engine's default)")
    ap.add_argument("--mixed-prompts", type=int, default=1,
                    help="breakdown: prompts joining each mixed step, each with its own adapter")
    ap.add_argument("--mixed-prompt-len", type=int, default=128,
                    help="breakdown: tokens of each of them (S2's eager steps: --mixed-prompts "
                         "31 --mixed-prompt-len 256, ~8k tokens)")
    ap.add_argument("--graph-pieces", type=int, default=None,
                    help="capture each step's CUDA graph in this many pieces (default: "
                         "slora.graphs.GRAPH_PIECES; 1 = one graph a step, to compare)")
    ap.add_argument("--step-logs", action="store_true",
                    help="scaling: write each row's step log (every step's plan features and "
                         "time) to OUT/steps-chunkC-ADAPTERS-MODULES.jsonl (-runN.jsonl for "
                         "each of --repeats)")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="scaling: profile each row's first N steps (torch.profiler), print "
                         "the ops with the most host and device time and write the timeline "
                         "(OUT/timeline-chunkC-ADAPTERS-MODULES.json.gz) and every step's features "
                         "(OUT/steps-...json); its overhead lands in the row's figures")
    ap.add_argument("--trace-skip", type=int, default=0,
                    help="scaling: with --trace-steps, start tracing after this many steps")
    ap.add_argument("--trace-device-only", action="store_true",
                    help="scaling: with --trace-steps, record the GPU's kernels and copies only "
                         "(no host ops: their recording stretches the host's time)")
    ap.add_argument("--gemm-rows", type=int, default=None,
                    help="EngineConfig.gemm_max_rows: base GEMMs of at most this many rows "
                         "through the Triton kernel (default: the engine's; 0 = cuBLAS always, "
                         "to compare)")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="programmatic dependent launch of the decode kernels on Hopper "
                         "(slora.kernels.pdl; on by default)")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected 1 or more")
    if args.gemm_rows is not None and args.gemm_rows < 0:
        ap.error(f"--gemm-rows {args.gemm_rows}: expected 0 or more")
    if args.breakdown_adapters < 0:
        ap.error(f"--breakdown-adapters {args.breakdown_adapters}: expected 0 or more")
    if args.graph_pieces is not None and args.graph_pieces < 1:
        ap.error(f"--graph-pieces {args.graph_pieces}: expected 1 or more")
    for opt, extra in (("breakdown_modules", ["qkvo" + DORA, "all" + DORA]),
                       ("decode_modules", [])):
        if set(getattr(args, opt)) - set(MODULE_SETS) - set(extra):
            ap.error(f"--{opt.replace('_', '-')} {','.join(getattr(args, opt))}: choose from "
                     f"{','.join(list(MODULE_SETS) + extra)}")
    if "all" in args.part:
        args.part = sorted(set(args.part) - {"all"} | {"scaling", "decode"})
    if set(args.part) - {"scaling", "decode", "shared", "long"}:
        ap.error(f"--part {','.join(args.part)}: choose from scaling,decode,shared,long,all")
    if set(args.decode_lora) - set(DECODE_LORA):
        ap.error(f"--decode-lora {','.join(args.decode_lora)}: choose from "
                 f"{','.join(DECODE_LORA)}")
    if "shared" in args.part and max(args.shared_batches) > args.max_num_seqs:
        ap.error(f"--shared-batches {max(args.shared_batches)} exceeds --max-num-seqs "
                 f"{args.max_num_seqs}")
    if set(args.modules) - {"qkvo", "all"}:
        ap.error(f"--modules {','.join(args.modules)}: choose from qkvo,all")
    if "decode" in args.part and max(args.batches) > args.max_num_seqs:
        ap.error(f"--batches {max(args.batches)} exceeds --max-num-seqs {args.max_num_seqs}")
    return args


def engine_config(args) -> EngineConfig:
    """The engine `args` describe: random weights of --model's shapes."""
    return EngineConfig(model=args.model, load_format="dummy", device=args.device,
                        dtype=args.dtype, quantization=args.quantization,
                        num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                        max_batch_tokens=args.max_batch_tokens,
                        async_scheduling=args.async_scheduling,
                        enable_prefix_caching=args.prefix_caching,
                        **({} if not args.max_prefill_chunk
                           else {"max_prefill_chunk": args.max_prefill_chunk[0]}),
                        **({} if args.gemm_rows is None else {"gemm_max_rows": args.gemm_rows}),
                        **({} if args.mixed_graph_tokens is None
                           else {"mixed_graph_tokens": args.mixed_graph_tokens}))


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    if args.graph_pieces is not None:
        slora.graphs.GRAPH_PIECES = args.graph_pieces  # read when the engine is made
    slora.kernels.pdl.ENABLED = args.pdl  # read at each launch and capture
    ceil = ceilings(device) if {"decode", "shared"} & set(args.part) else {}
    if ceil:
        print("ceilings:", ceil, flush=True)
    eng = Engine(engine_config(args))
    print(f"engine: {args.quantization or args.dtype} weights, {eng.runner.num_pages} pages of "
          f"{eng.runner.page_bytes / 1e6:.1f} MB "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    result = {**header(__file__, device, ceil, argv),
              "model": args.model, "device": args.device, "dtype": args.dtype,
              "quantization": args.quantization, "pages": eng.runner.num_pages, "page_bytes": eng.runner.page_bytes,
              "args": vars(args)}
    if "scaling" in args.part:
        result["scaling"] = part_scaling(eng, args)
    if "long" in args.part:
        result["long"] = part_long(eng, args)
    if "shared" in args.part:
        result["shared"] = part_shared(eng, args, ceil["copy_GBps"])
    if "decode" in args.part:
        result["decode"] = part_decode(eng, args, ceil["copy_GBps"])
        result["breakdown"] = []
        for b in args.breakdown:
            for key in args.breakdown_modules:
                result["breakdown"].append(kernel_breakdown(eng, args, b, key))
                print_breakdown(result["breakdown"][-1])
    eng.close()  # (so that main can run again in one process)
    result["wall_s"] = time.perf_counter() - t0
    path = write_result(args.out, "bench_scaling.json", result)
    print(f"\nwrote {path} ({result['wall_s']:.0f} s in all)")
    return result


if __name__ == "__main__":
    main()
