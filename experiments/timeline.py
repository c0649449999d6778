"""Where a profiled stretch of serving spent the GPU's time: a summary of a torch.profiler
timeline (chrome://tracing JSON, as `bench_scaling.py --trace-steps N` writes it).

Per CUDA stream: its kernels, copies and memsets, and the time they kept it busy. For the
compute stream (the one with the most kernel time): its idle time within the span, split by
what the GPU did meanwhile (a host-to-device copy on another stream, other streams' kernels,
nothing at all: the host was late), its longest gaps with what ran in them, the GPU's idle
time by the pair of kernels around it, and the kernels by GPU time.

    python experiments/timeline.py OUT/timeline-2000-qkvo.json.gz [--gaps 8] [--kernels 12]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> list[tuple[float, float]]:
    """Intersection of two merged, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def covered(gaps, ivs) -> list[float]:
    """For each of the sorted, disjoint `gaps`, the time the merged, sorted `ivs` cover in it
    (one pass: each piece of the intersection lies in one gap)."""
    out, pieces, j = [], intersect(gaps, ivs), 0
    for _, b in gaps:
        t = 0.0
        while j < len(pieces) and pieces[j][0] < b:
            t += pieces[j][1] - pieces[j][0]
            j += 1
        out.append(t)
    return out


def complement(xs, lo: float, hi: float) -> list[tuple[float, float]]:
    out, t = [], lo
    for a, b in xs:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def summarize(events: list[dict], gaps: int = 8, kernels: int = 12) -> str:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return "no GPU events in this timeline (a CPU run?)"
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", -1)].append(e)
    lo = min(e["ts"] for e in gpu)
    hi = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"span {(hi - lo) / 1e3:.1f} ms, {len(gpu)} GPU events on {len(by_stream)} streams"]
    busy = {}
    for s, evs in sorted(by_stream.items()):
        busy[s] = union([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        cats = defaultdict(lambda: [0, 0.0])
        for e in evs:
            kind = e["name"] if e["cat"] == "gpu_memcpy" else e["cat"]  # "Memcpy HtoD (...)"
            cats[kind][0] += 1
            cats[kind][1] += e["dur"]
        what = ", ".join(f"{k} x{n} {t / 1e3:.1f} ms" for k, (n, t) in sorted(cats.items()))
        lines.append(f"  stream {s}: busy {total(busy[s]) / 1e3:.1f} ms ({what})")
    kernel_time = {s: sum(e["dur"] for e in evs if e["cat"] == "kernel") for s, evs in by_stream.items()}
    main = max(kernel_time, key=kernel_time.get)
    idle = complement(busy[main], lo, hi)
    copies = union([(e["ts"], e["ts"] + e["dur"]) for s, evs in by_stream.items() if s != main
                    for e in evs if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]])
    others = union([iv for s, ivs in busy.items() if s != main for iv in ivs])
    copying, other = covered(idle, copies), covered(idle, others)  # per gap
    dark = [(b - a) - t for (a, b), t in zip(idle, other)]  # the GPU idle, per gap
    idle_copy = sum(copying)
    idle_other = sum(other) - idle_copy
    lines.append(f"compute stream {main}: idle {total(idle) / 1e3:.2f} ms of the span: "
                 f"{idle_copy / 1e3:.2f} ms while a host-to-device copy ran on another stream, "
                 f"{idle_other / 1e3:.2f} ms while only other work ran, "
                 f"{(total(idle) - idle_copy - idle_other) / 1e3:.2f} ms with the GPU idle")
    lines.append(f"host-to-device copies on other streams: busy {total(copies) / 1e3:.2f} ms, "
                 f"{total(intersect(copies, busy[main])) / 1e3:.2f} ms of it beside compute")
    main_evs = sorted(by_stream[main], key=lambda e: e["ts"])
    starts = [e["ts"] for e in main_evs]

    def around(a: float, b: float) -> tuple[str, str]:
        """Names of the compute stream's events that end a gap (a, b) and start after it."""
        i = bisect.bisect_left(starts, b - 1)
        before = max((e for e in main_evs[max(0, i - 64):i] if e["ts"] + e["dur"] <= a + 1),
                     key=lambda e: e["ts"], default=None)
        after = main_evs[i] if i < len(main_evs) else None
        return (before["name"][:40] if before else "-"), (after["name"][:40] if after else "-")

    longest = sorted(range(len(idle)), key=lambda i: idle[i][0] - idle[i][1])[:gaps]
    for i in sorted(longest):
        a, b = idle[i]
        before, after = around(a, b)
        lines.append(f"  gap {(b - a) / 1e3:7.2f} ms at {(a - lo) / 1e3:8.1f} ms (copying {copying[i] / 1e3:.2f} ms, "
                     f"GPU idle {dark[i] / 1e3:.2f} ms): after {before} / before {after}")
    # The GPU's idle time by the pair of compute-stream events around it: which hand-over leaves
    # the GPU dark, how often, and for how long in all.
    pairs: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for (a, b), d in zip(idle, dark):
        if d > 1.0:  # us
            p = pairs[around(a, b)]
            p[0] += 1
            p[1] += d
    lines.append("GPU idle (over 1 us a gap) by the compute stream's events around it:")
    for (before, after), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:gaps]:
        lines.append(f"  {t / 1e3:7.2f} ms in {n:5d} gaps (mean {t / n:6.1f} us): after {before} / before {after}")
    # GPU time by kernel, all streams: what the span's work was
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e["cat"] == "kernel":
            by_name[e["name"][:50]][0] += 1
            by_name[e["name"][:50]][1] += e["dur"]
    lines.append("kernels by GPU time (all streams):")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:kernels]:
        lines.append(f"  {t / 1e3:9.2f} ms {n:7d} x {t / n:7.1f} us  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timelines", nargs="+", help="chrome-trace JSON files (.json or .json.gz)")
    ap.add_argument("--gaps", type=int, default=8, help="the compute stream's longest gaps to list")
    ap.add_argument("--kernels", type=int, default=12, help="kernels to list by GPU time")
    args = ap.parse_args()
    for path in args.timelines:
        print(f"== {path}\n{summarize(load(path), args.gaps, args.kernels)}")


if __name__ == "__main__":
    main()
