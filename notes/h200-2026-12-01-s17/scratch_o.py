"""Session 17 scratch: MBGMV tiles for a one-module group (o: 4096 -> 4096) against q/k/v, at
S2's decode shapes (128 / 256 rows, ranks 64/32/16/8 mixed, rows highest rank first as the
scheduler orders them). S2's timeline showed o's pair at ~61-68% of copy and q/k/v's at
~87-96%. Prints the defaults and the best tiles of each kernel, GB/s of the bytes read.

    python notes/h200-2026-12-01-s17/scratch_o.py [RANK]   # RANK: every row that rank
"""
import sys

import torch

sys.path.insert(0, "experiments")
from bench_kernels import Pool, bench_graph, ceilings, layers_for  # noqa: E402

from slora.kernels import lora  # noqa: E402

dev, dt = torch.device("cuda"), torch.bfloat16
gen = torch.Generator().manual_seed(0)
print("ceilings", ceilings(dev), flush=True)
d, R = 4096, 64
orig_s, orig_e = lora._mbgmv_shrink_cfg, lora._mbgmv_expand_cfg
shrink_cfgs = [dict(BLOCK_R=br, CH=ch, num_warps=nw) for br in (1, 2, 4, 8) for ch in (16, 32)
               for nw in (4, 8)]
expand_cfgs = [dict(BLOCK_R=br, CHN=chn, num_warps=nw) for br in (1, 2, 4) for chn in (2, 4, 8)
               for nw in (2, 4)]
for G in (1, 3):
    out_dims = (d,) * G
    for T in (128, 256):
        P = Pool(T, R, d, out_dims, 16 * 2 * 32 * 128, layers_for(T * R * 2 * G * d * 2, False),
                 dt, dev, gen)
        L = P.pool.shape[0]
        mix = (int(sys.argv[1]),) if len(sys.argv) > 1 else (64, 32, 16, 8)
        ranks = torch.tensor([mix[i * len(mix) // T] for i in range(T)], dtype=torch.int32)
        P.ranks = ranks[:, None].expand(T, G).contiguous().to(dev)
        slots = torch.arange(T, dtype=torch.int32, device=dev)
        x = torch.randn(T, d, generator=gen).to(dt).to(dev)
        y = torch.randn(T, sum(out_dims), generator=gen).to(dt).to(dev)
        xa = lora.mbgmv_shrink(x, P.pool[0], P.pages, P.offsets[:, :, 0], P.ranks, slots, P.stride, R)
        rows = int(ranks.sum())
        nbytes = {"shrink": rows * G * d * 2 + x.numel() * 2,
                  "expand": rows * sum(out_dims) * 2 + 2 * y.numel() * 2}
        for kind, cfgs in (("shrink", shrink_cfgs), ("expand", expand_cfgs)):
            def fn():
                for l in range(L):
                    if kind == "shrink":
                        lora.mbgmv_shrink(x, P.pool[l], P.pages, P.offsets[:, :, 0], P.ranks,
                                          slots, P.stride, R)
                    else:
                        lora.mbgmv_expand(xa, y, P.pool[l], P.pages, P.offsets[:, :, 1], P.ranks,
                                          slots, out_dims, P.strides)
            lora._mbgmv_shrink_cfg, lora._mbgmv_expand_cfg = orig_s, orig_e
            default = bench_graph(fn, dev, warmup_ms=5, rep_ms=20) / L * 1e3
            res = []
            for c in cfgs:
                if kind == "shrink":
                    lora._mbgmv_shrink_cfg = lambda *a, c=c: dict(c)
                else:
                    lora._mbgmv_expand_cfg = lambda *a, c=c: dict(c)
                try:
                    res.append((bench_graph(fn, dev, warmup_ms=5, rep_ms=20) / L * 1e3, c))
                except Exception as e:  # noqa: BLE001
                    print("  ", kind, c, type(e).__name__)
            lora._mbgmv_shrink_cfg, lora._mbgmv_expand_cfg = orig_s, orig_e
            res.sort(key=lambda t: t[0])
            gbs = lambda us: nbytes[kind] / us / 1e3  # noqa: E731
            print(f"G={G} T={T} {kind}: default {default:.2f} us ({gbs(default):.0f} GB/s); best: "
                  + "; ".join(f"{c} {us:.2f} us ({gbs(us):.0f})" for us, c in res[:4]), flush=True)
        del P
