"""Does the simulator agree with the real engine? Replay and simulate the same traces, compare.

    python experiments/sim_vs_replay.py --model experiments/models/llama-2-7b \\
        --profile experiments/profiles/h200-llama2-7b.json

For each trace (three by default: different rates, alphas and adapter counts), the real engine
replays it on the wall clock (random weights for a config.json-only model), then the simulator
runs it with the profile on a pool of exactly the replay's page count. Results go to
results/sim-vs-replay/<trace>-{replay,simulate}.json (a trace whose results exist is skipped,
so a run cut short resumes); the table of throughput, average latency, mean and p90 first-token
latency and inter-token latency p50 and p99, with the simulator's relative error, is printed at
the end and written as table.md. Each
replay also logs its steps (<trace>-steps.jsonl), and a table of measured step times beside the
cost model's, by step kind, shows where the two clocks part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slora.cli import format_summary
from slora.config import ModelConfig
from slora.sim import Profile, simulate
from slora.workload import read_trace, synthesize, write_trace

# name -> synthesize() arguments: S-LoRA S2 shapes (ranks 64/32/16/8, lengths [8, 511]).
TRACES = {
    "n100-a1-r4": dict(num_adapters=100, rate=4, cv=1, alpha=1),
    "n1000-a0.5-r8": dict(num_adapters=1000, rate=8, cv=1, alpha=0.5),
    "n2000-a1-r10": dict(num_adapters=2000, rate=10, cv=1, alpha=1),
}
METRICS = (("throughput_req_s", "req/s"), ("avg_latency_s", "avg latency s"),
           ("avg_ttft_s", "avg ttft s"), ("ttft_p90_s", "ttft p90 s"),
           ("itl_p50_s", "itl p50 s"), ("itl_p99_s", "itl p99 s"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (config.json; weights optional)")
    p.add_argument("--profile", required=True, help="profile JSON (slora profile) of this model and GPU")
    p.add_argument("--duration", type=float, default=60, help="seconds of traffic per trace (default 60)")
    p.add_argument("--lengths", type=int, nargs=2, default=(8, 511), metavar=("LO", "HI"),
                   help="prompt and output lengths, uniform in [LO, HI] (default 8 511, S-LoRA's)")
    p.add_argument("--engine", default="{}", help="EngineConfig fields as JSON, e.g. '{\"device\": \"cpu\"}'")
    p.add_argument("--only", nargs="*", choices=sorted(TRACES), help="run these traces only")
    p.add_argument("--results", default="results/sim-vs-replay")
    p.add_argument("--force", action="store_true", help="redo traces whose results exist")
    p.add_argument("--resimulate", action="store_true",
                   help="no replays: simulate again, with --profile, the traces whose replays are "
                        "stored under --results (e.g. after a refit; no GPU needed)")
    p.add_argument("--progress", action="store_true", help="progress bars during replays")
    args = p.parse_args(argv)

    from slora.replay import run_replay

    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    profile = Profile.load(args.profile)
    dummy = not any(Path(args.model).glob("*.safetensors"))
    for name in args.only or TRACES:
        trace_path = out / f"{name}.jsonl"
        replay_path, sim_path = out / f"{name}-replay.json", out / f"{name}-simulate.json"
        options = {"load_format": "dummy"} if dummy else {}
        options.update(json.loads(args.engine))
        if args.resimulate:
            if not (replay_path.exists() and trace_path.exists()):
                print(f"[{name}] no stored replay in {out}: skipped")
                continue
            trace, real = read_trace(trace_path), json.loads(replay_path.read_text())
        elif not args.force and replay_path.exists() and sim_path.exists():
            continue
        else:
            lengths = tuple(args.lengths)
            spec = dict(TRACES[name], duration=args.duration, input_len=lengths, output_len=lengths,
                        ranks=(64, 32, 16, 8), seed=42)
            write_trace(synthesize(**spec), trace_path)
            trace = read_trace(trace_path)
            print(f"[{name}] replay: {len(trace)} requests over {trace.duration:.0f} s", flush=True)
            real = run_replay(trace, model=args.model, synthetic_adapters=True,
                              trace_path=str(trace_path), engine_options=options,
                              progress=args.progress, step_log=out / f"{name}-steps.jsonl")
            replay_path.write_text(json.dumps(real, indent=2, default=str) + "\n")
            print(format_summary(real))
        pages = real["stats"]["pages_total"]
        sim = simulate(trace, profile, num_pages=pages, trace_path=str(trace_path),
                       engine_options=options, model=ModelConfig.from_dir(args.model)).result
        sim_path.write_text(json.dumps(sim, indent=2, default=str) + "\n")
        print(f"[{name}] simulate ({sim['stats']['sim_wall_s']:.1f} s)\n{format_summary(sim)}")
        if (out / f"{name}-steps.jsonl").exists():  # (a replay's results copied without it)
            print(step_residuals(out / f"{name}-steps.jsonl", profile))
    table = comparison_table(out, args.only or list(TRACES), profile)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


def comparison_table(out: Path, names: list[str], profile: Profile) -> str:
    head = ["trace"] + [f"{label} replay / sim (err)" for _, label in METRICS]
    rows = [head, ["---"] * len(head)]
    for name in names:
        try:
            real = json.loads((out / f"{name}-replay.json").read_text())
            sim = json.loads((out / f"{name}-simulate.json").read_text())
        except OSError:
            continue
        row = [name]
        for key, _ in METRICS:
            a, b = real.get(key), sim.get(key)
            err = "n/a" if not a or b is None else f"{(b - a) / a:+.1%}"
            row.append(f"{_num(a)} / {_num(b)} ({err})")
        rows.append(row)
    title = f"replay vs simulate, {profile.model} on {profile.gpu}"
    return title + "\n\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows)


def step_residuals(path: Path, profile: Profile) -> str:
    """The replay's steps (its step log) beside the cost model's forward time for each, by kind:
    where the simulator's clock runs fast or slow. Steps that copied adapters are shown apart
    (their measured time includes the copies). For those the model's step time adds its copy
    times (blocking, and prefetch as overlapped) when the log has the copies' bytes."""
    from slora.sim.cost import sample_row
    from slora.sim.profile import read_step_log

    kinds: dict[str, list[tuple[float, float]]] = {}
    stalls = []  # steps over 3x the model's time: (measured, predicted, gc, graphs, compiles)
    for s in read_step_log(path):
        f = s["features"]
        kind = ("mixed" if f["decode_seqs"] else "prefill") if f["prefill_tokens"] else "decode"
        kind += "+lora" if f["adapters"] else ""
        kind += ", copies" if s["copies"] else ""
        cost = profile.cost
        pred = cost.forward_time(sample_row(f, profile.mixed_graph_tokens))
        if s["load_bytes"] is not None:
            pred = cost.step_time(pred, sum(map(cost.copy_time, s["load_bytes"])),
                                  sum(map(cost.copy_time, s["prefetch_bytes"])), 0.0)
        kinds.setdefault(kind, []).append((s["seconds"], pred))
        if s["seconds"] > 3 * pred:
            stalls.append((s["seconds"], pred, s["gc_s"], s["graphs"], len(s["compiles"])))
    lines = [f"steps of {path.name}: measured vs the cost model's step time",
             f"{'kind':<24}{'steps':>7}{'measured ms':>13}{'model ms':>10}{'model/measured':>16}"]
    for kind, v in sorted(kinds.items()):
        meas, pred = sum(m for m, _ in v) / len(v), sum(p for _, p in v) / len(v)
        lines.append(f"{kind:<24}{len(v):>7}{meas * 1e3:>13.2f}{pred * 1e3:>10.2f}{pred / meas:>16.2f}")
    if stalls:
        lines.append(f"stalls (steps over 3x the model's time): {len(stalls)}, "
                     f"{sum(m - p for m, p, *_ in stalls) * 1e3:.0f} ms over the model; within "
                     f"them the garbage collector {sum(g for _, _, g, _, _ in stalls) * 1e3:.0f} "
                     f"ms, {sum(n for *_, n, _ in stalls)} graph captures, "
                     f"{sum(c for *_, c in stalls)} Triton compiles")
    return "\n".join(lines)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


if __name__ == "__main__":
    sys.exit(main())
