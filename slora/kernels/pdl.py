"""Programmatic dependent launch (PDL; Hopper and later), off by default.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
finishing, instead of after it has completed and its completion has been signalled; it must
wait (`griddepcontrol.wait`) before it touches memory. Every Triton kernel here starts with
`wait(PDL)`, so turning PDL on changes when a kernel's blocks start, never what they read.
Why it may pay: a batch-32 decode step's graph runs ~450 kernels, and the H200 spent 0.24 ms
of a 6.2 ms step in the gaps between them (session 6). Not yet measured with it on:
`bench_scaling.py --pdl` sets `ENABLED` (notes/GPU_PLAN.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

ENABLED = False  # read at each launch (and so at each graph capture)


def options(device: torch.device) -> dict:
    """A kernel launch's PDL arguments: the PDL constexpr and Triton's `launch_pdl` (CUDA)."""
    if ENABLED and device.type == "cuda":
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (a no-op
    without PDL)."""
    if PDL:
        gdc_wait()
