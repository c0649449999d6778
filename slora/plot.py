"""Figures from result JSONs (`slora replay`, `slora simulate`), in one of three shapes:

- a sweep, when a setting of `SWEEP_AXES` varies across the results (or `x` names one):
  throughput, average latency, first-token latency p90 and SLO attainment against that
  setting, one line per series, as in S-LoRA's figures, and the inter-token latency p99
  where the results count it (a sweep of `max_prefill_chunk`); results of simulated replicas
  (`slora simulate --replicas`) add adapter loads per replica. Replicas against attainment,
  a line per router, is the sweep of `slora simulate --sweep replicas=... --sweep router=...`;
- latency distributions, when none varies (one result, or a replay and its simulation):
  the CDFs of first-token and end-to-end latency side by side, one line per result, drawn
  from the per-request latencies a result stores (`slora.metrics.latencies`), and of the
  inter-token latency over tokens where every result stores its gaps;
- per-replica load (`kind="load"`, results of simulated replicas): each replica's requests,
  adapter loads and SLO attainment, replicas ranked from the most loaded, a line per result,
  so routers' balance and adapter traffic compare at a glance.

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
from itertools import accumulate
from pathlib import Path

# The axes S-LoRA sweeps (and a fleet's replicas), in the order the x axis is chosen when not
# given.
SWEEP_AXES = ("replicas", "num_adapters", "alpha", "cv", "rate", "policy", "duration",
              "max_prefill_chunk", "max_num_seqs", "max_batch_tokens")
# Keys that split results into separate lines when they differ, in order of precedence.
SERIES_KEYS = ("source", "router", "policy", "ranks", "generator", "backend", "dtype", "model",
               "max_prefill_chunk")
PANELS = (
    ("throughput_req_s", "throughput (req/s)"),
    ("avg_latency_s", "average latency (s)"),
    ("ttft_p90_s", "first-token latency p90 (s)"),
    ("slo_attainment", "SLO attainment"),
)
# a sweep whose results count inter-token gaps adds this panel
ITL_PANELS = (("itl_p99_s", "inter-token latency p99 (s)"),)
# a sweep of simulated replicas adds this panel (see `metric`)
FLEET_PANELS = (("adapter_loads_per_replica", "adapter loads per replica"),)
LOAD_PANELS = (
    ("requests", "requests"),
    ("adapter_loads", "adapter loads"),
    ("slo_attainment", "SLO attainment"),
)
KINDS = ("auto", "sweep", "latency", "load")
DISTRIBUTIONS = (
    ("ttft_s", "first-token latency (s)"),
    ("e2e_s", "end-to-end latency (s)"),
)
# drawn too when every result stores its inter-token gaps (`slora.metrics.latencies`)
ITL_DISTRIBUTION = (("itl_s", "inter-token latency (s)"),)


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


def metric(result: dict, key: str):
    """A result's metric `key`; "adapter_loads_per_replica" is derived (adapter loads over
    the replicas, for a result of simulated replicas)."""
    if key == "adapter_loads_per_replica":
        replicas = result.get("config", {}).get("replicas")
        loads = result.get("stats", {}).get("adapter_loads")
        return None if not replicas or loads is None else loads / replicas
    return result.get(key)


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
           title: str | None = None, kind: str = "auto"):
    """The matplotlib Figure for `results`. kind "auto": a sweep against `x` (default: the first
    of SWEEP_AXES that varies), or, when none varies and `x` is not given, latency
    distributions; "sweep", "latency" or "load" (per-replica load) ask for one."""
    if not results:
        raise ValueError("plot: no results to draw")
    if kind not in KINDS:
        raise ValueError(f"plot: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "load":
        x = None
    else:
        x = x or choose_x(results)
        if kind == "sweep" and x is None:
            raise ValueError(f"plot: no setting of {', '.join(SWEEP_AXES)} varies across these "
                             "results; name the x axis with --x")
        if kind == "latency":
            x = None
    keys = series if series is not None else series_keys(results, x)
    lines = _group(results, keys)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind == "load":
        fig = _loads(plt, lines)
    elif x is None:
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
    panels = (PANELS + (ITL_PANELS if any(r.get("itl_p99_s") is not None for r in results)
                        else ())
              + (FLEET_PANELS if any("per_replica" in r for r in results) else ()))

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0),
                             layout="constrained")
    for ax, (key, ylabel) in zip(axes, panels):
        for label, rs in lines.items():
            pts = sorted(((lookup(r, x), metric(r, key)) for r in rs), key=lambda p: str(p[0])
                         if categorical else p[0])
            xs = [ticks.index(p[0]) for p in pts] if categorical else [p[0] for p in pts]
            ys = [float("nan") if p[1] is None else p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
        if categorical:
            ax.set_xticks(range(len(ticks)), [str(t) for t in ticks])
        elif x == "replicas":  # counts that double: equal steps, each count a tick
            counts = sorted({lookup(r, x) for r in results})
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(c) for c in counts])
            ax.minorticks_off()
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

    itl = all(r["latencies"].get("itl_s") for _, r in curves)
    panels = DISTRIBUTIONS + (ITL_DISTRIBUTION if itl else ())
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0),
                             layout="constrained")
    for ax, (key, xlabel) in zip(axes, panels):
        for label, r in curves:
            if key == "itl_s":  # [gap, tokens] pairs, ascending: a CDF over tokens
                values, counts = map(list, zip(*r["latencies"][key]))
            else:  # one latency a request
                values = sorted(r["latencies"][key])
                counts = [1] * len(values)
            total, cum = sum(counts), list(accumulate(counts, initial=0))
            # steps up at each latency by its share, from 0 before the first
            ax.plot(values[:1] + values, [c / total for c in cum], drawstyle="steps-post",
                    label=f"{label} ({len(r['latencies']['ttft_s'])} requests)")
        ax.locator_params(axis="x", nbins=6)  # tick labels of a few digits each, apart
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of tokens after each request's first" if key == "itl_s"
                      else "fraction of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    return fig


def _loads(plt, lines: dict[str, list[dict]]):
    """Per-replica load: each result's replicas ranked from the most loaded, one panel per
    quantity of `LOAD_PANELS` (each ranked on its own), a line per result."""
    curves = []  # (label, result)
    for label, rs in lines.items():
        for r in rs:
            replicas = r.get("config", {}).get("replicas")
            curves.append((label if len(rs) == 1 else f"{label}, {replicas} replicas", r))
    bare = [i for i, (_, r) in enumerate(curves) if not r.get("per_replica")]
    if bare:
        raise ValueError(f"plot: {len(bare)} of these results hold no per-replica load (the "
                         "\"per_replica\" key of `slora simulate --replicas`)")
    fig, axes = plt.subplots(1, len(LOAD_PANELS), figsize=(4.6 * len(LOAD_PANELS), 4.0),
                             layout="constrained")
    for ax, (key, ylabel) in zip(axes, LOAD_PANELS):
        for label, r in curves:
            values = sorted((p[key] for p in r["per_replica"] if p[key] is not None),
                            reverse=key != "slo_attainment")
            ax.plot(range(1, len(values) + 1), values, marker="." if len(values) > 16 else "o",
                    label=label)
        ax.set_xlabel("replica, ranked" + (" (worst first)" if key == "slo_attainment" else
                                           " (most first)"))
        ax.set_ylabel(f"{ylabel} per replica")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    return fig


def plot_results(results: list[dict], out: str | Path, x: str | None = None,
                 series: list[str] | None = None, title: str | None = None,
                 kind: str = "auto") -> Path:
    """Draw `results` (see `figure`) into `out` (PNG, PDF or SVG by extension); its path."""
    fig = figure(results, x=x, series=series, title=title, kind=kind)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out
