"""A mixture of experts for few rows (Triton): the routing and the picked experts' GLUs as three
kernels, reading each picked expert's weights straight from the stacked tensors.

Twins: `reference.route` (from the router's logits on) and `reference.experts_grouped` /
`experts_dense`, which give the same result within rounding (tests/kernels/test_experts.py).

At a decode step's few rows a layer of experts is a weight stream, like a dense layer's
few-rows GEMM (slora.kernels.gemm): each picked expert's bytes are read once and used for one
row. The grouped GEMM there sorts the T x k (token, expert) pairs, counts the groups, gathers
the rows and scatters the outputs back, a dozen small launches a layer around two GEMMs whose
tiles are shaped for many rows. Here:

- `route`: one program a token: the softmax over its router logits in float32, the top k in
  order of weight (ties to the lower expert), renormalised where asked.
- `_gate_up_kernel`: program (column block, pair): the pair's token row against its expert's
  gate and up rows of that block (plus the expert's biases, gpt-oss), their GLU (SwiGLU,
  GeGLU or gpt-oss's clamped SwiGLU) into the pair's row of `mid`.
- `_down_kernel`: program (column block, token): each of the token's k pairs against its
  expert's down rows of that block, the outputs rounded to the model dtype (plus the expert's
  bias, rounded again), times the pair's weight and summed over the k in float32, in pick
  order: deterministic, no atomics.

The rounding points are the twins': gate, up and each pair's down output rounded to the model
dtype, a bias added to the rounded product and rounded again, the GLU as `fused.glu` /
`fused.swiglu_oai`, the weighted sum in float32. No host sync and no shape that depends on
the routing: a CUDA graph captures them. Each pair reads its expert's weights, so a
batch whose pairs share experts reads them more than once: `few_rows` says where the grouped
GEMM, which reads each picked expert once, takes over (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .fused import glu, swiglu_oai
from .reference import Glu
from .tuning import pow2

# EngineConfig.moe_experts "auto": a step's layer of experts runs here while its pairs (rows x
# k, each reading its expert) are at most this many times the experts they pick in expectation
PAIRS_OVER_PICKED = 1.5


def few_rows(experts: int, k: int) -> int:
    """The most rows of a step for which "auto" runs a layer of `experts` experts, `k` picked a
    row, here: while rows x k <= PAIRS_OVER_PICKED x experts (1 - (1 - k / experts)^rows),
    the experts picked in expectation under uniform routing. On an H100 the grouped GEMM
    (which reads each picked expert once) overtakes these kernels near that ratio: at 16 rows
    of Qwen3-30B-A3B's layer (128 pairs over 82 experts) and 8 of Mixtral 8x7B's (16 pairs
    over 7.2) (docs/performance.md)."""
    rows = 0
    while (rows + 1) * k <= PAIRS_OVER_PICKED * experts * (1 - (1 - k / experts) ** (rows + 1)):
        rows += 1
    return rows


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, pick_ptr, E, stride_l,
                  K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < E, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # (0 past E)
    slot = tl.arange(0, KP)
    top = tl.zeros([KP], tl.float32)
    pick = tl.zeros([KP], tl.int32)
    for j in tl.static_range(K):
        m = tl.max(p, 0)
        i = tl.min(tl.where(p == m, offs, BLOCK_E), 0)
        top = tl.where(slot == j, m, top)
        pick = tl.where(slot == j, i, pick)
        p = tl.where(offs == i, -1.0, p)
    if RENORM:
        top = top / tl.sum(top, 0)
    tl.store(weights_ptr + t * K + slot, top, mask=slot < K)
    tl.store(pick_ptr + t * K + slot, pick.to(tl.int64), mask=slot < K)


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route` from the router's logits [T, E] (in the model dtype, as the router's
    GEMM rounds them): (weights float32 [T, k], experts int64 [T, k])."""
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    pick = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, weights, pick, E, logits.stride(0), K=k, KP=pow2(k),
                            RENORM=renormalise, BLOCK_E=pow2(E), num_warps=1,
                            **pdl.options(logits.device))
    return weights, pick


