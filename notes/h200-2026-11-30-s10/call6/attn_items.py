"""The one-split decode kernel with several (sequence, KV head) items a program
(`attention._decode_items_kernel`) against one item a program, at a 7B's decode shapes (32
query heads; 32 KV heads, and 8), one split. Prints us per layer for items = 1, 2, 4, 8, 16
and what `items_per_program` picks."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
from bench_kernels import bench_graph, paged_kv  # noqa: E402

from slora.kernels import reference as ref  # noqa: E402
from slora.kernels.attention import items_per_program, paged_decode_attention  # noqa: E402

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
H, D = 32, 128
ITEMS = (1, 2, 4, 8, 16)
print(f"{'B':>5} {'ctx':>6} {'KVH':>4} " + "".join(f"{f'x{n} us':>9}" for n in ITEMS)
      + f" {'rule':>5} {'GB/s':>6} {'err':>8}")
for kvh in (32, 8):
    for B, ctx in ((32, 272), (64, 272), (128, 272), (256, 272), (32, 128), (128, 128),
                   (32, 1024), (128, 1024), (256, 512)):
        if B * kvh < 2 * 132:  # (the split kernel's ground)
            continue
        k, v, tables = paged_kv(B, ctx, kvh, D, 16, dev, torch.bfloat16, gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        expect = ref.paged_decode_attention(q, k, v, tables, lens, D ** -0.5)
        row, err = [], 0.0
        for n in ITEMS:
            fn = lambda: paged_decode_attention(q, k, v, tables, lens, D ** -0.5,  # noqa: E731
                                                num_splits=1, items=n)
            out = fn()
            err = max(err, float((out.double() - expect.double()).norm() / expect.double().norm()))
            row.append(bench_graph(fn, dev) * 1e3)
        rule = items_per_program(B * kvh, dev)
        us = row[ITEMS.index(rule)]
        nbytes = 2 * B * ctx * kvh * D * 2
        print(f"{B:5d} {ctx:6d} {kvh:4d} " + "".join(f"{t:9.1f}" for t in row)
              + f" {rule:5d} {nbytes / us / 1e3:6.0f} {err:8.1e}", flush=True)
        del k, v
