"""FP8-weight GEMMs against bf16 at a 7B's shapes (slora.kernels.fp8): which path each row count
should take, and how close each comes to the device's ceilings.

For each linear module of Llama-2-7B (qkv, o, gate_up, down) and each row count M in --rows:
- bf16: `gemm.linear` as the engine runs it (the few-rows kernel up to 32 rows, cuBLAS past);
- fp8 unpacked, M <= 64: `gemm.skinny_linear` over the E4M3 weight and its scales at the tiles
  `skinny_cfg` picks (configs' w_bytes 1 rule): W read as 32-bit words and unpacked by bit
  operations (`UNPACK`);
- fp8 converted, M <= 64: the same kernel with UNPACK off at the tiles of a bf16 W: float8
  tiles converted by cvt instructions (the path before the word reads), so one call compares
  the two;
- fp8 W8A8, M <= 128: x quantized per row (`fp8.quantize_rows`, timed with it), then the
  few-rows kernel over the FP8 x and W in the FP8 tensor cores (`skinny_linear(x_scale=)`),
  at the table's tiles (the tiles of a larger M do not fit an SM's shared memory);
- fp8 W8A8, x rounded, M <= 128: the same GEMM over an x rounded before it, as the engine
  runs the GEMMs whose input a norm or SiLU kernel rounds (q|k|v, gate|up, down);
- with --sweep, M <= 64: the unpacked and the W8A8 kernel at every BLOCK_K x num_stages x
  BLOCK_N x programs_per_sm of the sweep ("fp8 unpacked N64 K256 s3 x2": K cut for 2 programs
  per SM), each distinct launch once, variants that do not fit the device skipped;
- fp8 _scaled_mm: per-row activation quantization (`fp8.quantize_rows`) + `torch._scaled_mm`;
- fp8 dequant + cuBLAS, M >= 64: the weight dequantized to bf16 for the call, then F.linear
  (the twin's way: exact weights, bf16 tensor cores, the weight's bytes read three times).
Each op runs over enough layers' distinct weights (--weight-mb, 256 MB) that L2 holds none,
replayed from a CUDA graph (harness.bench_graph). Reported per layer: microseconds, the weight
bytes' GB/s and share of the measured copy bandwidth, TFLOP/s, and the error relative to the
norm of the fp32 twin over the FP8 weight (`quant.linear`): bf16's is the weight's own E4M3
rounding, _scaled_mm's adds the activations'. Last, a table per (module, M): bf16, unpacked
and converted, unpacked over converted, W8A8 with and without its rounding of x, and the
fastest of the paths that round x themselves (the sweep's included).

Writes bench_fp8.json under --out: the harness's header, then one row per (module, M, path).

    python experiments/bench_fp8.py --rows 1,32,64,256
    python experiments/bench_fp8.py --rows 1,32,64 --sweep
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import (add_out_arg, bench_graph, ceilings, free_memory, header,  # noqa: E402
                     write_result)
from slora.model import quant  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
GEMM_ROWS = 32  # EngineConfig.gemm_max_rows' default


SWEEP = dict(BLOCK_K=(128, 256, 512), num_stages=(2, 3, 4), BLOCK_N=(64, 128),
             programs_per_sm=(1, 2))


def few_rows_tiles(M: int, N: int, K: int, device, sweep: bool = False) -> list[tuple[str, dict]]:
    """(path, cfg) of the few-rows kernel over an FP8 W at M <= 64 rows: the table's pick
    (unpacked, and W8A8 at the same tiles), the converted path at a bf16 W's tiles, and with
    `sweep` the unpacked and the W8A8 kernel at SWEEP's tiles, K cut as `skinny_cfg` cuts it
    for a rule of that `programs_per_sm` (each distinct launch once)."""
    from slora.kernels import gemm, tuning

    if M > 128:
        return []
    pick = gemm.skinny_cfg(M, N, K, device, 1)
    w8a8 = [(path, dict(pick, UNPACK=False)) for path in ("fp8 W8A8", "fp8 W8A8, x rounded")]
    if M > 64:  # (a 16-bit x's tiles do not fit)
        return w8a8
    out = [("fp8 unpacked", pick),
           ("fp8 converted", dict(gemm.skinny_cfg(M, N, K, device, 2), UNPACK=False)), *w8a8]
    for kind, unpack in (("unpacked", True), ("W8A8", False)) if sweep else ():
        seen = [dict(pick, UNPACK=unpack)]
        for bk, stages, bn, per_sm in itertools.product(*SWEEP.values()):
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4 if bn == 64 else 8,
                       num_stages=stages, UNPACK=unpack, BLOCK_M=pick["BLOCK_M"],
                       SPLIT=gemm.k_slices(N, K, bn, bk, per_sm * tuning.sms(device)))
            if cfg not in seen:
                seen.append(cfg)
                out.append((f"fp8 {kind} N{bn} K{bk} s{stages} x{per_sm}", cfg))
    return out


def variants(M: int, N: int, K: int, device, sweep: bool = False) -> list:
    """(path, fn(x, w bf16, w fp8)) of each path that takes M rows."""
    from slora.kernels import fp8, gemm

    def few_rows(cfg):
        return lambda x, w, q: gemm.skinny_linear(x, q.weight, cfg=cfg, scale=q.scale)

    def w8a8(cfg, rounded=False):
        # x rounded: quantized on the first call (the error's, off the clock), reused after
        quantize = (functools.lru_cache(maxsize=1)(fp8.quantize_rows) if rounded
                    else fp8.quantize_rows)

        def fn(x, w, q):
            xq, xs = quantize(x)
            return gemm.skinny_linear(xq, q.weight, cfg=cfg, scale=q.scale, x_scale=xs,
                                      out_dtype=x.dtype)
        return fn

    out = [("bf16", lambda x, w, q: gemm.linear(x, w, max_rows=GEMM_ROWS))]
    out += [(path, w8a8(cfg, "x rounded" in path) if "W8A8" in path else few_rows(cfg))
            for path, cfg in few_rows_tiles(M, N, K, device, sweep)]
    out.append(("fp8 _scaled_mm", lambda x, w, q: fp8.scaled_mm_linear(x, q)))
    if M >= 64:
        out.append(("fp8 dequant + cuBLAS", lambda x, w, q: quant.linear(x, q)))
    return out


def summary(rows: list[dict], copy_gbps: float) -> str:
    """A line per (module, M): bf16, fp8 unpacked and converted (us and % of copy), unpacked
    over converted, W8A8 and W8A8 over an x rounded before it, and the fastest variant that
    rounds x itself (the sweep's included)."""
    def cell(r):
        return f"{r['us']:7.1f} ({100 * r['weight_GBps'] / copy_gbps:3.0f}%)" if r else f"{'-':>13}"

    lines = [f"{'module':8s}{'M':>5}  {'bf16':>13}  {'fp8 unpacked':>13}  {'fp8 converted':>13}"
             f"  {'conv/unp':>8}  {'fp8 W8A8':>13}  {'x rounded':>13}  fastest fp8"]
    keys = dict.fromkeys((r["module"], r["M"]) for r in rows)
    for module, M in keys:
        by = {r["path"]: r for r in rows if (r["module"], r["M"]) == (module, M)}
        new, old = by.get("fp8 unpacked"), by.get("fp8 converted")
        # (the fastest of the paths that round x themselves)
        fp8s = [r for p, r in by.items() if p.startswith("fp8") and "x rounded" not in p]
        best = min(fp8s, key=lambda r: r["us"]) if fp8s else None
        gain = f"{old['us'] / new['us']:8.2f}" if new and old else f"{'-':>8}"
        lines.append(f"{module:8s}{M:5d}  {cell(by.get('bf16'))}  {cell(new)}  {cell(old)}  {gain}"
                     f"  {cell(by.get('fp8 W8A8'))}  {cell(by.get('fp8 W8A8, x rounded'))}"
                     f"  {best['path'] + ' ' + format(best['us'], '.1f') + ' us' if best else '-'}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64,128,256,2048,8192",
                    help="row counts M (decode batches, prefill tokens)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weight-mb", type=int, default=256,
                    help="FP8 weight MB each op streams, over distinct layers (L2 holds none)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the unpacked and W8A8 FP8 kernels at SWEEP's tiles (M <= 64)")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    ceil = ceilings(device)
    print("ceilings:", ceil, flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for module, (N, K) in SHAPES.items():
        layers = max(1, -(-(args.weight_mb << 20) // (N * K)))
        ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(device, torch.bfloat16)
              for _ in range(layers)]
        qs = [quant.quantize_fp8(w) for w in ws]
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
            want = quant.linear(x.float(), qs[0])
            for path, fn in variants(M, N, K, device, args.sweep):
                try:
                    err = ((fn(x, ws[0], qs[0]).float() - want).norm() / want.norm()).item()
                    ms = bench_graph(lambda: [fn(x, w, q) for w, q in zip(ws, qs)], device,
                                     warmup_ms=5, rep_ms=20) / layers
                except triton.runtime.errors.OutOfResources as e:  # a sweep tile too big
                    print(f"{module:8s} M={M:5d} {path:22s} skipped: {e}", flush=True)
                    continue
                wbytes = N * K * (2 if path == "bf16" else 1)  # (the bytes the weight holds)
                rows.append(dict(module=module, M=M, path=path, us=ms * 1e3,
                                 weight_GBps=wbytes / ms / 1e6, TFLOPs=2 * M * N * K / ms / 1e9,
                                 err=err))
                r = rows[-1]
                print(f"{module:8s} M={M:5d} {path:22s} {r['us']:9.1f} us "
                      f"{r['weight_GBps']:6.0f} GB/s "
                      f"({100 * r['weight_GBps'] / ceil['copy_GBps']:3.0f}% of copy) "
                      f"{r['TFLOPs']:6.1f} TFLOP/s err {err:.1e}", flush=True)
        del ws, qs
        free_memory(device)
    result = {**header(__file__, device, ceil, argv), "rows": rows}
    path = write_result(args.out, "bench_fp8.json", result)
    print(f"wrote {path}\n\nus per layer (% of the copy rate, {ceil['copy_GBps']:.0f} GB/s, "
          f"the weight's bytes)\n{summary(rows, ceil['copy_GBps'])}")
    return result


if __name__ == "__main__":
    main()
