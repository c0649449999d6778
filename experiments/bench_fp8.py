"""FP8-weight GEMMs against bf16 at a 7B's shapes (slora.kernels.fp8): which path each row count
should take, and how close each comes to the device's ceilings.

For each linear module of Llama-2-7B (qkv, o, gate_up, down) and each row count M in --rows:
- bf16: `gemm.linear` as the engine runs it (the few-rows kernel up to 32 rows, cuBLAS past);
- fp8 few-rows: `gemm.skinny_linear` over the E4M3 weight and its scales, at the tiles
  `skinny_cfg` picks, and at twice their BLOCK_K (a stage then holds as many W bytes as
  bf16's), M <= 64;
- fp8 _scaled_mm: per-row activation quantization (`fp8.quantize_rows`) + `torch._scaled_mm`;
- fp8 dequant + cuBLAS, M >= 64: the weight dequantized to bf16 for the call, then F.linear
  (the twin's way: exact weights, bf16 tensor cores, the weight's bytes read three times).
Each op runs over enough layers' distinct weights (--weight-mb, 256 MB) that L2 holds none,
replayed from a CUDA graph (harness.bench_graph). Reported per layer: microseconds, the weight
bytes' GB/s and share of the measured copy bandwidth, TFLOP/s, and the error relative to the
norm of the fp32 twin over the FP8 weight (`quant.linear`): bf16's is the weight's own E4M3
rounding, _scaled_mm's adds the activations'.

Writes bench_fp8.json under --out: the harness's header, then one row per (module, M, path).

    python experiments/bench_fp8.py
    python experiments/bench_fp8.py --rows 1,32,64,128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import (add_out_arg, bench_graph, ceilings, free_memory, header,  # noqa: E402
                     write_result)
from slora.model import quant  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
GEMM_ROWS = 32  # EngineConfig.gemm_max_rows' default


def variants(M: int, N: int, K: int, device) -> list:
    """(path, fn(x, w bf16, w fp8)) of each path that takes M rows."""
    from slora.kernels import fp8, gemm

    out = [("bf16", lambda x, w, q: gemm.linear(x, w, max_rows=GEMM_ROWS))]
    if M <= 64:
        pick = gemm.skinny_cfg(M, N, K, device, 1)
        wide = dict(pick, BLOCK_K=2 * pick["BLOCK_K"])
        wide["SPLIT"] = max(1, min(pick["SPLIT"], -(-K // wide["BLOCK_K"])))
        out += [("fp8 few-rows", lambda x, w, q: gemm.skinny_linear(x, q.weight, scale=q.scale)),
                (f"fp8 few-rows BK{wide['BLOCK_K']}",
                 lambda x, w, q: gemm.skinny_linear(x, q.weight, scale=q.scale, cfg=wide))]
    out.append(("fp8 _scaled_mm", lambda x, w, q: fp8.scaled_mm_linear(x, q)))
    if M >= 64:
        out.append(("fp8 dequant + cuBLAS", lambda x, w, q: quant.linear(x, q)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64,128,256,2048,8192",
                    help="row counts M (decode batches, prefill tokens)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weight-mb", type=int, default=256,
                    help="FP8 weight MB each op streams, over distinct layers (L2 holds none)")
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
            for path, fn in variants(M, N, K, device):
                err = ((fn(x, ws[0], qs[0]).float() - want).norm() / want.norm()).item()
                ms = bench_graph(lambda: [fn(x, w, q) for w, q in zip(ws, qs)], device,
                                 warmup_ms=5, rep_ms=20) / layers
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
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
