"""Figures from result JSONs (`slora replay`, `slora simulate`), in one of two shapes:

- a sweep, when a setting of `SWEEP_AXES` varies across the results (or `x` names one):
  throughput, average latency, first-token latency p90 and SLO attainment against that
  setting, one line per series, as in S-LoRA's figures;
- latency distributions, when none varies (one result, or a replay and its simulation):
  the CDFs of first-token and end-to-end latency side by side, one line per result, drawn
  from the per-request latencies a result stores (`slora.metrics.latencies`).

Series: results split into lines by the keys of `SERIES_KEYS` that vary, except a key whose
values the keys before it already determine. So a replay and a simulation differ by `source`
alone even though their configs also record a model path against a profile's model name and
dtype "auto" against the profile's dtype.

The legend sits in a row of its own under the panels, so it never covers a label or a line.
matplotlib is imported only when drawing (the `plot` extra), with the Agg backend so it works
without a display.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

# The axes S-LoRA sweeps, in the order the x axis is chosen when not given.
SWEEP_AXES = ("num_adapters", "alpha", "cv", "rate", "policy", "duration")
# Keys that split results into separate lines when they differ, in order of precedence.
SERIES_KEYS = ("source", "policy", "ranks", "generator", "backend", "dtype", "model")
PANELS = (
    ("throughput_req_s", "throughput (req/s)"),
    ("avg_latency_s", "average latency (s)"),
    ("ttft_p90_s", "first-token latency p90 (s)"),
    ("slo_attainment", "SLO attainment"),
)
DISTRIBUTIONS = (
    ("ttft_s", "first-token latency (s)"),
    ("e2e_s", "end-to-end latency (s)"),
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


def choose_x(results: list[dict]) -> str | None:
    """The first of SWEEP_AXES whose value varies across `results`; None when none does."""
    for key in SWEEP_AXES:
        if len({lookup(r, key) for r in results}) > 1:
            return key
    return None


def series_keys(results: list[dict], x: str | None = None) -> list[str]:
    """The SERIES_KEYS (other than `x`) that split `results` into lines.

    A key is kept only when it splits a group of results that the keys kept before it leave
    together; a key that varies in step with an earlier one (a replay's dtype "auto" against
    its simulation's "float32", with `source` kept) labels nothing new and is left out.
    """
    kept: list[str] = []
    groups = [results]
    for key in SERIES_KEYS:
        if key == x:
            continue
        if any(len({lookup(r, key) for r in g}) > 1 for g in groups):
            kept.append(key)
            groups = list(_group(results, kept).values())
    return kept


def _group(results: list[dict], keys: list[str]) -> dict[str, list[dict]]:
    """Results by their label: "k=v, ..." over `keys` (the bare value for `source`); with no
    keys, the results' source."""
    lines: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        parts = [str(lookup(r, k)) if k == "source" else f"{k}={lookup(r, k)}" for k in keys]
        lines[", ".join(parts) or str(lookup(r, "source") or "slora")].append(r)
    return lines


def figure(results: list[dict], x: str | None = None, series: list[str] | None = None,
           title: str | None = None):
    """The matplotlib Figure for `results`: a sweep against `x` (default: the first of
    SWEEP_AXES that varies), or, when none varies and `x` is not given, latency distributions."""
    if not results:
        raise ValueError("plot: no results to draw")
    x = x or choose_x(results)
    keys = series if series is not None else series_keys(results, x)
    lines = _group(results, keys)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x is None:
        fig = _distributions(plt, lines)
    else:
        fig = _sweep(plt, lines, x)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4),
               fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def _sweep(plt, lines: dict[str, list[dict]], x: str):
    results = [r for rs in lines.values() for r in rs]
    missing = [i for i, r in enumerate(results) if lookup(r, x) is None]
    if missing:
        raise ValueError(f"plot: {len(missing)} result(s) have no value for x axis {x!r}")
    categorical = any(isinstance(lookup(r, x), str) for r in results)
    ticks = sorted({lookup(r, x) for r in results}, key=str) if categorical else None

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.0),
                             layout="constrained")
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
    return fig


def _distributions(plt, lines: dict[str, list[dict]]):
    """CDFs of each result's per-request latencies, one panel per latency kind."""
    curves = []  # (label, result)
    for label, rs in lines.items():
        for i, r in enumerate(rs):
            curves.append((label if len(rs) == 1 else f"{label} ({i + 1})", r))
    bare = [i for i, (_, r) in enumerate(curves) if not r.get("latencies")]
    if bare:
        raise ValueError(
            f"plot: no setting among {', '.join(SWEEP_AXES)} varies across these results, so "
            f"they plot as latency distributions, but {len(bare)} of them hold no per-request "
            "latencies (the \"latencies\" key that slora replay and slora simulate write); "
            "name a setting for the x axis with --x to plot their summary metrics instead")

    fig, axes = plt.subplots(1, len(DISTRIBUTIONS), figsize=(5.2 * len(DISTRIBUTIONS), 4.0),
                             layout="constrained")
    for ax, (key, xlabel) in zip(axes, DISTRIBUTIONS):
        for label, r in curves:
            values = sorted(r["latencies"][key])
            n = len(values)
            # steps up by 1/n at each request's latency, from 0 before the first
            ax.plot(values[:1] + values, [i / n for i in range(n + 1)], drawstyle="steps-post",
                    label=f"{label} ({n} requests)")
        ax.locator_params(axis="x", nbins=6)  # tick labels of a few digits each, apart
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    return fig


def plot_results(results: list[dict], out: str | Path, x: str | None = None,
                 series: list[str] | None = None, title: str | None = None) -> Path:
    """Draw `results` (see `figure`) into `out` (PNG, PDF or SVG by extension); its path."""
    fig = figure(results, x=x, series=series, title=title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out
