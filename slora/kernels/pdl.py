"""Programmatic dependent launch (PDL; Hopper and later) for a step's Triton kernels.

A decode step is ~300 dependent kernels, most a few microseconds long, and between two of
them the GPU idles while the first one's last programs finish and the next one launches
(0.28 ms of a 5.4 ms batch-32 step on the H200, session 10). Launched with PDL, the next
kernel may launch before the one before it has completed:

- every program of every kernel here calls `wait` (`griddepcontrol.wait`: until the kernel
  before has completed and its writes are visible) before it reads or writes anything another
  kernel writes; before it, only what the step's kernels never write is read: the step's
  metadata (context lengths, positions, adapter slots, ranks, offsets and page ids:
  host-built, copied in before the step) and, in small MBGMV launches, the first tile of the
  adapter pages (copied in before the step; `lora.PRE_WAIT_ROWS`). Each kernel
  waits for the one before it, which waited for the one before that, so every earlier
  kernel's writes are visible; a kernel launched without PDL (a torch op, cuBLAS) waits for
  full completion as always, so the chain may mix both. Programs that return early wait
  first too: a kernel whose programs all skipped the wait could end before the one before
  it, and the next kernel would see neither's writes complete.
- `launch_next` (`griddepcontrol.launch_dependents`) lets the next kernel launch once every
  program of this one has run it: the kernels with a main loop (the few-rows GEMM, decode
  attention, MBGMV) call it after the loop, so the next launch overlaps their epilogues; the
  small ones (norms, rotary + K/V store, SiLU, the split merge) right after their wait.

Measured on the H200 (session 11; 7B decode steps, bf16, rank-16 adapters): with PDL
batch 1 went 4.07 -> 3.97 ms without LoRA, 16 4.66 -> 4.56, 32 5.46 -> 5.37 (1.29x of its
byte floor), 64 6.98 -> 7.00 (its GEMMs are cuBLAS's); with q/k/v/o 4.79 -> 4.64, 5.54 ->
5.38, 6.47 -> 6.35 (call 3). The small kernels' early `launch_next` took batch 1 on to 3.92
ms and ties elsewhere (call 5); reading the metadata before the wait took the LoRA steps on:
q/k/v/o 4.57 -> 4.55, 5.37 -> 5.34, 6.25 -> 6.17, all seven at batch 32 6.83 -> 6.76 (call
6). Calling `launch_next` at the start of every kernel lost (batch 1 4.02 -> 4.34 ms, 16
4.61 -> 5.05): the next kernel's programs were placed while the GEMMs and attention still
filled the SMs; asking L2 for each GEMM program's first weight columns between the two lost
at every batch (batch 32 5.50 ms, 5.59 with 1,024 columns, 6.40 with 4,096; call 2).
Session 8 tried the wait alone beside cuBLAS GEMMs: a tie.

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
