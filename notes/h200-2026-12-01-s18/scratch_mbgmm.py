"""Session 18 scratch: MBGMM's pair (shrink, expand) as a graphed mixed step runs it: the
grid sized for the bucket (`graphs._static_batch`'s programs), the work list holding only the
prompts' tiles, decode rows as one-token segments the list skips. Times, per layer, the pair
alone, the pair launched for the step's own tiles ("exact": an eager step's launch), and the
pair after a cuBLAS GEMM of the bucket's rows (the base q/k/v or o projection before it in a
step), each from a CUDA graph of 4 layers. Run on the tree under test and on a before
tree (PYTHONPATH) to compare.

    python notes/h200-2026-12-01-s18/scratch_mbgmm.py
"""
import sys

import torch
import triton

sys.path.insert(0, "experiments")
from bench_kernels import Pool, bench_graph  # noqa: E402

from slora.kernels import lora  # noqa: E402
from slora.kernels.tiles import capacity, token_tiles  # noqa: E402

dev, dt = torch.device("cuda"), torch.bfloat16
gen = torch.Generator().manual_seed(0)
d, L, TILE = 4096, 4, 64
if not torch.cuda.is_available():  # a smoke run of the script's logic (interpreter)
    dev, dt, d, L, TILE = torch.device("cpu"), torch.float32, 128, 1, 16
CASES = [  # (bucket tokens, decode rows, prompts as (tokens, rank))
    (512, 128, [(128, 16)]),
    (1024, 128, [(300, 64)]),
    (1024, 160, [(216, 64), (216, 32), (216, 16), (216, 8)]),
    (2048, 200, [(200, r) for r in (64, 32, 16, 8) * 2]),
    (4096, 0, [(512, r) for r in (64, 32, 16, 8) * 2]),  # an eager step's size
] if dev.type == "cuda" else [(64, 8, [(20, 16), (9, 8)])]
print(f"{'G':>2} {'bucket':>6} {'prompts':>24} {'pair us':>8} {'exact':>8} {'gemm us':>8} "
      f"{'gemm+pair':>10}")
for G in (3, 1):
    out_dims = (d,) * G
    for T, n_dec, prompts in CASES:
        S = n_dec + len(prompts)
        lens = [1] * n_dec + [n for n, _ in prompts]
        seg_start_l = [0]
        for n in lens:
            seg_start_l.append(seg_start_l[-1] + n)
        assert seg_start_l[-1] <= T
        # one adapter per segment: rank 64 pool rows; each prompt's rank set per adapter
        page = 16 * 2 * 32 * 128 if dev.type == "cuda" else 512
        P = Pool(S, 64, d, out_dims, page, L, dt, dev, gen)
        ranks = torch.full((S, G), 16, dtype=torch.int32)
        for i, (_, r) in enumerate(prompts):
            ranks[n_dec + i] = r
        ranks = ranks.to(dev)
        seg_start = torch.tensor(seg_start_l, dtype=torch.int32, device=dev)
        seg_slot = torch.arange(S, dtype=torch.int32, device=dev)
        keep = [False] * n_dec + [True] * len(prompts)  # the graphs' list: prompts' tiles only
        listed = token_tiles(seg_start_l, TILE, keep)
        buf = torch.zeros(1 + 2 * capacity(T, S, TILE), dtype=torch.int32)
        buf[:len(listed)] = torch.tensor(listed, dtype=torch.int32)
        tiles = buf.to(dev)
        programs = min(capacity(T, S, TILE), triton.cdiv(T, TILE) + 16)
        x = torch.randn(T, d, generator=gen).to(dt).to(dev)
        y = torch.randn(T, sum(out_dims), generator=gen).to(dt).to(dev)
        w = torch.randn(sum(out_dims), d, generator=gen).to(dt).to(dev) * 0.01
        offa, offb = P.offsets[:, :, 0], P.offsets[:, :, 1]

        def pair(l):
            xa = lora.mbgmm_shrink(x, P.pool[l], P.pages, offa, ranks, seg_start, seg_slot,
                                   P.stride, 64, tiles, programs)
            lora.mbgmm_expand(xa, y, P.pool[l], P.pages, offb, ranks, seg_start, seg_slot,
                              out_dims, P.strides, tiles, programs)

        def gemm():
            torch.matmul(x, w.t(), out=y)

        exact = torch.tensor(listed, dtype=torch.int32, device=dev)

        def pair_exact(l):  # the launches sized for this step's own tiles (an eager step's)
            xa = lora.mbgmm_shrink(x, P.pool[l], P.pages, offa, ranks, seg_start, seg_slot,
                                   P.stride, 64, exact)
            lora.mbgmm_expand(xa, y, P.pool[l], P.pages, offb, ranks, seg_start, seg_slot,
                              out_dims, P.strides, exact)

        t_pair = bench_graph(lambda: [pair(l) for l in range(L)], dev) / L * 1e3
        t_exact = bench_graph(lambda: [pair_exact(l) for l in range(L)], dev) / L * 1e3
        t_gemm = bench_graph(lambda: [gemm() for _ in range(L)], dev) / L * 1e3
        t_both = bench_graph(lambda: [(gemm(), pair(l)) for l in range(L)], dev) / L * 1e3
        desc = "+".join(f"{n}r{r}" for n, r in prompts[:2]) + ("..." if len(prompts) > 2 else "")
        print(f"{G:>2} {T:>6} {desc:>24} {t_pair:8.2f} {t_exact:8.2f} {t_gemm:8.2f} "
              f"{t_both:10.2f}", flush=True)
        del P
