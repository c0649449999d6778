"""Programmatic dependent launch (PDL; Hopper and later) for a decode step's kernels.

A decode step is ~300 dependent kernels, most a few microseconds long, and between two of
them the GPU idles while the first one's last programs finish and the next one launches
(0.28 ms of a 5.4 ms batch-32 step on the H200, session 10). Launched with PDL, the next
kernel may launch before the one before it has completed:

- every kernel here starts with `wait` (`griddepcontrol.wait`: until the kernel before has
  completed and its writes are visible); nothing another kernel writes is read or written
  before it. Each kernel waits for the one before it, which waited for the one before that,
  so every earlier kernel's writes are visible; a kernel launched without PDL (a torch op,
  cuBLAS) waits for full completion as always, so the chain may mix both.
- the kernels with a main loop (the few-rows GEMM, decode attention, MBGMV) call
  `launch_next` (`griddepcontrol.launch_dependents`) after it, so the next kernel's launch
  overlaps their epilogues; the others let it launch as they exit.

Where `launch_next` goes was measured on the H200 (session 11, call 2): at each kernel's
start, the next kernel's programs were placed while the SMs were still busy, and the step
got slower at batch 1 and 16 without LoRA (4.02 -> 4.34 ms, 4.61 -> 5.05) though faster with
q/k/v/o (5.49 -> 5.26 at batch 16); asking L2 for the GEMMs' first weight columns before the
wait made every batch slower (batch 32 without LoRA: 5.50 ms, 5.59 with 1,024 columns, 6.40
with 4,096). Session 8 tried the wait alone beside cuBLAS GEMMs: a tie.
`ENABLED` is read at each launch (and so at each graph capture); `bench_scaling.py --no-pdl`
turns it off to time both.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True
EARLY = True  # (session 11 experiment) the small kernels launch the next at their start


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(device: torch.device, early: bool = False) -> dict:
    """A launch's PDL arguments: the kernel's PDL constexpr and Triton's `launch_pdl`."""
    extra = {"EARLY": EARLY} if early else {}
    if ENABLED and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _hopper(index):
            return {"PDL": True, "launch_pdl": True, **extra}
    return {"PDL": False, **extra}


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def launch_next_early(PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL and EARLY:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (a no-op
    without PDL)."""
    if PDL:
        gdc_wait()
