"""Adapter churn on the GPU: many registered adapters, a pool far smaller than their
total size, a stream of requests. Shows loads, evictions and prefetch, and what an adapter
load costs a step with and without prefetch.

A Llama-2-7B-shaped model with random bf16 weights; synthetic rank-16 q/k/v/o adapters
(every load is a real host -> device copy of the full adapter, ~33 MB). Requests arrive in
waves, each on a random adapter; every step is timed (`runner.execute`, synchronised) and
tagged with the adapter copies it carried: blocking loads (adapter needed now) or prefetches
(copied on a side stream while the step computes).

Writes bench_prefetch.json under --out: the harness's header (GPU, commit, command; no
ceilings: the figures are step times against each other) and "rows", one per prefetch window
(0, then --prefetch-window).

    python experiments/bench_prefetch.py --adapters 1000 --num-pages 1200
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import add_out_arg, header, write_result  # noqa: E402
from slora import Engine, EngineConfig, SamplingParams  # noqa: E402

MODEL = Path(__file__).resolve().parent / "models" / "llama-2-7b"


def run(args, prefetch_window: int) -> dict:
    # Steps one at a time (`runner.execute`, timed alone): async scheduling would launch the
    # next step before collecting this one, and never call execute.
    eng = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device,
                              num_pages=args.num_pages, max_num_seqs=args.batch,
                              prefetch_window=prefetch_window,
                              prefetch_reserve=args.prefetch_reserve, async_scheduling=False))
    for i in range(args.adapters):
        eng.add_synthetic_adapter(f"a{i}", args.rank)
    print(f"warm-up (compiles, graph captures): {eng.warmup():.1f} s", flush=True)
    steps = []
    execute = eng.runner.execute
    graph_runs = [0]  # decode steps that replayed a captured graph (the rest ran eagerly)
    if eng.runner.graphs is not None:
        feed_graph = eng.runner.graphs.feed

        def counted(*args):
            graph_runs[0] += 1
            return feed_graph(*args)

        eng.runner.graphs.feed = counted

    cuda = args.device != "cpu"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # On the GPU, events on both streams show whether a step's prefetch copies ran beside its
    # compute: the share of the copies' span that lies inside the compute stream's span.
    copies = []  # (start, end) events of this step's prefetch copies on the side stream
    if cuda:
        prefetch = eng.runner.host_tier.prefetch

        def marked(loads, adapters, after=None):
            if not loads:
                return prefetch(loads, adapters, after)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(eng.runner.host_tier.copy_stream)
            prefetch(loads, adapters, after)
            end.record(eng.runner.host_tier.copy_stream)
            copies.append((start, end))

        eng.runner.host_tier.prefetch = marked

    def timed(plan, adapters):
        sync()
        before = graph_runs[0]
        copies.clear()
        if cuda:
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0.record()
        t0 = time.perf_counter()
        out = execute(plan, adapters)
        if cuda:
            c1.record()
        sync()
        step = {"ms": (time.perf_counter() - t0) * 1e3, "loads": len(plan.adapter_loads),
                "graph": graph_runs[0] > before,
                "prefetch": len(plan.prefetch), "decode": len(plan.decode),
                "prefill": len(plan.prefill)}
        if copies:  # times relative to the compute stream's start, in ms
            (s, e), compute = copies[0], c0.elapsed_time(c1)
            lo, hi = c0.elapsed_time(s), c0.elapsed_time(e)
            step.update(compute_ms=compute, copy_ms=hi - lo,
                        copy_hidden=max(0.0, min(hi, compute) - max(lo, 0.0)) / max(hi - lo, 1e-9))
        steps.append(step)
        return out

    eng.runner.execute = timed
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    t0 = time.perf_counter()
    for _ in range(args.waves):
        for _ in range(args.wave_size):
            eng.add_request([rng.randrange(3, vocab) for _ in range(args.prompt_len)], sp,
                            adapter=f"a{rng.randrange(args.adapters)}")
        for _ in range(args.steps_per_wave):
            eng.step()
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    # Loads happen in the step that admits (prefills) their request: compare like with like.
    prefill_steps = [s for s in steps if s["prefill"]]
    decode_only = [s for s in steps if s["prefill"] == 0]

    def med(rows):
        return statistics.median(r["ms"] for r in rows) if rows else None

    res = {
        "prefetch_window": prefetch_window, "wall_s": wall, "steps": len(steps),
        "stats": eng.stats(),
        "adapter_bytes": eng.adapters.get("a0").nbytes,
        "decode_step_ms_no_copy": med([s for s in decode_only if not s["prefetch"]]),
        "decode_step_ms_with_prefetch": med([s for s in decode_only if s["prefetch"]]),
        "prefill_step_ms_no_copy": med([s for s in prefill_steps if not s["loads"] and not s["prefetch"]]),
        "prefill_step_ms_with_blocking_load": med([s for s in prefill_steps if s["loads"]]),
        "prefill_step_ms_with_prefetch_only": med([s for s in prefill_steps if s["prefetch"] and not s["loads"]]),
        "decode_steps_in_graphs": sum(s["graph"] for s in decode_only),
        "decode_steps": len(decode_only),
        "blocking_loads": sum(s["loads"] for s in steps),
        "prefetches": sum(s["prefetch"] for s in steps),
        # what one more adapter copy adds to a step, by how it is copied (least squares over
        # steps of one kind: decode-only steps against their prefetches, prefill steps against
        # their blocking loads with the prefill size as a second regressor)
        "ms_per_prefetch_on_decode": _slope(decode_only, ["prefetch"]),
        # GPU only: the share of the prefetch copies' time spent beside the step's compute
        "copy_hidden_median": (statistics.median(s["copy_hidden"] for s in steps if "copy_hidden" in s)
                               if any("copy_hidden" in s for s in steps) else None),
        "ms_per_blocking_load_on_prefill": _slope(prefill_steps, ["loads", "prefill"]),
        "steps_detail": steps,
    }
    eng.close()
    return res


def _slope(rows: list[dict], keys: list[str]) -> float | None:
    """The coefficient of keys[0] in ms ~ c + sum(b_k * row[k]), or None when it cannot be
    told apart (fewer rows than unknowns, or keys[0] never varies)."""
    import numpy as np

    if len(rows) <= len(keys) + 1 or len({r[keys[0]] for r in rows}) < 2:
        return None
    X = np.array([[1.0] + [float(r[k]) for k in keys] for r in rows])
    y = np.array([r["ms"] for r in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return float(coef[1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MODEL), help="a model dir (config.json is enough)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=400,
                    help="~3.4 GB of 7B pages: under the ~180 adapters a run touches (4 pages "
                         "each), so adapters get evicted (1200 pages held them all: no eviction)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefetch-reserve", type=int, default=64)
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--wave-size", type=int, default=16)
    ap.add_argument("--steps-per-wave", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--prefetch-window", type=int, default=8, help="the second run's window")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    rows = [run(args, 0), run(args, args.prefetch_window)]
    result = {**header(__file__, args.device, {}, argv), "rows": rows}
    write_result(args.out, "bench_prefetch.json", result)
    mb = rows[0]["adapter_bytes"] / 1e6
    print(f"\n{args.adapters} adapters x {mb:.1f} MB (rank {args.rank} q/k/v/o), pool "
          f"{args.num_pages} pages; step medians in ms, by what the step copied")
    cols = ["decode_step_ms_no_copy", "decode_step_ms_with_prefetch", "prefill_step_ms_no_copy",
            "prefill_step_ms_with_blocking_load", "prefill_step_ms_with_prefetch_only"]
    print(f"{'prefetch':>9}{'loads':>7}{'prefetched':>11}{'evictions':>10}  "
          + "  ".join(c.replace("_step_ms", "") for c in cols) + "   wall s")
    for r in rows:
        vals = "  ".join(f"{r[c]:.2f}".rjust(len(c) - 8) if r[c] is not None else "-".rjust(len(c) - 8)
                         for c in cols)
        print(f"{r['prefetch_window']:>9}{r['blocking_loads']:>7}{r['prefetches']:>11}"
              f"{r['stats']['adapter_evictions']:>10}  {vals}   {r['wall_s']:.1f}")
    for r in rows:
        print(f"prefetch window {r['prefetch_window']}: {r['decode_steps_in_graphs']} of "
              f"{r['decode_steps']} decode-only steps replayed a CUDA graph")

    def ms(x):
        return "-" if x is None else f"{x:.2f} ms"

    for r in rows:
        if r["copy_hidden_median"] is not None:
            print(f"prefetch window {r['prefetch_window']}: median share of a step's prefetch "
                  f"copies that ran beside its compute (CUDA events): {r['copy_hidden_median']:.0%}")
    for r in rows:
        print(f"prefetch window {r['prefetch_window']}: one more adapter copy adds "
              f"{ms(r['ms_per_blocking_load_on_prefill'])} to a prefill step (blocking) and "
              f"{ms(r['ms_per_prefetch_on_decode'])} to a decode step (prefetch)")
    return result


if __name__ == "__main__":
    main()
