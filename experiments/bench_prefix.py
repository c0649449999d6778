"""Prefix caching on a shared-system-prompt trace: first-token latency with and without it, in
one call, and the simulator against both replays.

The trace (`slora trace synth ... --shared-prefix`): --requests requests over --adapters
synthetic adapters (uniform popularity, Poisson arrivals at --rate), each prompt its adapter's
system prompt of --prefix tokens followed by its own [LO, HI] tokens. The real engine replays
it twice (random weights of --model's config.json, synthetic rank --rank adapters), prefix
caching off then on; with --profile the simulator runs the same trace and engine settings on
the replays' pool. Prints a table (mean / p90 first-token latency, throughput, hit rate, the
ratio of mean TTFTs, the simulator's errors) and writes bench_prefix.json under --out (the
harness header, the trace's parameters, one row per setting).

    python experiments/bench_prefix.py --profile experiments/profiles/h200-llama2-7b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import add_out_arg, header, write_result  # noqa: E402
from slora.config import ModelConfig  # noqa: E402
from slora.workload import synthesize, with_shared_prefix, write_trace  # noqa: E402

MODEL = Path(__file__).resolve().parent / "models" / "llama-2-7b"


def make_trace(args):
    base = synthesize(num_adapters=args.adapters, rate=args.rate, cv=1.0, alpha=1.0,
                      duration=args.requests / args.rate, input_len=tuple(args.input_len),
                      output_len=tuple(args.output_len), ranks=(args.rank,), seed=args.seed)
    vocab = ModelConfig.from_dir(args.model).vocab_size
    return with_shared_prefix(base, args.prefix, vocab, args.seed)


def row(name: str, result: dict) -> dict:
    stats = result["stats"]
    return {"setting": name, "source": result["source"], "ttft_mean_s": result["avg_ttft_s"],
            "ttft_p90_s": result["ttft_p90_s"], "throughput_req_s": result["throughput_req_s"],
            "avg_latency_s": result["avg_latency_s"], "completed": result["num_completed"],
            "prefix_hit_rate": stats.get("prefix_hit_rate"),
            "prefix_hit_tokens": stats.get("prefix_hit_tokens"),
            "pages_total": stats.get("pages_total")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL), help="model directory (config.json)")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--prefix", type=int, default=2000, help="system prompt tokens per adapter")
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("LO", "HI"),
                    help="each request's own prompt tokens after the system prompt")
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("LO", "HI"))
    ap.add_argument("--rate", type=float, default=16.0,
                    help="requests per second (Poisson; default 16: past the uncached engine's "
                    "prefill capacity on an H200 with the 7B shape, about 11 req/s)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--engine", default="{}", help="EngineConfig fields as JSON")
    ap.add_argument("--profile", help="profile JSON: also simulate both settings")
    ap.add_argument("--no-replay", action="store_true",
                    help="simulate only (needs --profile and --num-pages; no GPU)")
    ap.add_argument("--num-pages", type=int, help="the pool, for --no-replay")
    add_out_arg(ap)
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args)
    trace_path = out / "prefix-trace.jsonl"
    write_trace(trace, trace_path)
    base_options = {"load_format": "dummy", **json.loads(args.engine)}
    rows, pages = [], args.num_pages
    for on in (False, True):
        options = dict(base_options, enable_prefix_caching=on)
        name = f"prefix caching {'on' if on else 'off'}"
        if not args.no_replay:
            from slora.replay import run_replay

            real = run_replay(trace, model=args.model, engine_options=options,
                              synthetic_adapters=True, trace_path=str(trace_path))
            (out / f"prefix-{'on' if on else 'off'}-replay.json").write_text(
                json.dumps(real, indent=2, default=str) + "\n")
            rows.append(row(name, real))
            pages = real["stats"]["pages_total"]
        if args.profile:
            from slora.sim import Profile, simulate

            sim = simulate(trace, Profile.load(args.profile), num_pages=pages,
                           engine_options=options, model=ModelConfig.from_dir(args.model),
                           trace_path=str(trace_path)).result
            rows.append(row(name, sim))
    table = format_table(rows)
    print(table)
    device = "cpu" if args.no_replay else base_options.get("device", "cuda")
    result = {**header(__file__, device, {}, argv), "workload": trace.params, "rows": rows,
              "table": table}
    write_result(out, "bench_prefix.json", result)
    return result


def format_table(rows: list[dict]) -> str:
    lines = [f"{'setting':<20}{'source':>10}{'ttft mean ms':>14}{'ttft p90 ms':>13}"
             f"{'req/s':>8}{'hit rate':>10}"]
    for r in rows:
        ms = lambda v: "n/a" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
        lines.append(f"{r['setting']:<20}{r['source']:>10}{ms(r['ttft_mean_s']):>14}"
                     f"{ms(r['ttft_p90_s']):>13}{r['throughput_req_s']:>8.2f}"
                     f"{(r['prefix_hit_rate'] or 0):>10.2f}")
    for source in ("replay", "simulate"):
        by = {r["setting"]: r for r in rows if r["source"] == source}
        off, on = by.get("prefix caching off"), by.get("prefix caching on")
        if off and on and on["ttft_mean_s"]:
            lines.append(f"{source}: mean TTFT off / on = "
                         f"{off['ttft_mean_s'] / on['ttft_mean_s']:.1f}x (target >= 5x)")
    for setting in ("prefix caching off", "prefix caching on"):
        pair = {r["source"]: r for r in rows if r["setting"] == setting}
        real, sim = pair.get("replay"), pair.get("simulate")
        if real and sim:
            err = [(sim[k] - real[k]) / real[k] for k in ("throughput_req_s", "ttft_mean_s")]
            lines.append(f"simulate vs replay, {setting}: throughput {err[0]:+.1%}, "
                         f"mean TTFT {err[1]:+.1%} (target within 5%)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
