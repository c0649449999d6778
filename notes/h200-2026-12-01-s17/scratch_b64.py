"""Session 17 scratch: the MBGMV q/k/v pair (bench_kernels.run_mbgmv: every token its own
adapter, shrink + expand, timed from a CUDA graph) with the expand's tiles as shipped and as
before session 17 (4 x 4 chunks only below 128 (token, module) rows), against the copy ceiling.

    python notes/h200-2026-12-01-s17/scratch_b64.py
"""
import sys

import torch

sys.path.insert(0, "experiments")
from bench_kernels import ceilings, run_mbgmv  # noqa: E402

from slora.kernels import lora  # noqa: E402

dev = torch.device("cuda")
copy = ceilings(dev)["copy_GBps"]
print(f"copy {copy:.0f} GB/s", flush=True)
cfg = dict(smoke=False, hidden=4096, page_size=16 * 2 * 32 * 128)
shipped = lora._mbgmv_expand_cfg


def before(T, G, max_rank, max_out, device):
    chn = min(8, lora._pow2(-(-max_out // lora.CHUNK)))
    if T * G < 128:
        return dict(BLOCK_R=min(4, lora._pow2(max_rank)), CHN=min(4, chn), num_warps=4)
    return dict(BLOCK_R=min(2, lora._pow2(max_rank)), CHN=chn, num_warps=4)


for T in (64, 128, 256):
    for r in (8, 16, 32, 64):
        line = []
        for name, fn in (("shipped", shipped), ("before", before)):
            lora._mbgmv_expand_cfg = fn
            row = run_mbgmv(T, r, cfg, dev, torch.bfloat16, torch.Generator().manual_seed(0),
                            check=False)
            line.append(f"{name} {row['us_ours']:6.2f} us {100 * row['GBps_ours'] / copy:5.1f}%")
        print(f"T={T:3d} r={r:2d}: " + " | ".join(line), flush=True)
lora._mbgmv_expand_cfg = shipped
