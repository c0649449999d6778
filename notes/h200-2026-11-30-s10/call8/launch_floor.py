"""What a small kernel costs inside a CUDA graph on the H200, before its bytes: kernels back
to back in one graph (as a decode step replays them), each either empty or a chain of N
dependent loads (pointer chasing through a small table, as MBGMV's slot -> rank/offset ->
page -> adapter row), with 132 x 4 programs like a small MBGMV launch. Beside them: the
MBGMV pair at batch 1 (shrink + expand, q/k/v rank 8), whose bytes are negligible."""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
from bench_kernels import bench_graph, run_mbgmv  # noqa: E402


@triton.jit
def _chain(tab_ptr, out_ptr, DEPTH: tl.constexpr):
    i = tl.program_id(0) % 64
    for _ in tl.static_range(DEPTH):
        i = tl.load(tab_ptr + i)
    tl.store(out_ptr + tl.program_id(0), i)


dev = torch.device("cuda")
L = 256
tab = torch.randperm(64, device=dev).to(torch.int32)
out = torch.empty(528, dtype=torch.int32, device=dev)
print("kernels per layer x launches: us per kernel (graph of 256 back to back)")
for depth in (0, 1, 2, 3, 4, 6):
    for programs in (32, 528):
        us = bench_graph(lambda: [_chain[(programs,)](tab, out, DEPTH=depth) for _ in range(L)],
                         dev) / L * 1e3
        print(f"  chain of {depth} dependent loads, {programs:3d} programs: {us:6.2f} us",
              flush=True)
cfg = dict(hidden=4096, page_size=16 * 2 * 32 * 128, smoke=False)
gen = torch.Generator().manual_seed(0)
for T in (1, 32, 64):
    r = run_mbgmv(T, 8, cfg, dev, torch.bfloat16, gen, check=False)
    print(f"MBGMV pair, batch {T} rank 8: {r['us_ours']:.2f} us a layer (two launches)")
