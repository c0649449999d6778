"""Scratch (session 13, kept with its call): MBGMM shrink at S2-like shapes, swept over BLOCK_R,
split_k and pipeline stages; with --one, a single launch for ncu."""
import sys
import torch
sys.path.insert(0, "experiments")
from bench_kernels import Pool, bench_graph, work_tiles  # noqa: E402
from slora.kernels import lora  # noqa: E402

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
d, out_dims = 4096, (4096,) * 3
orig = lora._mbgmm_cfg
one = "--one" in sys.argv
shapes = [((4, 216), 64)] if one else [((4, 216), 32), ((4, 216), 64), ((8, 512), 64), ((1, 256), 64)]
for (n_seg, seg_len), r in shapes:
    T = n_seg * seg_len
    P = Pool(n_seg, r, d, out_dims, 16 * 2 * 32 * 128, 2, torch.bfloat16, dev, gen)
    seg_start = torch.arange(0, T + 1, seg_len, dtype=torch.int32, device=dev)
    seg_slot = torch.randperm(n_seg, generator=gen).to(torch.int32).to(dev)
    x = torch.randn(T, d, generator=gen).to(torch.bfloat16).to(dev)
    offa = P.offsets[:, :, 0]
    tiles = work_tiles(seg_start, seg_slot, x)
    if one:
        for _ in range(3):
            lora.mbgmm_shrink(x, P.pool[0], P.pages, offa, P.ranks, seg_start, seg_slot, P.stride, r, tiles)
        torch.cuda.synchronize()
        break
    res = []
    for br in (16, 32, 64):
        if br > r:
            continue
        for st in (2, 3, 4):
            for k in (1, 2, 4, 8, 16):
                for nw in (4, 8):
                    lora._mbgmm_cfg = lambda *a, o=dict(BLOCK_R=br, num_stages=st, num_warps=nw), **kw: {**orig(*a, **kw), **o}
                    fn = lambda: [lora.mbgmm_shrink(x, P.pool[l], P.pages, offa, P.ranks, seg_start, seg_slot, P.stride, r, tiles, split_k=k) for l in range(2)]
                    try:
                        us = bench_graph(fn, dev, warmup_ms=5, rep_ms=15) / 2 * 1e3
                    except Exception as e:
                        print("fail", br, st, k, nw, type(e).__name__)
                        continue
                    finally:
                        lora._mbgmm_cfg = orig
                    res.append((us, br, st, k, nw))
    fn = lambda: [lora.mbgmm_shrink(x, P.pool[l], P.pages, offa, P.ranks, seg_start, seg_slot, P.stride, r, tiles) for l in range(2)]
    dflt = bench_graph(fn, dev, warmup_ms=5, rep_ms=15) / 2 * 1e3
    res.sort()
    print(f"shrink {n_seg} x {seg_len} r={r}: default {dflt:.1f} us; best " +
          "; ".join(f"R{b} st{s} k{k} w{w} {u:.1f}" for u, b, s, k, w in res[:6]), flush=True)
