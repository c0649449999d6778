"""Run an experiment suite: every point of its sweep, one result JSON each, then its figure.

    python experiments/run_suite.py experiments/suites/table3-s1.json   # Llama-2-7B shape, random weights
    python experiments/run_suite.py experiments/suites/policies.json --set duration=60
    python experiments/run_suite.py experiments/suites/cpu-smoke.json --model DIR --dry-run

A suite file (JSON) holds S-LoRA's settings mapped to our model shapes:

    name, description   what it measures and where the settings come from
    model_shape         the model it was written for ("llama-2-7b", "llama-2-13b", or "any"):
                        without --model the suite runs on that shape with random weights; a
                        --model of another shape only draws a warning
    workload            base arguments of `slora.workload.synthesize` (num_adapters, rate, cv,
                        alpha, duration, input_len, output_len, ranks, seed, rank_assignment) and
                        `sharegpt: true` for ShareGPT lengths counted with the model's tokenizer
    engine              EngineConfig fields (policy, num_pages, device, ...)
    sweep               {key: [values]}: the grid is their product; a key may be a workload or an
                        engine field, so a policy sweep replays one trace under every policy
    plot                optional {"x": key, "series": [keys]} for the figure
    reference           optional published numbers, printed beside ours (e.g. S-LoRA's table)

Everything goes under `results/<suite>/` (git-ignored): `traces/<workload point>.jsonl`,
`<point>.json` per point, and `<suite>.png`. A point whose result exists is skipped unless
--force, so a suite cut short by a time limit resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from slora.config import EngineConfig
from slora.plot import load_results, lookup, plot_results
from slora.workload import Trace, read_trace, sharegpt_lengths, synthesize, tokenizer_counter, write_trace

WORKLOAD_KEYS = ("num_adapters", "rate", "cv", "alpha", "duration", "input_len", "output_len",
                 "ranks", "seed", "rank_assignment", "sharegpt")
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")
# The model shapes suites are written for: experiments/models/<shape>/config.json (S-LoRA's
# Llama-7B and -13B have the Llama-2 shapes). Without --model, a suite runs on that directory with
# the engine's load_format="dummy" random weights, as S-LoRA's benchmarks run with --dummy.
MODELS_DIR = Path(__file__).resolve().parent / "models"
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")
SUMMARY_COLUMNS = (("throughput_req_s", "req/s"), ("avg_latency_s", "latency s"),
                   ("ttft_p90_s", "ttft p90 s"), ("slo_attainment", "SLO"))


@dataclass
class Suite:
    name: str
    description: str
    model_shape: str
    workload: dict
    engine: dict
    sweep: dict[str, list]
    plot: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)


@dataclass
class Point:
    name: str  # e.g. "cv=2-policy=fcfs"
    trace_name: str  # the workload part only: points that differ in engine settings share it
    workload: dict
    engine: dict


def load_suite(path: str | Path) -> Suite:
    try:
        raw = json.loads(Path(path).read_text())
        suite = Suite(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"suite {path}: cannot load it ({e})") from None
    allowed = {"workload": WORKLOAD_KEYS, "engine": ENGINE_KEYS, "sweep": WORKLOAD_KEYS + ENGINE_KEYS}
    for where, keys in allowed.items():
        unknown = [k for k in getattr(suite, where) if k not in keys]
        if unknown:
            raise ValueError(f"suite {path}: unknown {where} key(s) {unknown}; workload keys: "
                             f"{', '.join(WORKLOAD_KEYS)}; engine keys: EngineConfig fields")
    for key, values in suite.sweep.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"suite {path}: sweep {key!r} must be a non-empty list of values")
    if suite.model_shape != "any" and not (MODELS_DIR / suite.model_shape / "config.json").is_file():
        raise ValueError(f"suite {path}: model_shape {suite.model_shape!r} is neither 'any' nor a "
                         f"shape with a config.json under {MODELS_DIR}")
    return suite


def apply_overrides(suite: Suite, sets: list[str]) -> Suite:
    """`key=value` overrides (value parsed as JSON, else a string); a swept key's value replaces
    its sweep, given as a JSON list or a single value."""
    suite = dataclasses.replace(suite, workload=dict(suite.workload), engine=dict(suite.engine),
                                sweep=dict(suite.sweep))
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or key not in WORKLOAD_KEYS + ENGINE_KEYS:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY a workload key "
                             f"({', '.join(WORKLOAD_KEYS)}) or an EngineConfig field")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key in suite.sweep:
            suite.sweep[key] = value if isinstance(value, list) else [value]
        else:
            (suite.workload if key in WORKLOAD_KEYS else suite.engine)[key] = value
    return suite


def expand(suite: Suite) -> list[Point]:
    keys = list(suite.sweep)
    points = []
    for values in itertools.product(*(suite.sweep[k] for k in keys)):
        chosen = dict(zip(keys, values))
        workload = {**suite.workload, **{k: v for k, v in chosen.items() if k in WORKLOAD_KEYS}}
        engine = {**suite.engine, **{k: v for k, v in chosen.items() if k in ENGINE_KEYS}}
        name = "-".join(f"{k}={_slug(v)}" for k, v in chosen.items()) or "default"
        trace_name = "-".join(f"{k}={_slug(v)}" for k, v in chosen.items() if k in WORKLOAD_KEYS)
        points.append(Point(name, trace_name or "default", workload, engine))
    return points


def _slug(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def make_trace(workload: dict, model: str | None) -> Trace:
    args = {k: v for k, v in workload.items() if k != "sharegpt"}
    for key in ("input_len", "output_len"):
        if key in args:
            args[key] = tuple(args[key])
    if workload.get("sharegpt"):
        if model is None:
            raise ValueError("sharegpt workloads count tokens with the model's tokenizer: pass --model")
        args["lengths"] = _sharegpt_lengths(model)
    return synthesize(**args)


@lru_cache(maxsize=2)
def _sharegpt_lengths(model: str):
    return sharegpt_lengths(tokenizer_counter(model))


def check_model_shape(suite: Suite, model: str) -> None:
    if suite.model_shape == "any":
        return
    want = json.loads((MODELS_DIR / suite.model_shape / "config.json").read_text())
    have = json.loads((Path(model) / "config.json").read_text())
    off = {k: (have.get(k), want.get(k)) for k in SHAPE_KEYS if have.get(k) != want.get(k)}
    if off:
        print(f"warning: suite {suite.name} was written for {suite.model_shape}, but {model} "
              f"differs in {', '.join(f'{k}={a} (expected {b})' for k, (a, b) in off.items())}",
              file=sys.stderr)


def _replay_point(point: Point, trace: Trace, trace_path: Path, args) -> dict:
    from slora.replay import run_replay

    return run_replay(trace, model=args.model, engine_options=point.engine, synthetic_adapters=True,
                      trace_path=str(trace_path), seed=0, progress=not args.quiet)


def release_device_memory() -> None:
    """Free the last point's engine before the next one sizes its pool from free GPU memory: the
    engine holds reference cycles (gc), and torch keeps freed blocks cached (empty_cache)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _simulate_point(point: Point, trace: Trace, trace_path: Path, args) -> dict:
    from slora.sim import Profile, simulate

    if not args.profile:
        raise SystemExit("--mode simulate needs --profile PROFILE.json (see experiments/SIMULATOR.md)")
    engine = dict(point.engine)
    return simulate(trace, Profile.load(args.profile), engine_options=engine,
                    num_pages=engine.pop("num_pages", None), trace_path=str(trace_path)).result


