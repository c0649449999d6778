"""Linear layers over FP8 weights (`slora.model.quant.Fp8Weight`) on CUDA.

Twin and specification: `quant.linear`, F.linear over the weight dequantized to x's dtype.

`linear(x, w, bias, max_rows=...)` is the GPU backends' base GEMM for any weight:
- a tensor weight: `gemm.linear` (the few-rows kernel or cuBLAS);
- an FP8 weight and a 16-bit x: the FP8 tensor cores on x quantized per token (W8A8): each
  row of x gets its own scale (its largest magnitude maps to E4M3's 448, `quantize_rows`), W
  keeps its per-channel ones, and both scales multiply the fp32 sums. Rounding the
  activations to E4M3 (at most 2^-4 relative an element) puts these paths about 2.6% of the
  output's norm from the twin, as far as the weights' own rounding puts the twin from bf16:
  the dynamic per-token W8A8 scheme vLLM serves FP8 checkpoints with. By rows:
  - at most `max_rows` (a decode step): the few-rows kernel over the FP8 x and the E4M3
    weight as they are (`gemm.skinny_linear(..., scale=, x_scale=)`), a weight stream with no
    conversion of either tile: the weight's bytes are the step's floor, half of bf16's;
  - more rows, both dims multiples of 16 (prefill, large decode batches): `torch._scaled_mm`,
    its product in bf16 (the one output type of per-row scaling; an fp16 x gets it
    converted, a rounding far below E4M3's), then the bias added;
- anything else (an fp32 x, dims that are not multiples of 16, which `_scaled_mm` requires,
  a CPU tensor): the twin.
An x that arrives as a `quant.Fp8Rows` (the norm and GLU kernels round what they write where it
feeds such a GEMM, `quantizes`) is not rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.model import quant
from slora.model.quant import FP8_DTYPE, FP8_MAX, Fp8Rows, Fp8Weight

from . import gemm, pdl
from .tuning import pow2

# A row whose largest magnitude is below this gets the scale of this magnitude (an all-zero
# row, a graph's padding, quantizes to zeros instead of dividing by 0).
MIN_AMAX = 1e-12
# The constants of the E4M3 rounding, as the kernels that round rows take them
ROUNDING = dict(FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX)


def quantizes(x: torch.Tensor, w) -> bool:
    """Whether `linear(x, w)` rounds x per row to E4M3 on every path it may take (the few-rows
    kernel, `_scaled_mm`): an FP8 weight, a 16-bit x on CUDA, both of W's dims multiples of 16."""
    return isinstance(w, Fp8Weight) and uses_scaled_mm(x, w)


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """A row's E4M3 scale from its largest magnitude. (IEEE-rounded divisions here and in
    `to_e4m3`, as the twin's: `/` is an approximate division in Triton, which can round an
    element to the neighbouring E4M3 value.)"""
    return tl.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)


@triton.jit
def to_e4m3(v, scale, FP8_MAX: tl.constexpr):
    """float32 values over their row's scale, clamped to E4M3's range (stored as E4M3)."""
    return tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          MIN_AMAX: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE: tl.constexpr,
                          PDL: tl.constexpr):
    """One program per row. WHOLE (BLOCK_K >= K): the row is read once and rounded from
    registers; otherwise two passes over BLOCK_K-column blocks: its largest magnitude, then the
    row over its scale, rounded to E4M3 (the second pass from cache)."""
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    if WHOLE:
        ok = offs < K
        v = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), axis=0), FP8_MAX, MIN_AMAX)
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + offs,
                 to_e4m3(v, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=ok)
    else:
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        scale = row_scale(tl.max(amax, axis=0), FP8_MAX, MIN_AMAX)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            q = to_e4m3(v, scale, FP8_MAX)
            tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=ok)


ROW_MAX = 32768  # the longest row `row_tile` holds: 32 warps of 32 threads, 32 values each


def row_tile(N: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a program that holds a whole row of N <= ROW_MAX values in
    registers: BLOCK = pow2(N), a warp per 1,024 columns (32 values a thread), 4 to 32 warps."""
    block = pow2(N)
    return block, min(32, max(4, block // 1024))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~ q * scale: each row's largest
    magnitude maps to 448 (at least MIN_AMAX does). Twin: `quantize_rows_ref`."""
    M, K = x.shape
    assert x.stride(1) == 1, "x: unit column stride"
    q, scale = empty_rows(M, K, x.device)
    if M:
        # (longer rows: two passes over 1,024-column blocks)
        block, warps = row_tile(K) if K <= ROW_MAX else (1024, 4)
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), **ROUNDING,
                                    BLOCK_K=block, WHOLE=block >= K, num_warps=warps,
                                    **pdl.options(x.device))
    return q, scale


def empty_rows(M: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q, scale) for M rows of K values quantized per row."""
    return (torch.empty(M, K, dtype=FP8_DTYPE, device=device),
            torch.empty(M, 1, dtype=torch.float32, device=device))


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `quantize_rows`."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX)
    # (over a tensor: torch divides by a Python number through its reciprocal, rounding
    # otherwise than the kernel's IEEE division)
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def uses_scaled_mm(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether `linear` runs x @ w^T on the FP8 tensor cores: a 16-bit x on CUDA and both of
    W's dims multiples of 16 (`_scaled_mm`'s layout rule)."""
    N, K = w.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and N % 16 == 0 and K % 16 == 0)


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                     quantize=quantize_rows) -> torch.Tensor:
    """x [M, K] (16-bit) @ W^T (+ bias) -> [M, N] in x's dtype on the FP8 tensor cores: x
    quantized per row (`quantize`), W's E4M3 weight read column-major ([N, K] row-major
    transposed, no copy), fp32 accumulation, both scales applied to the fp32 sums, out in
    bf16 (then x's dtype)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0])
    xq, xs = quantize(x)
    out = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale.view(1, -1),
                           out_dtype=torch.bfloat16).to(x.dtype)
    if bias is not None:
        out += bias
    return out


def linear(x: torch.Tensor | Fp8Rows, w: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None, *, max_rows: int) -> torch.Tensor:
    """F.linear over a tensor or an FP8 weight, by the path the module docstring gives. An x
    that carries its FP8 rounding (`Fp8Rows`) is not quantized again."""
    # x's rounding: the one it carries, else computed here
    rounded = quantize_rows
    if isinstance(x, Fp8Rows):
        carried = (x.q, x.scale)
        rounded = lambda _: carried  # noqa: E731
    x = quant.rows(x)
    if not isinstance(w, Fp8Weight):
        return gemm.linear(x, w, bias, max_rows=max_rows)
    if gemm.uses_kernel(x, w.weight, max_rows):
        q, xs = rounded(x)
        return gemm.skinny_linear(q, w.weight, bias, scale=w.scale, x_scale=xs,
                                  out_dtype=x.dtype)
    if uses_scaled_mm(x, w):
        return scaled_mm_linear(x, w, bias, quantize=rounded)
    return quant.linear(x, w, bias)
