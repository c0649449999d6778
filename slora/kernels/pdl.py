"""Programmatic dependent launch (PDL; Hopper and later) for a step's Triton kernels.

A decode step is ~300 dependent kernels, most a few microseconds long, and between two of
them the GPU idles while the first one's last programs finish and the next one launches.
Launched with PDL, the next kernel may launch before the one before it has completed:

- every program of every kernel here calls `wait` (`griddepcontrol.wait`: until the kernel
  before has completed and its writes are visible) before it reads or writes anything another
  kernel writes; before it, only what the step's kernels never write is read: the step's
  metadata (context lengths, positions, adapter slots, ranks, offsets and page ids:
  host-built, copied in before the step) and, in small MBGMV launches, the first tile of the
  adapter pages (copied in before the step; `mbgmv.PRE_WAIT_ROWS`). `prefetch` hints may
  precede it too: they ask L2 for lines and load nothing into a register. Each kernel
  waits for the one before it, which waited for the one before that, so every earlier
  kernel's writes are visible; a kernel launched without PDL (a torch op, cuBLAS) waits for
  full completion as always, so the chain may mix both. Programs that return early wait
  first too: a kernel whose programs all skipped the wait could end before the one before
  it, and the next kernel would see neither's writes complete.
- `launch_next` (`griddepcontrol.launch_dependents`) lets the next kernel launch once every
  program of this one has run it: the kernels with a main loop (the few-rows GEMM, decode
  attention, MBGMV, MBGMM) call it after the loop, so the next launch overlaps their
  epilogues; the small ones (norms, rotary + K/V store, SiLU, the split merge) right after
  their wait. Not at the start of the big kernels: the next kernel's programs would be placed
  while the GEMMs and attention still fill the SMs.

`ENABLED` is read at each launch (and so at each graph capture); `bench_scaling.py
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
def prefetch(ptrs, PDL: tl.constexpr):
    """Ask L2 for the 128-byte line at each pointer of `ptrs` (`prefetch.global.L2`: a hint,
    no register waits on it; a no-op without PDL). Called before `wait` for bytes the kernel
    before does not change (weights, the KV of earlier tokens), so that they come from HBM
    while it still runs. L2 is where the GPU's writes meet, so a line written after its
    prefetch is read as written."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
