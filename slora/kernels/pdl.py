"""Programmatic dependent launch (PDL; Hopper and later) for a decode step's kernels.

A decode step is ~300 dependent kernels, most a few microseconds long, and between two of
them the GPU idles while the first one's last programs finish and the next one launches
(0.28 ms of a 5.4 ms batch-32 step on the H200, session 10). Launched with PDL, the next
kernel's programs may be placed on the SMs the first one leaves free before it has finished.
Every kernel here starts with `start`:

1. `griddepcontrol.launch_dependents`: once every program of this kernel has run it, the next
   kernel in the stream may launch;
2. (the few-rows GEMM only) `prefetch_l2` of the first slice of its weights, which no kernel
   writes: their HBM reads overlap the kernel before;
3. `griddepcontrol.wait`: until the kernel before has completed and its writes are visible.
   Nothing another kernel writes is read or written before it.

Each kernel waits for the one before it, which waited for the one before that, so every
earlier kernel's writes are visible after the wait; a kernel launched without PDL (a torch
op, cuBLAS) waits for full completion as always, so the chain may mix both.

Session 8 tried the wait alone (no early launch, no prefetch) while cuBLAS ran the GEMMs: a
tie. `ENABLED` is read at each launch (and so at each graph capture); `bench_scaling.py
--no-pdl` turns it off to time both.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(device: torch.device) -> dict:
    """A launch's PDL arguments: the kernel's PDL constexpr and Triton's `launch_pdl`."""
    if ENABLED and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _hopper(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (a no-op
    without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first step: `launch_next`, then `wait`."""
    launch_next(PDL)
    wait(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (each a valid address: the caller clamps);
    nothing waits for them."""
    tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l",
                              [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