# One runner per mode: the real engine on the wall clock, or the simulator on a virtual one.
RUNNERS = {"replay": _replay_point, "simulate": _simulate_point}


def run_suite(suite: Suite, args) -> list[Path]:
    """Run every point not yet done; return the result paths of all points."""
    out_dir = Path(args.results) / suite.name
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)
    if args.model and not args.dry_run:
        check_model_shape(suite, args.model)
    points = expand(suite)
    paths, written = [], set()
    for i, point in enumerate(points, 1):
        result_path = out_dir / f"{point.name}.json"
        paths.append(result_path)
        trace_path = out_dir / "traces" / f"{point.trace_name}.jsonl"
        if trace_path not in written and (args.force or not trace_path.exists()):
            write_trace(make_trace(point.workload, args.model), trace_path)
            written.add(trace_path)
        if args.dry_run or (result_path.exists() and not args.force):
            status = f"trace {trace_path}" if args.dry_run else "done"
            print(f"[{i}/{len(points)}] {point.name}: {status}")
            continue
        print(f"[{i}/{len(points)}] {point.name}", flush=True)
        result = RUNNERS[args.mode](point, read_trace(trace_path), trace_path, args)
        result["config"].update(suite=suite.name, point=point.name)
        result_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        release_device_memory()
    return paths


def summary_table(suite: Suite, results: list[dict]) -> str:
    x = suite.plot.get("x")
    ref = suite.reference.get("throughput_req_s", {})
    header = ["point"] + [label for _, label in SUMMARY_COLUMNS] + (["paper req/s"] if ref else [])
    rows = [header]
    for r in results:
        row = [r["config"].get("point", "?")]
        row += ["n/a" if r.get(k) is None else f"{r[k]:.3f}" for k, _ in SUMMARY_COLUMNS]
        if ref:
            row.append(str(ref.get(str(lookup(r, x)), "")))
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", help="suite file, e.g. experiments/suites/table3-s1.json")
    p.add_argument("--model", help="Hugging Face model directory (default: a config.json of the "
                   "suite's model_shape, run with random weights)")
    p.add_argument("--mode", choices=sorted(RUNNERS), default="replay",
                   help="replay: the real engine on the wall clock")
    p.add_argument("--profile", help="simulator profile (with --mode simulate)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload or engine setting, or a sweep (e.g. duration=30, "
                   "num_adapters=[5,100], device=cuda); repeatable")
    p.add_argument("--results", default="results", help="results root (default: results/)")
    p.add_argument("--force", action="store_true", help="redo points (and traces) that exist")
    p.add_argument("--dry-run", action="store_true", help="write the traces and list the points only")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        suite = apply_overrides(load_suite(args.suite), args.set)
        if args.model is None and not args.dry_run:
            if suite.model_shape == "any":
                raise ValueError(f"suite {suite.name} runs on any model: pass --model DIR")
            args.model = str(MODELS_DIR / suite.model_shape)
        paths = run_suite(suite, args)
    except (ValueError, OSError, ImportError) as e:
        print(f"run_suite: error: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    results = load_results(paths)
    print(summary_table(suite, results))
    figure = plot_results(results, Path(args.results) / suite.name / f"{suite.name}.png",
                          x=suite.plot.get("x"), series=suite.plot.get("series"),
                          title=f"{suite.name} ({args.mode}, {Path(args.model).name})")
    print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
