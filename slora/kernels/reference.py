"""Torch twins of every kernel: the specification, and the CPU path.

Page layout (docs/design.md draws it). The runner owns one tensor

    pool[num_layers, num_pages, P]      P = block_size * 2 * num_kv_heads * head_dim

and each kernel gets one layer's slice `pool_l = pool[l]` of shape [num_pages, P].

KV: page p of layer l holds K and V of `block_size` tokens:
    pool_l[p].view(2, block_size, num_kv_heads, head_dim)      [0] = K, [1] = V
`kv_views(pool_l, ...)` returns the strided K and V views [num_pages, block_size, kv_heads, head_dim].

Adapters: an adapter owns a page list `pages[0..n)`; the same page ids in every layer. Its
per-layer "virtual buffer" is the concatenation pool_l[pages[0]] ++ pool_l[pages[1]] ++ ...
so virtual element v lives at  pool_l[pages[v // P], v % P].  In that buffer, for each target
module m in LORA_MODULES order, the adapter stores
    A_m   : r_m rows of d_in(m) elements,   row i at offset_a[m] + i * stride_in(m)
    B_m^T : r_m rows of d_out(m) elements,  row i at offset_b[m] + i * stride_out(m)
with B already multiplied by the PEFT scaling (alpha / r or alpha / sqrt(r)), so
    y_m += (x @ A_m^T) @ (B_m^T)
Alignment rule: row strides and module offsets are multiples of LORA_ALIGN = 64 elements,
and P is too (the engine checks it), so any tile of 64 (or 32, 16, ...) elements starting at
a multiple of its own size inside a row lies in one page: a kernel looks up the page once per
(row, tile), never per element, and no tile straddles a page. The padding costs under 64
elements per row.

Batch metadata for LoRA (`LoraMeta`, built by the runner once per step, shared by all layers):
    pages      int32 [n_a, max_pages]   page lists of the n_a distinct adapters in the batch
    offsets    int64 [n_a, 7, 2]        (offset_a, offset_b) per module; module absent -> rank 0
    ranks      int32 [L, n_a, 7]        rank of each module in each layer (0 = no LoRA there)
    token_slot int32 [T]                adapter row in `pages` for each token, -1 = base model
    offsets_d  int64 [n_a, G]           (DoRA batches) a group's DoRA rows, -1 = none
A step may carry its decode rows grouped by adapter (`segments_token_slot` maps them back):
    rows int32 [n], seg_start int32 [S+1], seg_slot int32 [S]: rows[seg_start[i]:seg_start[i+1]]
    use adapter row seg_slot[i]; rows not listed are base-only

DoRA: a DoRA module m also stores one row of d_out(m) elements, at offset_d[m], holding
    d_m = magnitude_m / ||W_m + B_m A_m||_row - 1        (per output channel, computed at load)
and its rows' output, base and LoRA together, is rescaled around the bias (`dora_scale`):
    y_m = bias_m + (1 + d_m) * (x W_m^T + (x A_m^T) B_m^T)
which is PEFT's DoRA forward. A layer where m has rank 0 stores d_m = 0: y_m unchanged.

Vocabulary modules (config.VOCAB_MODULES): an adapter's embed_tokens LoRA is laid out like a
module of d_in = vocab, d_out = hidden in layer 0's buffer, its lm_head LoRA like a module of
d_in = hidden, d_out = vocab in the last layer's (core.adapters.AdapterLayout). The embedding's
shrink is a gather, `embedding_shrink`: xa[t, 0, i] = A[i, ids[t]] (column ids[t] of A, as
PEFT's lora_embedding_A); its expand and lm_head's shrink and expand are `lora_shrink` /
`lora_expand` (one module each; lm_head's rows are the sequences' logits rows).
Adapter-added tokens (ids past the base vocabulary) are the group "added" of rank = the
adapter's count: their lm_head rows as A (added logits = `lora_shrink` of the logits rows'
hidden states) and their embedding rows as B^T (an added token's embedding = `lora_expand` of
`added_one_hot`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from slora.config import LORA_ALIGN  # noqa: F401  (part of the layout this module specifies)


# ----------------------------------------------------------------------------- KV cache

def kv_views(pool_l: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int):
    """K and V views of one layer's pool slice: each [num_pages, block_size, kv_heads, head_dim]."""
    paged = pool_l.view(pool_l.shape[0], 2, block_size, num_kv_heads, head_dim)
    return paged[:, 0], paged[:, 1]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store K/V of T new tokens: token t goes to page slot // block_size, row slot % block_size."""
    block_size = k_cache.shape[1]
    page, row = slot_mapping // block_size, slot_mapping % block_size
    k_cache[page, row] = k
    v_cache[page, row] = v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: list[int], ctx_lens: list[int],
                    scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new tokens over paged KV (prefill, decode, or a mix).

    q [T, H, D]: the new tokens of S sequences, sequence s at rows q_start[s]:q_start[s+1].
    Sequence s has ctx_lens[s] tokens in the cache (its new tokens included, already written),
    in pages block_tables[s, :]. New token i of s sits at position ctx_lens[s] - n_new + i and
    attends to every cached position <= its own; with `window` > 0 (a sliding-window layer)
    only to the `window` positions ending at its own (key position > its position - window,
    HF's sliding_window). GQA: query head h reads KV head h // (H / KVH). Scores are
    q.k * scale, then with `softcap` > 0 softcap * tanh(score / softcap) (Gemma 2's
    attn_logit_softcapping). `sinks` (float32 [H], optional; gpt-oss's attention sinks):
    query head h's softmax takes one more logit, sinks[h] (not scaled, not capped), which
    takes probability mass but has no value: the softmax runs over the scores and the sink,
    and the sink's column is dropped before the product with V. Softmax in float32. Returns
    [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for s, ctx in enumerate(ctx_lens):
        lo, hi = q_start[s], q_start[s + 1]
        n_new = hi - lo
        n_blocks = -(-ctx // block_size)
        blocks = block_tables[s, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, kvh, D)[:ctx]
        v = v_cache[blocks].reshape(-1, kvh, D)[:ctx]
        k = k.repeat_interleave(H // kvh, dim=1).transpose(0, 1).float()  # [H, ctx, D]
        v = v.repeat_interleave(H // kvh, dim=1).transpose(0, 1).float()
        qs = q[lo:hi].transpose(0, 1).float()  # [H, n_new, D]
        scores = qs @ k.transpose(1, 2) * scale  # [H, n_new, ctx]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        hidden = kpos > qpos
        if window > 0:
            hidden |= kpos <= qpos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # the sinks' column, dropped after the softmax
            scores = torch.cat((scores, sinks.float()[:, None, None].expand(H, n_new, 1)), -1)
        probs = torch.softmax(scores, dim=-1)[..., :ctx]
        out[lo:hi] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode: one new token per sequence (q [B, H, D]); the twin of the Triton decode kernel.
    `window`, `softcap`, `sinks`: as `paged_attention`'s."""
    B = q.shape[0]
    return paged_attention(q, k_cache, v_cache, block_tables, list(range(B + 1)),
                           [int(c) for c in ctx_lens], scale, window, softcap, sinks)


# ----------------------------------------------------------------------------- LoRA

def gather_rows(pool_l: torch.Tensor, pages: torch.Tensor, start: int, rows: int, stride: int,
                width: int) -> torch.Tensor:
    """Rows [rows, width] of an adapter's virtual buffer: row i starts at start + i * stride.
    The pages the rows span, in the adapter's order, viewed with the row stride (a view of the
    pool when they lie in one page, else of a copy of those pages)."""
    P = pool_l.shape[1]
    assert pool_l.stride(1) == 1, "pool_l rows must be contiguous"
    first, last = start // P, (start + max(rows - 1, 0) * stride + width - 1) // P
    if first == last:
        span = pool_l[int(pages[first])]
    else:
        span = pool_l[pages[first:last + 1].long()].reshape(-1)
    return span.as_strided((rows, width), (stride, 1), span.storage_offset() + start - first * P)


def _adapter_rows(token_slot: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, the token rows that use it) for each adapter row in the batch (base rows: none)."""
    return [(s, (token_slot == s).nonzero().squeeze(1))
            for s in torch.unique(token_slot).tolist() if s >= 0]


def segments_token_slot(rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                        num_tokens: int) -> torch.Tensor:
    """The token_slot [num_tokens] that decode rows grouped by adapter stand for: the twins of
    the kernels over the groups are `lora_shrink` / `lora_expand` with it."""
    token_slot = torch.full((num_tokens,), -1, dtype=torch.int32, device=rows.device)
    lens = (seg_start[1:] - seg_start[:-1]).long()
    token_slot[rows.long()] = torch.repeat_interleave(seg_slot, lens).to(torch.int32)
    return token_slot


def lora_shrink(x: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                offsets_a: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                stride: int, max_rank: int) -> torch.Tensor:
    """xa[t, g, :r] = x[t] @ A_g^T for the G modules of one group that share the input x.

    x [T, d_in]; offsets_a int64 [n_a, G]; ranks int32 [n_a, G] (this layer); token_slot [T].
    Returns xa [T, G, max_rank] in float32, zero past each rank and on base-only rows
    (MBGMV when each token is its own row, MBGMM when runs of tokens share a slot).
    """
    T, d_in = x.shape
    G = offsets_a.shape[1]
    xa = torch.zeros(T, G, max_rank, dtype=torch.float32, device=x.device)
    for s, rows in _adapter_rows(token_slot):
        for g in range(G):
            r = int(ranks[s, g])
            if r == 0:
                continue
            A = gather_rows(pool_l, pages[s], int(offsets_a[s, g]), r, stride, d_in)
            xa[rows, g, :r] = (x[rows] @ A.T).float()
    return xa


def lora_expand(xa: torch.Tensor, out: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                offsets_b: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                out_dims: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """out[t, cols_g] += xa[t, g, :r] @ B_g^T for each module g of the group, in place.

    out [T, sum(out_dims)]: module g's columns start at sum(out_dims[:g]).
    Accumulates in float32, adds in out's dtype. Base-only rows are left untouched.
    """
    col, adapter_rows = 0, _adapter_rows(token_slot)
    for g, (d_out, stride) in enumerate(zip(out_dims, strides)):
        for s, rows in adapter_rows:
            r = int(ranks[s, g])
            if r == 0:
                continue
            BT = gather_rows(pool_l, pages[s], int(offsets_b[s, g]), r, stride, d_out)
            delta = xa[rows, g, :r] @ BT.float()
            out[rows, col:col + d_out] += delta.to(out.dtype)
        col += d_out


def dora_scale(out: torch.Tensor, bias: torch.Tensor | None, pool_l: torch.Tensor,
               pages: torch.Tensor, offsets_d: torch.Tensor, token_slot: torch.Tensor,
               out_dims: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """DoRA's rescale, in place, after the base linear and the LoRA expand of a group:
    out[t, cols_g] += d_g * (out[t, cols_g] - bias[cols_g]) for each token t whose adapter row
    has a DoRA row for module g (offsets_d[slot, g] >= 0); d_g is read from that row.

    out [T, sum(out_dims)] (module g's columns start at sum(out_dims[:g])); bias [sum(out_dims)]
    or None; strides[g] is module g's row stride (its B^T rows', `lora_expand`). Computes in
    float32 and stores in out's dtype. Base rows and rows of adapters without DoRA there are
    left untouched."""
    col, adapter_rows = 0, _adapter_rows(token_slot)
    for g, (d_out, stride) in enumerate(zip(out_dims, strides)):
        for s, rows in adapter_rows:
            off = int(offsets_d[s, g])
            if off < 0:
                continue
            d = gather_rows(pool_l, pages[s], off, 1, stride, d_out)[0].float()
            y = out[rows, col:col + d_out].float()
            b = bias[col:col + d_out].float() if bias is not None else 0.0
            out[rows, col:col + d_out] = (y + d * (y - b)).to(out.dtype)
        col += d_out


def dora_norms(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||W + B A|| over each output row, in float32: the norm DoRA divides its magnitude by.
    w [d_out, d_in] (the served base weight's rows of one module, dequantized where FP8);
    A [r, d_in]; B [d_out, r] already scaled by the PEFT scaling."""
    return torch.linalg.norm(w.float() + B.float() @ A.float(), dim=1)
def embedding_shrink(ids: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                     offsets_a: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                     stride: int, max_rank: int) -> torch.Tensor:
    """xa[t, 0, :r] = A[:, ids[t]]: the embedding LoRA's shrink, a gather of column ids[t] of
    token t's adapter's A [r, vocab] (rows `stride` apart from offsets_a[s, 0]).

    ids [T] token ids; offsets_a int64 [n_a, 1]; ranks int32 [n_a, 1]; token_slot [T].
    Returns xa [T, 1, max_rank] in float32, zero past each rank and on base-only rows.
    """
    T = ids.shape[0]
    xa = torch.zeros(T, 1, max_rank, dtype=torch.float32, device=ids.device)
    for s, rows in _adapter_rows(token_slot):
        r = int(ranks[s, 0])
        if r == 0:
            continue
        A = gather_rows(pool_l, pages[s], int(offsets_a[s, 0]), r, stride, stride)
        xa[rows, 0, :r] = A[:, ids[rows].long()].T.float()
    return xa


def added_one_hot(ids: torch.Tensor, vocab: int, width: int) -> torch.Tensor:
    """xa [T, 1, width] float32: 1 at column ids[t] - vocab for a token past the base
    vocabulary (an adapter-added token), 0 elsewhere. Expanded (`lora_expand`) over the
    adapter's added embedding rows as B^T, it gives each added token its own row, exactly."""
    j = ids.long() - vocab  # (a comparison, not F.one_hot: no host sync inside a CUDA graph)
    return (j[:, None] == torch.arange(width, device=ids.device)).float()[:, None, :]


# ----------------------------------------------------------------------------- model pieces

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             center: bool = False) -> torch.Tensor:
    """Llama RMSNorm as HF computes it: normalise in float32, scale in the input dtype. A
    float32 weight (Gemma's folded 1 + w) scales in float32; the result takes x's dtype.
    `center`: a LayerNorm without bias (Cohere's): each row's mean taken off first."""
    xf = x.float()
    if center:
        xf = xf - xf.mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


class QkNorm(NamedTuple):
    """The RMSNorms on q and k of a family that has them (ModelConfig.qk_norm), applied after
    the q|k|v projection and its LoRA, before rotary (`qk_norm`). `head_dim`: each head over
    its head_dim elements, under a weight [head_dim] all heads share (Qwen3's, Gemma 3's) or
    one of each head's own ([q_size] and [kv_size]: Cohere's); None: a token's whole q and
    whole k (OLMo 2's, weights [q_size] and [kv_size]). `center`: LayerNorms without bias
    (Cohere's)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    head_dim: int | None
    center: bool = False

    @property
    def shared(self) -> bool:
        """Each head normed under the one weight all heads share."""
        return self.head_dim is not None and self.q_weight.numel() == self.head_dim


def qk_norm(qkv: torch.Tensor, q_size: int, kv_size: int, norm: QkNorm) -> torch.Tensor:
    """q|k|v [T, q_size + 2 kv_size] with q and k RMS-normalised as `norm` says (`rms_norm`)
    and v as it is, as a new tensor."""
    T, d = qkv.shape[0], norm.head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q, k = (rms_norm(t.reshape(T, -1, d or t.shape[-1]), w.view(-1, d or t.shape[-1]),
                     norm.eps, center=norm.center)
            for t, w in ((q, norm.q_weight), (k, norm.k_weight)))
    return torch.cat((q.reshape(T, -1), k.reshape(T, -1), v), dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up over the concatenated [gate | up] output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate) * up with gelu's tanh approximation (HF's gelu_pytorch_tanh)
    over the concatenated [gate | up] output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_mul(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over the concatenated [gate | up] output: g * sigmoid(alpha g)
    * (u + 1) with g = min(gate, limit), u = up clamped to [-limit, limit], each op rounded to
    the dtype as HF's eager ops round them."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


class Glu(NamedTuple):
    """A GLU activation over [gate | up] (ModelConfig.hidden_act, one of ACTIVATIONS), with
    swiglu_oai's limit and alpha."""

    act: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.act == "swiglu_oai":
            return swiglu_oai_mul(gate_up, self.limit, self.alpha)
        return gelu_tanh_mul(gate_up) if self.act == "gelu_pytorch_tanh" else silu_mul(gate_up)


def route(h: torch.Tensor, router: torch.Tensor, k: int, renormalise: bool,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing: (each token's k picked experts' weights, float32 [T, k],
    the experts [T, k]) from the router's softmax over the experts (its logits h router^T +
    bias, in h's dtype), in float32, its top k in order of weight, renormalised to sum to 1
    where `renormalise`."""
    probs = torch.softmax(F.linear(h, router, bias).float(), dim=-1)
    top, pick = probs.topk(k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if renormalise else top), pick


def experts_dense(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, pick: torch.Tensor, act,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted sum, every expert on every token: gate_up [E, 2I, H] and down
    [E, H, I] as two batched GEMMs (each output plus its expert's bias [E, 2I] / [E, H], where
    given), act ([n, 2I] -> [n, I]) between, each expert's output times its weight (0 where
    not picked), summed in float32. Shapes independent of the routing; E / k times the FLOPs
    of the picked experts."""
    share = torch.zeros(h.shape[0], gate_up.shape[0], dtype=torch.float32, device=h.device)
    share.scatter_(1, pick, weights)
    mid = torch.matmul(h, gate_up.transpose(1, 2))  # [E, T, 2I]
    if gate_up_bias is not None:
        mid = mid + gate_up_bias[:, None]
    out = torch.matmul(act(mid.flatten(0, 1)).view(*mid.shape[:2], -1), down.transpose(1, 2))
    if down_bias is not None:
        out = out + down_bias[:, None]
    return (out.float() * share.t()[:, :, None]).sum(0).to(h.dtype)


def experts_grouped(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, pick: torch.Tensor, act,
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`experts_dense`'s result from the picked experts alone: the T x k (token, expert)
    pairs sorted by expert, each expert's rows one group of a grouped GEMM
    (`torch._grouped_mm`, group ends from a device-side count), then each pair's output
    times its weight back in its token's row and summed over its k in float32. No host
    sync and shapes fixed by T and k, so a CUDA graph captures it."""
    T, k = pick.shape
    flat = pick.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)
    rows = h[order // k]  # [T k, H], by expert
    mid = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    if gate_up_bias is not None:
        mid = mid + gate_up_bias[flat[order]]
    out = torch._grouped_mm(act(mid), down.transpose(1, 2), offs=ends)  # [T k, H], by expert
    if down_bias is not None:
        out = out + down_bias[flat[order]]
    pairs = torch.empty(T * k, out.shape[1], dtype=torch.float32, device=h.device)
    pairs[order] = out.float() * weights.flatten()[order, None]
    return pairs.view(T, k, -1).sum(1).to(h.dtype)


def cap_logits(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in x's dtype, as HF soft-caps Gemma's final logits."""
    return torch.tanh(x / cap) * cap


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding; x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 center: bool = False):
    """The residual add (in x's dtype, as HF adds) and the RMSNorm of the sum: (sum, normed)."""
    s = x + delta
    return s, rms_norm(s, weight, eps, center)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin [T, D] of each token's position, as HF computes them (float32, then dtype)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotary on q and k of a fused [q | k | v] output; K and V stored at the tokens' slots.

    qkv [T, (H + 2 KVH) * D]. Returns the rotated q [T, H, D].
    """
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    cos, sin = rope_cos_sin(positions, inv_freq, qkv.dtype)
    q, k, v = qkv.split((num_heads * D, num_kv_heads * D, num_kv_heads * D), dim=-1)
    q = rotary(q.view(T, num_heads, D), cos, sin)
    k = rotary(k.view(T, num_kv_heads, D), cos, sin)
    write_kv(k_cache, v_cache, k, v.view(T, num_kv_heads, D), slot_mapping)
    return q
