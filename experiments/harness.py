"""The benchmarks' shared harness: graph-replay timing, the device's measured ceilings, and the
header every result file carries.

    from harness import add_out_arg, bench_graph, ceilings, header, write_result

bench_graph(fn, device)  median ms of one call of `fn`, replayed from a CUDA graph after a
                         warm-up outside the capture (the host clock on CPU).
ceilings(device)         what the device moves and computes at best, measured now: copy GB/s
                         (a 2 GiB device-to-device copy, bytes read + written) and bf16 GEMM
                         TFLOP/s (8192^3). A kernel's rate is read against these.
header(script, device, ceil, argv)  {"gpu", "commit", "command", "ceilings"}: what a result
                         needs to be reproduced and compared; every result file starts with it
                         (commit: $SLORA_COMMIT when set, else `git rev-parse HEAD` of this
                         checkout, else "unknown").
write_result(out, name, result)  `result` as JSON in out/name.
sync(device), free_memory(device)  wait for the device; hand cached blocks back to it.

Raw results go under --out (add_out_arg: $OUT, else the repository's git-ignored results/).
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def bench_graph(fn, device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of one call of `fn`, replayed from a CUDA graph (host clock on CPU).
    Two calls on a side stream before the capture compile and warm up what `fn` launches."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def ceilings(device) -> dict:
    """{"copy_GBps", "gemm_bf16_TFLOPs"} measured on `device` (medians of do_bench). On CPU: the
    best of five copies of a 64 MB tensor, and no GEMM rate (NaN). Frees what it allocated, so
    that an engine made next sizes its pool from the same free memory as without it."""
    if device.type != "cuda":
        a = torch.ones(1 << 24)
        b = torch.empty_like(a)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
        return {"copy_GBps": 2 * a.numel() * a.element_size() / best / 1e9,
                "gemm_bf16_TFLOPs": float("nan")}
    import triton

    n = 1 << 30  # 2 GiB of bf16
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy = 2 * a.numel() * a.element_size() / ms / 1e6
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=25, rep=200, return_mode="median")
    del x, y
    free_memory(device)
    return {"copy_GBps": copy, "gemm_bf16_TFLOPs": 2 * m ** 3 / ms / 1e9}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    """Collect garbage and return the caching allocator's free blocks to the device, so that
    the next engine sizes its pool from what is really free."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def commit() -> str:
    """$SLORA_COMMIT when set: a copy of the tree (a device's) may have no .git, or one whose HEAD
    is not what was copied. Else HEAD of the checkout this file is in, if it is one of its own
    (not a copy inside another repository); else "unknown"."""
    if os.environ.get("SLORA_COMMIT"):
        return os.environ["SLORA_COMMIT"]
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        top, head = res.stdout.split()
        if res.returncode == 0 and Path(top).resolve() == ROOT:
            return head
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def header(script, device, ceil: dict, argv=None) -> dict:
    """The keys every result file starts with. `script`: the benchmark's file; `argv`: the
    arguments its main() parsed (None: the process's own), so that the command reproduces a
    run made through main(argv) too."""
    device = torch.device(device)
    script = Path(script).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    args = sys.argv[1:] if argv is None else list(argv)
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "commit": commit(), "command": shlex.join(["python3", str(script), *args]),
            "ceilings": ceil}


def add_out_arg(ap) -> None:
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "results"),
                    help="folder for the JSON results (default: $OUT, else results/)")


def write_result(out, name: str, result: dict) -> Path:
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path
