"""Session 14 scratch: MBGMV (q/k/v group) when the batch mixes ranks, as S2's decode steps do.

    python notes/h200-2026-11-30-s14/scratch_mixed.py

Rows: uniform ranks 8/16/32/64 (the reference rates), then ranks 64/32/16/8 mixed in one launch
(max_rank 64) with the tokens interleaved (S2's order: arrival) or sorted by rank, through
  - "ours": lora.py as it is (grid token x module x columns: tokens vary fastest);
  - "tok-slow": the expand's grid transposed (module x columns vary fastest, the token slowest),
    so with tokens sorted by rank (highest first) the long programs start first.
Shrink and expand timed together and apart. Written against a2c93d7's lora.py (call 2); the
shipped expand (9e92969 on) is the "tok-slow" form, so its patch no longer applies. % of copy: bytes (x, the tokens' A and B^T rows,
y read + written) over the 2 GiB copy's rate.
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT))
from bench_kernels import Pool, bench_graph, ceilings  # noqa: E402
from slora.kernels import lora  # noqa: E402

# the transposed expand: a patched copy of lora.py, imported as its own module
src = (ROOT / "slora/kernels/lora.py").read_text()
old_k = """    t = tl.program_id(0)
    g = tl.program_id(1)
    n0 = tl.program_id(2) * (CHN * CK)
    # Before the wait, what no kernel of the step writes: the step's metadata and, with PRE,
    # this program's first BLOCK_R rows of B^T"""
new_k = """    t = tl.program_id(1)
    g = tl.program_id(0) % G
    n0 = (tl.program_id(0) // G) * (CHN * CK)
    # Before the wait, what no kernel of the step writes: the step's metadata and, with PRE,
    # this program's first BLOCK_R rows of B^T"""
old_g = "    grid = (T, G, triton.cdiv(max(out_dims), cfg[\"CHN\"] * CHUNK))\n    _mbgmv_expand_kernel"
new_g = "    grid = (G * triton.cdiv(max(out_dims), cfg[\"CHN\"] * CHUNK), T, 1)\n    _mbgmv_expand_kernel"
assert old_k in src and old_g in src
src = src.replace(old_k, new_k).replace(old_g, new_g)
tmp = Path(tempfile.mkdtemp()) / "lora_tokslow.py"
tmp.write_text(src.replace("from . import pdl", "from slora.kernels import pdl")
               .replace("from .reference", "from slora.kernels.reference")
               .replace("from .tiles", "from slora.kernels.tiles"))
spec = importlib.util.spec_from_file_location("lora_tokslow", tmp)
lora_ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lora_ts)

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
cfg = ceilings(dev)
copy = cfg["copy_GBps"]
print(f"copy {copy:.0f} GB/s, gemm {cfg['gemm_bf16_TFLOPs']:.0f} TFLOP/s")
d = 4096
out_dims = (d, d, d)
print(f"{'T':>4} {'ranks':>10} {'order':>7} {'kernels':>8} | {'pair us':>8} {'%copy':>6} | "
      f"{'shrink':>7} {'expand':>7}")
for T in (64, 128, 136, 256):
    L = max(4, -(-256 * 2 ** 20 // (T * 64 * 6 * d * 2)))
    P = Pool(T, 64, d, out_dims, 16 * 2 * 32 * 128, L, torch.bfloat16, dev, gen)
    x = torch.randn(T, d, generator=gen).to(torch.bfloat16).to(dev)
    y = torch.randn(T, 3 * d, generator=gen).to(torch.bfloat16).to(dev)
    offa, offb = P.offsets[:, :, 0].contiguous(), P.offsets[:, :, 1].contiguous()
    slots = torch.arange(T, dtype=torch.int32, device=dev)
    cases = [(f"{r}", "-", [r] * T) for r in (8, 16, 32, 64)]
    mix = [(64, 32, 16, 8)[i % 4] for i in range(T)]
    cases += [("64..8", "inter", mix), ("64..8", "desc", sorted(mix, reverse=True)),
              ("64..8", "asc", sorted(mix))]
    for rk, order, ranks in cases:
        P.ranks = torch.tensor(ranks, dtype=torch.int32, device=dev)[:, None].expand(T, 3).contiguous()
        max_rank = max(ranks)
        nbytes = x.numel() * 2 + 2 * y.numel() * 2 + sum(ranks) * (3 * d + sum(out_dims)) * 2
        for name, k in (("ours", lora), ("tok-slow", lora_ts)):
            if name == "tok-slow" and order == "-" and rk != "64":
                continue
            xa0 = lora.mbgmv_shrink(x, P.pool[0], P.pages, offa, P.ranks, slots, P.stride, max_rank)

            def pair(k=k):
                for l in range(L):
                    xa = k.mbgmv_shrink(x, P.pool[l], P.pages, offa, P.ranks, slots, P.stride, max_rank)
                    k.mbgmv_expand(xa, y, P.pool[l], P.pages, offb, P.ranks, slots, out_dims, P.strides)

            def shrink(k=k):
                for l in range(L):
                    k.mbgmv_shrink(x, P.pool[l], P.pages, offa, P.ranks, slots, P.stride, max_rank)

            def expand(k=k):
                for l in range(L):
                    k.mbgmv_expand(xa0, y, P.pool[l], P.pages, offb, P.ranks, slots, out_dims, P.strides)

            us = [bench_graph(f, dev, warmup_ms=5, rep_ms=30) / L * 1e3 for f in (pair, shrink, expand)]
            pct = 100 * nbytes / (us[0] * 1e-6) / 1e9 / copy
            print(f"{T:>4} {rk:>10} {order:>7} {name:>8} | {us[0]:8.2f} {pct:5.1f}% | "
                  f"{us[1]:7.2f} {us[2]:7.2f}", flush=True)
    # correctness of the transposed expand against the shipped one (mixed ranks)
    y1, y2 = y.clone(), y.clone()
    lora.mbgmv_expand(xa0, y1, P.pool[0], P.pages, offb, P.ranks, slots, out_dims, P.strides)
    lora_ts.mbgmv_expand(xa0, y2, P.pool[0], P.pages, offb, P.ranks, slots, out_dims, P.strides)
    print(f"   tok-slow == ours: {torch.equal(y1, y2)}")
    del P
    torch.cuda.empty_cache()
