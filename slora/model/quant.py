"""FP8 (E4M3) base weights with one scale per output channel.

A quantized linear weight is an `Fp8Weight`: `weight` [N, K] in float8_e4m3fn and `scale` [N]
in float32, standing for W = weight * scale[:, None]. Only the base model's linear layers
(q/k/v/o, gate/up/down) are quantized; embeddings, lm_head and norms stay in the model dtype,
and adapters stay in the pool's dtype.

The rule every path keeps (the torch twin is the specification): a linear layer over an
`Fp8Weight` computes `F.linear(x, w.dequantize(x.dtype), bias)`, so a model served in FP8
equals, token for token in fp32, the same model whose linear weights were replaced by their
FP8 round trip (`dequantize(quantize_fp8(W))`). GPU kernels read `weight` and `scale` directly
(no dequantized copy in memory) and may round differently within the dtype's tolerance.

Per-channel scales make fusion free: the rows of q, k and v (or gate and up) keep their own
scales when their weights are concatenated (`cat`), and a per-tensor scale (a pre-quantized
checkpoint's) is the same scale repeated over its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


class Fp8Rows(NamedTuple):
    """A 16-bit activation x [M, K] with its per-row E4M3 rounding, as
    `slora.kernels.fp8.quantize_rows(x)` gives it: the GPU's norm and GLU kernels write both
    where their output feeds an FP8 GEMM that rounds its input so (`fp8.quantizes`), so that
    GEMM needs no quantization launch of its own; LoRA reads x."""

    x: torch.Tensor
    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] float32


def rows(x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """The 16-bit activation of `x`, whether it carries its FP8 rounding or not."""
    return x.x if isinstance(x, Fp8Rows) else x


@dataclass(frozen=True)
class Fp8Weight:
    """W = weight * scale[:, None]: weight [N, K] float8_e4m3fn, scale [N] float32."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        assert self.weight.dtype == FP8_DTYPE and self.weight.dim() == 2, self.weight.dtype
        assert self.scale.dtype == torch.float32 and self.scale.shape == self.weight.shape[:1]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype`: each element's exact value weight * scale, rounded once to dtype."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def to(self, device: torch.device) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.scale.to(device))


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per-output-channel E4M3: each row's largest magnitude maps to FP8's largest (448); an
    all-zero row gets scale 1 (its values stay 0)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale.contiguous())


def cat(parts: list[Fp8Weight]) -> Fp8Weight:
    """Fused rows (q|k|v, gate|up): each part keeps its rows' scales."""
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")  # the LayerWeights fields that may be FP8


def linear(x: torch.Tensor, w: "torch.Tensor | Fp8Weight",
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a weight in the model dtype or an `Fp8Weight` (the twin of every FP8
    kernel: the weight dequantized to x's dtype, then the matmul)."""
    if isinstance(w, Fp8Weight):
        w = w.dequantize(x.dtype)
    return F.linear(x, w, bias)


def quantize_weights(weights):
    """`weights` (a `slora.model.llama.Weights`) with every linear weight of every layer
    (`LINEAR_FIELDS`) in FP8, in place and returned. Quantized on the weights' own device, one
    layer at a time: a layer's 16- or 32-bit tensors are dropped as soon as its FP8 ones
    exist, so memory peaks at the weights plus one layer's float32 copy. Weights that are
    already `Fp8Weight` (a pre-quantized checkpoint's) stay as they are."""
    for layer in weights.layers:
        for name in LINEAR_FIELDS:
            w = getattr(layer, name)
            if isinstance(w, torch.Tensor):
                setattr(layer, name, quantize_fp8(w))
    return weights


def round_trip(w: torch.Tensor) -> torch.Tensor:
    """W's FP8 round trip in its own dtype: what a reference model runs to equal slora's FP8
    engine (tests replace HF's linear weights with this)."""
    return quantize_fp8(w).dequantize(w.dtype)
