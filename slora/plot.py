"""Figures from result JSONs: throughput, latency, first-token latency and SLO attainment against
the swept axis, one line per series (e.g. per policy, or replay vs simulate), as in S-LoRA's
figures. matplotlib is imported only when drawing (the `plot` extra), with the Agg backend so it
works without a display.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

# The axes S-LoRA sweeps, in the order `--x` is guessed when not given.
SWEEP_AXES = ("num_adapters", "alpha", "cv", "rate", "policy", "duration")
# Keys that split results into separate lines when they differ.
SERIES_KEYS = ("source", "policy", "ranks", "generator", "backend", "dtype", "model")
PANELS = (
    ("throughput_req_s", "throughput (req/s)"),
    ("avg_latency_s", "average latency (s)"),
    ("ttft_p90_s", "first-token latency p90 (s)"),
    ("slo_attainment", "SLO attainment"),
)


def load_results(paths: list[str | Path]) -> list[dict]:
    results = []
    for p in paths:
        try:
            results.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"result {p}: cannot read it as JSON ({e})") from None
    return results


def lookup(result: dict, key: str):
    """A result's value for `key`: a metric, or a setting from its workload or engine config.

    Lists become strings (hashable, and readable in a legend).
    """
    config = result.get("config", {})
    for scope in (result, config.get("workload", {}), config.get("engine", {}), config):
        if key in scope and not isinstance(scope[key], dict):
            value = scope[key]
            return ",".join(map(str, value)) if isinstance(value, list) else value
    return None


def choose_x(results: list[dict]) -> str:
    for key in SWEEP_AXES:
        if len({lookup(r, key) for r in results}) > 1:
            return key
    raise ValueError(f"no setting among {', '.join(SWEEP_AXES)} varies across these results; "
                     "name the x axis with --x")


def series_keys(results: list[dict], x: str) -> list[str]:
    return [k for k in SERIES_KEYS if k != x and len({lookup(r, k) for r in results}) > 1]


def plot_results(results: list[dict], out: str | Path, x: str | None = None,
                 series: list[str] | None = None, title: str | None = None) -> Path:
    """Draw `results` into `out` (PNG, PDF or SVG by extension) and return its path."""
    if not results:
        raise ValueError("plot: no results to draw")
    x = x or choose_x(results)
    missing = [i for i, r in enumerate(results) if lookup(r, x) is None]
    if missing:
        raise ValueError(f"plot: {len(missing)} result(s) have no value for x axis {x!r}")
    keys = series if series is not None else series_keys(results, x)
    lines: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        label = ", ".join(f"{k}={lookup(r, k)}" for k in keys) or "slora"
        lines[label].append(r)

    categorical = any(isinstance(lookup(r, x), str) for r in results)
    ticks = sorted({lookup(r, x) for r in results}, key=str) if categorical else None

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for ax, (metric, ylabel) in zip(axes, PANELS):
        for label, rs in lines.items():
            pts = sorted(((lookup(r, x), r.get(metric)) for r in rs), key=lambda p: str(p[0])
                         if categorical else p[0])
            xs = [ticks.index(p[0]) for p in pts] if categorical else [p[0] for p in pts]
            ys = [float("nan") if p[1] is None else p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
        if categorical:
            ax.set_xticks(range(len(ticks)), [str(t) for t in ticks])
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
