"""Triton launches with less host work, for the steps that run eagerly.

A step with prompts runs outside the decode CUDA graphs: every kernel is launched from Python,
about 290 Triton launches for a 7B mixed step with LoRA. On the H200 such steps were bound by
the host (20-30 ms of wall time against 8-10 ms of GPU work: notes/kernels.md). On every call
Triton's `JITFunction.run` binds and specializes each argument, hashes a cache key, checks the
kernel's globals and builds launch metadata before it launches.

`fast(kernel)` wraps a `@triton.jit` kernel (`fast(k)[grid](*args, **constexprs)` as
`k[grid](...)`). It keeps, per kernel, the compiled kernel of every specialization it has met,
under a key of its own, and launches that kernel directly. The key holds what Triton
specializes a kernel on, or more:
  - a tensor: its dtype and whether its address is 16-byte aligned;
  - an integer: its type's range (32-bit, 64-bit, unsigned 64-bit) and, unless the kernel
    says `do_not_specialize` for it, whether it is 1 and whether it divides by 16;
  - a constexpr parameter, and any other value (a float, None, a bool): the value itself;
  - keyword arguments (constexprs, num_warps, num_stages): their values.
A key that is finer than Triton's only costs one more pass through Triton, which compiles
nothing new. The first call under a key goes through Triton (which compiles if it must) and
records the kernel it returns.

Triton's own path is kept where this one does not apply: under the interpreter (CPU tensors,
the tests), and when a launch hook is installed (a profiler's).
"""

from __future__ import annotations

import torch

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _on_cuda(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_cuda


def _arg_key(a, specialize: bool):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        width = 0 if -(1 << 31) <= a < (1 << 31) else 1 if a < (1 << 63) else 2
        return (width, a == 1, a % 16 == 0) if specialize else width
    return type(a), a  # floats, bools, None, constexpr values: exactly


class FastKernel:
    """A `@triton.jit` kernel launched through per-specialization cached compiled kernels."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = getattr(fn, "params", None)
        # kinds[i]: "c" constexpr (keyed by value), "n" do_not_specialize, "s" specialized
        self.kinds = None if params is None else tuple(
            "c" if p.is_constexpr else "n" if p.do_not_specialize else "s" for p in params)
        self.params = params
        self.kernels: dict = {}
        self.fast_launches = 0  # launches that skipped Triton's path (tests read it)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _eligible(self, args) -> bool:
        if self.kinds is None or _RAW_STREAM is None or hooks_installed():
            return False
        return _on_cuda(args[0])  # every kernel here takes a tensor first

    def launch(self, grid, args, kwargs):
        if not self._eligible(args):
            return self.fn[grid](*args, **kwargs)
        kinds = self.kinds
        key = (tuple(a if kinds[i] == "c" else _arg_key(a, kinds[i] == "s")
                     for i, a in enumerate(args)), tuple(sorted(kwargs.items())))
        hit = self.kernels.get(key)
        if hit is None:
            kernel = self.fn[grid](*args, **kwargs)  # Triton's path: compiles, launches
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default
                         for p in self.params[len(args):])
            self.kernels[key] = (kernel, tail)
            return kernel
        kernel, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _RAW_STREAM(torch.cuda.current_device())
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None,
                   None, *args, *tail)
        self.fast_launches += 1
        return kernel


def hooks_installed() -> bool:
    """Whether a launch hook is installed (a profiler's): Triton's knobs hold them as hook
    chains, empty unless something added one (a plain callable or None in other versions)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(bool(h.calls) if hasattr(h, "calls") else h is not None for h in hooks)


def fast(fn) -> FastKernel:
    """Decorator: `@fast` above `@triton.jit`."""
    return FastKernel(fn)
