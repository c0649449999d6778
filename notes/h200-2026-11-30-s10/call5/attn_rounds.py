"""Is decode attention at short contexts bound by each program's start (paid once per round of
resident programs)? The same KV bytes per layer split as B sequences x ctx keys, 32 heads
(MHA, a 7B), one split: if the start dominates, fewer, longer programs are faster."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
from bench_kernels import bench_graph, paged_kv  # noqa: E402

from slora.kernels.attention import paged_decode_attention  # noqa: E402

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
H = KVH = 32
D = 128
print(f"{'B':>5} {'ctx':>6} {'programs':>9} {'us':>8} {'GB/s':>7}")
for total in (32 * 272, 32 * 1024):
    for B in (4, 8, 16, 32, 64, 128, 256):
        ctx = total // B
        if ctx < 16:
            continue
        k, v, tables = paged_kv(B, ctx, KVH, D, 16, dev, torch.bfloat16, gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        for splits in (1,):
            us = bench_graph(lambda: paged_decode_attention(q, k, v, tables, lens, D ** -0.5,
                                                            num_splits=splits), dev) * 1e3
            nbytes = 2 * B * ctx * KVH * D * 2
            print(f"{B:5d} {ctx:6d} {B * KVH * splits:9d} {us:8.1f} {nbytes / us / 1e3:7.0f}",
                  flush=True)
        del k, v