@triton.jit
def _gate_up_kernel(h_ptr, w_ptr, b_ptr, pick_ptr, mid_ptr, H, I, stride_h, stride_we,
                    stride_wn, K: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
                    ALPHA: tl.constexpr, BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    tile = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < I
    pdl.wait(PDL)
    e = tl.load(pick_ptr + pair)
    x_ptrs = h_ptr + (pair // K) * stride_h + offs_k
    g_ptrs = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k0 + offs_k < H
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(g_ptrs + k0, mask=m, other=0.0).to(tl.float32) * x, 1)
        acc_u += tl.sum(tl.load(u_ptrs + k0, mask=m, other=0.0).to(tl.float32) * x, 1)
    pdl.launch_next(PDL)
    dt = mid_ptr.dtype.element_ty
    g, u = acc_g.to(dt), acc_u.to(dt)
    if BIAS:  # (the expert's [gate | up] bias row, added to the rounded products)
        g = (g.to(tl.float32) + tl.load(b_ptr + e * 2 * I + offs_n, mask=n_ok).to(tl.float32))
        u = (u.to(tl.float32) + tl.load(b_ptr + e * 2 * I + I + offs_n, mask=n_ok)
             .to(tl.float32))
        g, u = g.to(dt), u.to(dt)
    if ACT == "swiglu_oai":
        y = swiglu_oai(g, u, LIMIT, ALPHA)
    else:
        y = glu(g, u, ACT == "gelu_pytorch_tanh")
    tl.store(mid_ptr + pair * I + offs_n, y, mask=n_ok)


@triton.jit
def _down_kernel(mid_ptr, w_ptr, b_ptr, pick_ptr, weights_ptr, out_ptr, H, I, stride_we,
                 stride_wn, stride_out, K: tl.constexpr, BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    tile = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < H
    pdl.wait(PDL)
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        pair = t * K + j
        e = tl.load(pick_ptr + pair)
        w_ptrs = (w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
                  + offs_k[None, :])
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = k0 + offs_k < I
            x = tl.load(mid_ptr + pair * I + k0 + offs_k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
        y = acc.to(dt).to(tl.float32)
        if BIAS:  # (the expert's down bias, added to the rounded product)
            y = (y + tl.load(b_ptr + e * H + offs_n, mask=n_ok).to(tl.float32)).to(dt)
            y = y.to(tl.float32)
        total += y * tl.load(weights_ptr + pair)
    pdl.launch_next(PDL)
    tl.store(out_ptr + t * stride_out + offs_n, total.to(dt), mask=n_ok)


def _tiles(kernel: str, n: int, rows: int, device: torch.device) -> dict:
    """The launch of `kernel` ("gate_up", "down") over weight rows of n elements for `rows`
    tokens: BLOCK_N weight rows a program, BLOCK_K elements a step, and its warps (the best
    of a sweep on an H200 at 1 and 8 tokens of Qwen3-30B-A3B's and Mixtral 8x7B's layers);
    small tiles in the interpreter (its cost grows with a tile's elements)."""
    if device.type != "cuda":
        return dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)
    if kernel == "gate_up":
        return dict(BLOCK_N=8, BLOCK_K=min(256, pow2(n)), num_warps=8)
    if rows <= 2:  # (down: a program a token and block; few tokens, many narrow blocks)
        return dict(BLOCK_N=8, BLOCK_K=min(512, pow2(n)), num_warps=4)
    return dict(BLOCK_N=16, BLOCK_K=min(128, pow2(n)), num_warps=4)


def experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            weights: torch.Tensor, pick: torch.Tensor, act: Glu = Glu(),
            gate_up_bias: torch.Tensor | None = None,
            down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.experts_grouped(h, gate_up, down, weights, pick, act, gate_up_bias,
    down_bias)`: h [T, H]; gate_up [E, 2I, H], down [E, H, I] with unit inner strides; the
    biases (both or neither) contiguous [E, 2I] and [E, H]; weights float32 and pick [T, k] as
    `route` gives them. Returns [T, H] in h's dtype."""
    T, H = h.shape
    k = pick.shape[1]
    I = down.shape[2]
    assert gate_up.shape[1:] == (2 * I, H) and down.shape[1] == H
    assert h.stride(1) == gate_up.stride(2) == down.stride(2) == 1
    out = torch.empty(T, H, dtype=h.dtype, device=h.device)
    if not T:
        return out
    bias = gate_up_bias is not None
    assert bias == (down_bias is not None)
    assert not bias or (gate_up_bias.is_contiguous() and down_bias.is_contiguous())
    mid = torch.empty(T * k, I, dtype=h.dtype, device=h.device)
    pd = pdl.options(h.device)
    cfg = _tiles("gate_up", H, T, h.device)
    _gate_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), T * k)](
        h, gate_up, gate_up_bias if bias else h, pick, mid, H, I, h.stride(0),
        gate_up.stride(0), gate_up.stride(1), K=k, ACT=act.act, LIMIT=float(act.limit),
        ALPHA=float(act.alpha), BIAS=bias, **cfg, **pd)
    cfg = _tiles("down", I, T, h.device)
    _down_kernel[(triton.cdiv(H, cfg["BLOCK_N"]), T)](
        mid, down, down_bias if bias else h, pick, weights, out, H, I, down.stride(0),
        down.stride(1), out.stride(0), K=k, BIAS=bias, **cfg, **pd)
    return out
