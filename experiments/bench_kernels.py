"""Kernel benchmark for the H200: LoRA (MBGMV, MBGMM) and paged decode attention, in physical rates.

    python experiments/bench_kernels.py [--out DIR] [--tune] [--only mbgmv|attention|overlap|experts]
                                        [--smoke]

Measures, in one run:
  1. ceilings (harness.ceilings): device copy bandwidth (a 2 GiB device-to-device copy, bytes
     read + written) and the bf16 GEMM rate (8192^3 torch.matmul);
  2. MBGMV (decode): one q/k/v group of 3 modules, each 4096 -> r -> 4096 (Llama-2-7B's MHA
     shapes), batch T in 1/16/32/64/128/256 x rank 8/16/32/64/128, every token its own adapter, shrink
     + expand. Achieved GB/s over the bytes that must move: x, the T adapters' A and B^T rows,
     y read and written. Beside it: the rows grouped by adapter (MBGMM over them,
     slora.kernels.segments) and plain torch, a chunk-granular index_select gather of the
     same pages + bmm (the metadata that indexes both is built outside the timing).
     --batches, --ranks pick the shapes; --sharing puts the T tokens on N adapters (a list;
     0: each its own), the bytes counting each distinct adapter once; --modules 1 times one
     4096 -> r -> 4096 layer; --vllm DIR also times vLLM's Triton LoRA kernels on the same
     adapters (`experiments/vllm_peer.py` unpacks them into DIR);
  3. MBGMM (prefill): 8 segments x 512 tokens, each its own adapter, the same q/k/v group, ranks
     16 and 64: TFLOP/s and GB/s, beside torch gather + matmul per segment;
  4. paged decode attention (Llama-2-7B: 32 heads, head_dim 128, MHA and GQA 8 KV heads),
     achieved GB/s over the K/V bytes read; paged prefill attention (8 x 512 and 2 x 2048
     tokens), TFLOP/s over the causal half, beside the torch twin;
  5. a mixed step's attention and q/k/v LoRA (n decode rows beside a 128-token prompt): every
     row through the prefill kernels, or the decode rows through the decode kernels
     (`--only-mixed` runs just this).
`--only mbgmv` and `--only attention` run the ceilings and table 2 or table 4 alone (a kernel
change's before / after in a short call). `--only overlap` times decode attention (250 rows
at context 400) and a 256-token chunk's base GEMMs over 32 layers alone, one after the other
and forked onto two streams in one graph; then the decode rows' whole chain (their own GEMMs
and attention) beside the chunk's GEMMs, the chunk's GEMMs confined to part of the SMs
(cuBLASLt's SM-count target), and the share of the GEMMs' time their weight bytes take at the
copy rate (what no overlap with bandwidth-bound attention can hide). `--only experts` times
one layer of a mixture of experts (Qwen3-30B-A3B's 128 experts of 768, top 8; Mixtral
8x7B's 8 of 14,336, top 2) at --batches tokens, routing included: the picked experts as
grouped GEMMs (`reference.experts_grouped`) beside every expert on every token
(`reference.experts_dense`) and, up to --fused-rows tokens, the few-rows Triton kernels
(`slora.kernels.experts`, as the engine runs them, router GEMM included), with the picked
experts' and every expert's weight bytes at the copy rate.

Every timed op is captured in a CUDA graph and timed by harness.bench_graph (the median of
do_bench's replays). So that adapters are not served from L2 (60 MB on the H200; in a real
step the whole model streams through between two uses of a layer's adapter), each graph runs
the op over `layers` distinct pool slices, at least 256 MB of adapter bytes in all, and
reports the time per layer.
Prints a short table last and writes the full results as JSON to --out (default $OUT, else
results/), after the harness's header (GPU, commit, command, ceilings).

--smoke runs tiny shapes on the CPU under the Triton interpreter (no timing worth reading): it
checks that the shape logic, the layouts and the torch baselines agree with the twins.
--tune sweeps tile configurations before the main sweep (--tune-only stops there): MBGMV's
(batch 16-256; shrink and expand), MBGMM's, or one of them (--tune mbgmv|mbgmm), the
decode attention's (--tune attention: keys a step, warps, stages,
splits) or the decode GEMMs' (--tune gemm: cuBLAS against slora.kernels.gemm's tiles).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_out_arg, bench_graph, ceilings, header, write_result  # noqa: E402
from slora.kernels import mbgmm, mbgmv, segments, tuning  # noqa: E402
from slora.kernels import tiles as tiles_mod  # noqa: E402
from slora.kernels import reference as ref  # noqa: E402
from slora.kernels.backend import TritonBackend  # noqa: E402
from slora.model.llama import Experts  # noqa: E402
from slora.kernels.attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    rope_paged_decode_attention,
)

ALIGN = ref.LORA_ALIGN
MODEL_LAYERS = 32  # Llama-2-7B's layers: the "auto" column's adapters span them


# ----------------------------------------------------------------------------- timing

def same_size_copy(nbytes: int, layers: int, device) -> float:
    """GB/s of a device copy moving `nbytes` (half read, half written) per layer, `layers` of
    them back to back from one CUDA graph, as the kernels are timed: the ceiling a kernel of
    that size can reach (a launch's ramp and tail weigh on a few MB as on any kernel)."""
    n = max(1, nbytes // 4)  # bf16 elements read (and as many written)
    src = torch.empty(layers, n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench_graph(lambda: [dst[i].copy_(src[i]) for i in range(layers)], device) / layers
    return 4 * n / ms / 1e6


# ----------------------------------------------------------------------------- adapter layout

class Pool:
    """`layers` pool slices holding n_a adapters of one q/k/v group (all of rank r), each in
    its own shuffled pages, laid out as reference.py says: per module A (r x d_in rows) then
    B^T (r x d_out rows), row strides padded to 64 elements."""

    def __init__(self, n_a, r, d_in, out_dims, page_size, layers, dtype, device, gen):
        G = len(out_dims)
        self.d_in, self.out_dims, self.G, self.r = d_in, tuple(out_dims), G, r
        pad = lambda n: -(-n // ALIGN) * ALIGN  # noqa: E731
        self.stride, self.strides = pad(d_in), tuple(pad(d) for d in out_dims)
        offs, off = [], 0
        for g in range(G):
            offs.append((off, off + r * self.stride))
            off += r * (self.stride + self.strides[g])
        self.per_adapter = off
        need = -(-off // page_size)
        num_pages = n_a * need + max(1, n_a // 4)
        self.pool = torch.empty(layers, num_pages, page_size, dtype=dtype, device=device)
        self.pool.normal_(0.0, 0.05)  # on the device: GBs of CPU randn take longer than the run
        perm = torch.randperm(num_pages, generator=gen)[:n_a * need]
        self.pages = perm.view(n_a, need).to(torch.int32).to(device)
        o = torch.tensor(offs, dtype=torch.int64)
        self.offsets = o[None].expand(n_a, G, 2).contiguous().to(device)
        self.ranks = torch.full((n_a, G), r, dtype=torch.int32, device=device)
        self.page_size = page_size
        # Torch baseline metadata: the 64-element chunk ids of every A / B^T row, per adapter.
        self._chunk_index(device)

    def _chunk_index(self, device):
        P, n_chunk_page = self.page_size, self.page_size // ALIGN

        def rows(start, stride, width):
            v = (start + torch.arange(self.r)[:, None] * stride
                 + torch.arange(0, width, ALIGN)[None, :])  # chunk starts [r, width/64]
            phys_page = self.pages.cpu().long()[:, v // P]  # [n_a, r, nch]
            return phys_page * n_chunk_page + (v % P) // ALIGN

        offs = self.offsets[0].cpu()
        self.idx_a = torch.stack([rows(int(offs[g, 0]), self.stride, self.d_in)
                                  for g in range(self.G)], 1).to(device)  # [n_a, G, r, nch]
        self.idx_b = [rows(int(offs[g, 1]), self.strides[g], self.out_dims[g]).to(device)
                      for g in range(self.G)]

    def adapter_bytes(self, n_distinct):
        el = self.pool.element_size()
        return n_distinct * self.r * (self.G * self.d_in + sum(self.out_dims)) * el


def torch_gather_bmm(x, out, pool_l, P: Pool, token_slot):
    """Plain torch MBGMV: gather each token's adapter rows (64-element chunks) and bmm."""
    T, d = x.shape
    chunks = pool_l.view(-1, ALIGN)
    A = chunks.index_select(0, P.idx_a[token_slot.long()].reshape(-1))
    A = A.view(T, P.G * P.r, d)
    xa = torch.bmm(A, x.view(T, d, 1)).view(T, P.G, 1, P.r)
    col = 0
    for g, d_out in enumerate(P.out_dims):
        BT = chunks.index_select(0, P.idx_b[g][token_slot.long()].reshape(-1)).view(T, P.r, d_out)
        out[:, col:col + d_out] += torch.bmm(xa[:, g], BT).view(T, d_out)
        col += d_out


def torch_gather_mm(x, out, pool_l, P: Pool, seg_bounds, seg_slots):
    """Plain torch MBGMM: per segment, gather its adapter's rows once and matmul."""
    chunks = pool_l.view(-1, ALIGN)
    for (lo, hi), s in zip(seg_bounds, seg_slots):
        A = chunks.index_select(0, P.idx_a[s].reshape(-1)).view(P.G * P.r, P.d_in)
        xa = x[lo:hi] @ A.T
        col = 0
        for g, d_out in enumerate(P.out_dims):
            BT = chunks.index_select(0, P.idx_b[g][s].reshape(-1)).view(P.r, d_out)
            out[lo:hi, col:col + d_out] += xa[:, g * P.r:(g + 1) * P.r] @ BT
            col += d_out


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- MBGMV

def layers_for(bytes_per_layer, smoke):
    return 2 if smoke else int(min(512, max(2, -(-(256 << 20) // max(1, bytes_per_layer)))))


def _cuda_kernels(device):
    """slora.kernels.cuda (the csrc MBGMV through cupy) when it can run here, else None."""
    if device.type != "cuda":
        return None
    try:
        import cupy  # noqa: F401

        from slora.kernels import cuda as cuda_k
    except ImportError:
        return None
    return cuda_k


class Segmented:
    """The decode rows grouped by adapter (slora.kernels.segments) as a kernel module with
    MBGMV's two calls: MBGMM over the groups of `slots`, built before any timing."""

    def __init__(self, slots, device):
        self.tile = segments.decode_tile_rows(device)
        self.rows, self.seg_start, self.seg_slot, self.tiles = (
            torch.tensor(v, dtype=torch.int32, device=device)
            for v in segments.group_rows(slots.tolist(), self.tile))

    def _seg(self):
        return dict(seg_start=self.seg_start, seg_slot=self.seg_slot, tiles=self.tiles,
                    rows=self.rows, block_m=self.tile)

    def mbgmv_shrink(self, x, pool_l, pages, offa, ranks, slots, stride, r):
        return mbgmm.mbgmm_shrink(x, pool_l, pages, offa, ranks, stride=stride, max_rank=r,
                                  **self._seg())

    def mbgmv_expand(self, xa, y, pool_l, pages, offb, ranks, slots, out_dims, strides):
        mbgmm.mbgmm_expand(xa, y, pool_l, pages, offb, ranks, out_dims=out_dims,
                           strides=strides, **self._seg())


class VllmPeer:
    """vLLM's Triton LoRA kernels (`experiments/vllm_peer.py`) as a kernel module with MBGMV's
    two calls, over the same adapters copied into vLLM's layout (per module, A [n_a, r, d_in]
    and B [n_a, d_out, r], one copy a pool slice) and its metadata for `slots`, all built before
    any timing. Called as vLLM's LoRA layers call them: the shrink into a zeroed fp32 buffer
    [G, T, r] (scale 1: the adapters' scale is in B), the expand adding into y; the kernels'
    default tiles, the launch grid over vLLM's default active-LoRA count (max_loras + 1)."""

    def __init__(self, ops, P: Pool, slots, device):
        self.ops, self.r, self.G = ops, P.r, P.G
        n_a, T = P.pages.shape[0], slots.shape[0]
        self.weights = {}
        for l in range(P.pool.shape[0]):
            chunks = P.pool[l].view(-1, ALIGN)
            A = chunks.index_select(0, P.idx_a.reshape(-1)).view(n_a, P.G, P.r, P.d_in)
            B = [chunks.index_select(0, P.idx_b[g].reshape(-1)).view(n_a, P.r, d_out)
                 .transpose(1, 2).contiguous() for g, d_out in enumerate(P.out_dims)]
            self.weights[P.pool[l].data_ptr()] = (
                [A[:, g].contiguous() for g in range(P.G)], B)
        meta = ops.LoRAKernelMeta.make(max_loras=n_a, max_num_tokens=T, device=device)
        meta.prepare_tensors(slots)
        self.args = meta.meta_args(T, False)  # (holds every metadata tensor the kernels read)

    def mbgmv_shrink(self, x, pool_l, pages, offa, ranks, slots, stride, r):
        xa = torch.empty(self.G, x.shape[0], self.r, dtype=torch.float32, device=x.device)
        self.ops.lora_shrink(x, self.weights[pool_l.data_ptr()][0], xa, *self.args, 1.0)
        return xa

    def mbgmv_expand(self, xa, y, pool_l, pages, offb, ranks, slots, out_dims, strides):
        self.ops.lora_expand(xa, self.weights[pool_l.data_ptr()][1], y, *self.args,
                             offset_start=0, add_inputs=True)


def share_slots(T, n_a, gen):
    """Adapter rows of T tokens on n_a adapters, round-robin, in a random order."""
    return (torch.arange(T) % n_a)[torch.randperm(T, generator=gen)].to(torch.int32)


def run_mbgmv(T, r, cfg, device, dtype, gen, check=True, adapters=0):
    """T tokens on `adapters` adapters of rank r (0: every token its own), through MBGMV
    ("ours") and through the rows grouped by adapter ("seg"); the bytes count each distinct
    adapter once."""
    d, out_dims = cfg["hidden"], (cfg["hidden"],) * cfg["modules"]
    n_a = adapters or T
    est = n_a * r * (len(out_dims) * d + sum(out_dims)) * 2
    L = layers_for(est, cfg["smoke"])
    P = Pool(n_a, r, d, out_dims, cfg["page_size"], L, dtype, device, gen)
    slots = (share_slots(T, n_a, gen) if adapters else
             torch.randperm(T, generator=gen).to(torch.int32)).to(device)
    x = torch.randn(T, d, generator=gen).to(dtype).to(device)
    y = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(device)
    offa, offb = P.offsets[:, :, 0].contiguous(), P.offsets[:, :, 1].contiguous()

    def apply(k, l):  # one layer's shrink + expand through kernel module k
        xa = k.mbgmv_shrink(x, P.pool[l], P.pages, offa, P.ranks, slots, P.stride, r)
        k.mbgmv_expand(xa, y, P.pool[l], P.pages, offb, P.ranks, slots, out_dims, P.strides)

    def base():
        for l in range(L):
            torch_gather_bmm(x, y, P.pool[l], P, slots)

    # the Triton kernels (MBGMV, and MBGMM over the rows grouped by adapter), and the csrc
    # CUDA ones where cupy runs, each timed
    seg = Segmented(slots, device)
    impls = {"ours": mbgmv, "seg": seg}
    cuda_k = _cuda_kernels(device)
    if cuda_k is not None:
        impls["cuda"] = cuda_k
    if cfg.get("vllm") is not None:
        impls["vllm"] = VllmPeer(cfg["vllm"], P, slots, device)
    errs, extra = {}, {}
    if check:
        y0 = y.clone()
        xa_ref = ref.lora_shrink(x, P.pool[0], P.pages, offa, P.ranks, slots, P.stride, r)
        y_ref = y0.clone()
        ref.lora_expand(xa_ref, y_ref, P.pool[0], P.pages, offb, P.ranks, slots, out_dims,
                        P.strides)
        for name, k in impls.items():
            apply(k, 0)
            errs[f"err_{name}"] = rel_err(y - y0, y_ref - y0)
            y.copy_(y0)
        torch_gather_bmm(x, y, P.pool[0], P, slots)
        errs["err_torch"] = rel_err(y - y0, y_ref - y0)
        y.copy_(y0)
    t_ours = bench_graph(lambda: [apply(mbgmv, l) for l in range(L)], device) / L
    t_seg = bench_graph(lambda: [apply(seg, l) for l in range(L)], device) / L
    t_base = bench_graph(base, device) / L
    for name in ("cuda", "vllm"):
        if name in impls:
            k = impls[name]
            extra[f"us_{name}"] = bench_graph(lambda: [apply(k, l) for l in range(L)],
                                              device) / L * 1e3
    el = x.element_size()
    nbytes = x.numel() * el + P.adapter_bytes(n_a) + 2 * y.numel() * el
    flops = 2 * T * r * (len(out_dims) * d + sum(out_dims))
    # the table's split for adapters of this group on every layer of a Llama-2-7B shape
    by_adapter, rest = segments.split_rows(tuning.kind(device), "auto", slots.tolist(),
                                           [P.adapter_bytes(1) * MODEL_LAYERS] * n_a)
    extra["auto"] = ("mbgmv" if by_adapter is None else "segments" if rest is None
                     else "hybrid")
    for name in ("cuda", "vllm"):
        if f"us_{name}" in extra:
            extra[f"GBps_{name}"] = nbytes / extra[f"us_{name}"] / 1e3
    del P
    if device.type == "cuda":
        extra["GBps_copy_same"] = same_size_copy(nbytes, L, device)
    return dict(T=T, rank=r, adapters=n_a, layers=L, bytes=nbytes, flops=flops, **extra,
                us_ours=t_ours * 1e3, us_seg=t_seg * 1e3, us_torch=t_base * 1e3,
                GBps_ours=nbytes / t_ours / 1e6, GBps_seg=nbytes / t_seg / 1e6,
                GBps_torch=nbytes / t_base / 1e6, **errs)


def tune_mbgmv(cfg, device, dtype, gen):
    """Sweep shrink/expand tile configs at a few decode shapes; returns rows for the JSON."""
    rows = []
    orig_s, orig_e = mbgmv._mbgmv_shrink_cfg, mbgmv._mbgmv_expand_cfg
    # (CH 64: a 4096-wide d_in in one trip; BLOCK_R 16 / CHN 1: rank 16 in one trip)
    shrink_cfgs = [dict(BLOCK_R=br, CH=ch, num_warps=nw) for br in (1, 2, 4, 8)
                   for ch in (8, 16, 32, 64) for nw in (4, 8)]
    expand_cfgs = [dict(BLOCK_R=br, CHN=chn, num_warps=nw) for br in (2, 4, 8, 16, 32, 64)
                   for chn in (1, 2, 4, 8) for nw in (2, 4)]
    shapes = ([(2, 8)] if cfg["smoke"] else cfg["mbgmv_tune"] or
              [(16, 16), (32, 16), (64, 16), (64, 64), (256, 16), (256, 128)])
    d = cfg["hidden"]
    out_dims = (d,) * cfg["modules"]
    for T, r in shapes:
        P = Pool(T, r, d, out_dims, cfg["page_size"],
                 layers_for(T * r * 2 * len(out_dims) * d * 2, cfg["smoke"]), dtype, device, gen)
        L = P.pool.shape[0]
        slots = torch.randperm(T, generator=gen).to(torch.int32).to(device)
        x = torch.randn(T, d, generator=gen).to(dtype).to(device)
        y = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(device)
        xa = mbgmv.mbgmv_shrink(x, P.pool[0], P.pages, P.offsets[:, :, 0], P.ranks, slots,
                               P.stride, r)
        el = x.element_size()
        a_bytes = T * r * len(out_dims) * d * el + x.numel() * el
        b_bytes = T * r * sum(out_dims) * el + 2 * y.numel() * el
        for kind, cfgs, nbytes in (("shrink", shrink_cfgs, a_bytes),
                                   ("expand", expand_cfgs, b_bytes)):
            for c in (cfgs if not cfg["smoke"] else cfgs[:2]):
                mbgmv._mbgmv_shrink_cfg = (lambda *a, c=c: dict(c)) if kind == "shrink" else orig_s
                mbgmv._mbgmv_expand_cfg = (lambda *a, c=c: dict(c)) if kind == "expand" else orig_e

                def fn():
                    for l in range(L):
                        if kind == "shrink":
                            mbgmv.mbgmv_shrink(x, P.pool[l], P.pages, P.offsets[:, :, 0], P.ranks,
                                              slots, P.stride, r)
                        else:
                            mbgmv.mbgmv_expand(xa, y, P.pool[l], P.pages, P.offsets[:, :, 1],
                                              P.ranks, slots, out_dims, P.strides)
                try:
                    us = bench_graph(fn, device, warmup_ms=5, rep_ms=20) / L * 1e3
                except Exception as e:  # a config the compiler rejects (registers, shared memory)
                    print(f"  {kind} {c}: {type(e).__name__}", flush=True)
                    continue
                rows.append(dict(kind=kind, T=T, rank=r, **c, us=us, GBps=nbytes / us / 1e3))
            mbgmv._mbgmv_shrink_cfg, mbgmv._mbgmv_expand_cfg = orig_s, orig_e
            default = bench_graph(fn, device, warmup_ms=5, rep_ms=20) / L * 1e3  # (the defaults)
            top = sorted((w for w in rows if w["kind"] == kind and w["T"] == T and w["rank"] == r),
                         key=lambda w: w["us"])[:4]
            print(f"tune {kind:6s} T={T:3d} r={r:3d}: default {default:.2f} us "
                  f"({nbytes / default / 1e3:.0f} GB/s); best:", flush=True)
            for w in top:
                cfg_s = {k: v for k, v in w.items() if k not in ("kind", "T", "rank", "us", "GBps")}
                print(f"    {cfg_s} {w['us']:.2f} us {w['GBps']:.0f} GB/s", flush=True)
        del P
    return rows


# ----------------------------------------------------------------------------- MBGMM

def tune_mbgmm(cfg, device, dtype, gen):
    """Sweep MBGMM launch configs for shrink (d_in slices, warps) and expand (columns a program,
    warps, pipeline stages) at a few prefill shapes: `mbgmm_tune` (segments x tokens), one
    short prompt (as a graphed mixed step has) to many long ones. Each row also gives the
    launch's bytes (x and A; out read and written, and B) as a share of the copy ceiling."""
    rows = []
    orig = mbgmm._mbgmm_cfg
    d, out_dims = cfg["hidden"], (cfg["hidden"],) * 3
    # BLOCK_M is the work list's tile (tiles.tile_rows), not swept here
    smoke = cfg["smoke"]
    sweeps = {"shrink": [dict(split_k=k, num_warps=nw, num_stages=st) for k in (1, 2, 4, 8, 16)
                         for nw in (4, 8) for st in (2, 3, 4)]
              if not smoke else [dict(split_k=1, num_stages=1)],
              "expand": [dict(n_span=n, num_warps=nw, num_stages=st)
                         for n in (64, 128, 256, 512, 1024) for nw in (4, 8) for st in (2, 3)]
              if not smoke else [dict(n_span=128, num_stages=1)]}
    run_opts = ("split_k", "n_span")  # launch arguments; the rest are compile options
    for (n_seg, seg_len), r in ((s, r) for s in cfg["mbgmm_tune"] for r in cfg["mbgmm_tune_ranks"]):
        T = n_seg * seg_len
        P = Pool(n_seg, r, d, out_dims, cfg["page_size"], 2, dtype, device, gen)
        seg_start = torch.arange(0, T + 1, seg_len, dtype=torch.int32, device=device)
        seg_slot = torch.randperm(n_seg, generator=gen).to(torch.int32).to(device)
        x = torch.randn(T, d, generator=gen).to(dtype).to(device)
        y = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(device)
        offa, offb = P.offsets[:, :, 0], P.offsets[:, :, 1]
        tiles = work_tiles(seg_start, seg_slot, x)
        xa = mbgmm.mbgmm_shrink(x, P.pool[0], P.pages, offa, P.ranks, seg_start, seg_slot,
                               P.stride, r, tiles)
        el = x.element_size()
        a_bytes = n_seg * r * (d * 3 + sum(out_dims)) * el  # every adapter's A and B, once
        mb = {"shrink": (T * d * el + a_bytes / 2) / 1e6,
              "expand": (2 * T * sum(out_dims) * el + a_bytes / 2) / 1e6}
        for kind, cfgs in sweeps.items():
            for c in [None] + cfgs:  # None: the defaults
                c = c or {}
                run = {k: v for k, v in c.items() if k in run_opts}
                opts = {k: v for k, v in c.items() if k not in run_opts}
                mbgmm._mbgmm_cfg = lambda *a, o=opts, **kw: {**orig(*a, **kw), **o}

                def fn():
                    for l in range(2):
                        if kind == "shrink":
                            mbgmm.mbgmm_shrink(x, P.pool[l], P.pages, offa, P.ranks, seg_start,
                                              seg_slot, P.stride, r, tiles, **run)
                        else:
                            mbgmm.mbgmm_expand(xa, y, P.pool[l], P.pages, offb, P.ranks, seg_start,
                                              seg_slot, out_dims, P.strides, tiles, **run)
                try:
                    us = bench_graph(fn, device, warmup_ms=5, rep_ms=20) / 2 * 1e3
                except Exception as e:  # a config the compiler rejects, or an older tree's API
                    print(f"  mbgmm {kind} {c}: {type(e).__name__}", flush=True)
                    continue
                finally:
                    mbgmm._mbgmm_cfg = orig
                pct = 100 * mb[kind] / 1e3 / us / cfg["copy_GBps"] * 1e6 if us > 0 else 0.0
                rows.append(dict(kind="mbgmm_" + kind, segments=n_seg, seg_len=seg_len, rank=r,
                                 default=not c, **c, us=us, MB=mb[kind], pct_copy=pct))
            mine = [w for w in rows if w["kind"] == "mbgmm_" + kind and w["rank"] == r
                    and w["segments"] == n_seg and w["seg_len"] == seg_len]
            if not mine:
                continue
            top = sorted((w for w in mine if not w["default"]), key=lambda w: w["us"])[:3]
            dflt = [w for w in mine if w["default"]]
            head = f"default {dflt[0]['us']:.1f} us ({dflt[0]['pct_copy']:.0f}% of copy)" \
                if dflt else "default failed"
            print(f"tune mbgmm {kind} {n_seg} x {seg_len} r={r} ({mb[kind]:.1f} MB): {head}; "
                  "best: " + "; ".join(f"{ {k: w[k] for k in w if k in sweeps[kind][0]} } "
                                       f"{w['us']:.1f} us" for w in top), flush=True)
        del P
    return rows


def work_tiles(seg_start, seg_slot, x):
    """The prefill kernels' work list for segments `seg_start` (those with seg_slot >= 0 when
    given), built before timing: building it inside a captured graph would sync the host."""
    return tiles_mod.as_tiles(None, seg_start, tiles_mod.tile_rows(x.device, x.dtype), seg_slot)


def run_mbgmm(r, cfg, device, dtype, gen):
    d, out_dims = cfg["hidden"], (cfg["hidden"],) * 3
    n_seg, seg_len = cfg["segments"]
    T = n_seg * seg_len
    L = 2 if cfg["smoke"] else 4
    P = Pool(n_seg, r, d, out_dims, cfg["page_size"], L, dtype, device, gen)
    seg_start = torch.arange(0, T + 1, seg_len, dtype=torch.int32, device=device)
    seg_slot = torch.randperm(n_seg, generator=gen).to(torch.int32).to(device)
    bounds = [(i * seg_len, (i + 1) * seg_len) for i in range(n_seg)]
    slots_host = seg_slot.tolist()
    token_slot = torch.repeat_interleave(seg_slot, seg_len)
    x = torch.randn(T, d, generator=gen).to(dtype).to(device)
    y = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(device)
    offa, offb = P.offsets[:, :, 0], P.offsets[:, :, 1]
    tiles = work_tiles(seg_start, seg_slot, x)

    def ours_l(l):
        xa = mbgmm.mbgmm_shrink(x, P.pool[l], P.pages, offa, P.ranks, seg_start, seg_slot,
                               P.stride, r, tiles)
        mbgmm.mbgmm_expand(xa, y, P.pool[l], P.pages, offb, P.ranks, seg_start, seg_slot,
                          out_dims, P.strides, tiles)

    y0 = y.clone()
    y_ref = y0.clone()
    xa_ref = ref.lora_shrink(x, P.pool[0], P.pages, offa, P.ranks, token_slot, P.stride, r)
    ref.lora_expand(xa_ref, y_ref, P.pool[0], P.pages, offb, P.ranks, token_slot, out_dims,
                    P.strides)
    ours_l(0)
    err_ours = rel_err(y - y0, y_ref - y0)
    y.copy_(y0)
    torch_gather_mm(x, y, P.pool[0], P, bounds, slots_host)
    err_torch = rel_err(y - y0, y_ref - y0)
    y.copy_(y0)
    t_ours = bench_graph(lambda: [ours_l(l) for l in range(L)], device) / L
    t_base = bench_graph(lambda: [torch_gather_mm(x, y, P.pool[l], P, bounds, slots_host)
                                  for l in range(L)], device) / L
    flops = 2 * T * r * (3 * d + sum(out_dims))
    el = x.element_size()
    nbytes = x.numel() * el + P.adapter_bytes(n_seg) + 2 * y.numel() * el
    del P
    return dict(T=T, segments=n_seg, rank=r, flops=flops, bytes=nbytes,
                us_ours=t_ours * 1e3, us_torch=t_base * 1e3,
                TFLOPs_ours=flops / t_ours / 1e9, TFLOPs_torch=flops / t_base / 1e9,
                GBps_ours=nbytes / t_ours / 1e6, GBps_torch=nbytes / t_base / 1e6,
                err_ours=err_ours, err_torch=err_torch)


# ----------------------------------------------------------------------------- attention

def paged_kv(n_seq, n_tok, kvh, D, block_size, device, dtype, gen):
    """K/V views of a random pool and a random block table [n_seq, pages] of n_tok tokens each."""
    nb = -(-n_tok // block_size)
    num_pages = n_seq * nb + 8
    pool_l = torch.empty(num_pages, block_size * 2 * kvh * D, dtype=dtype, device=device)
    pool_l.normal_(0.0, 0.5)
    k, v = ref.kv_views(pool_l, block_size, kvh, D)
    tables = torch.randperm(num_pages, generator=gen)[:n_seq * nb].view(n_seq, nb)
    return k, v, tables.to(torch.int32).to(device)


def run_attention(B, ctx, H, kvh, D, cfg, device, dtype, gen):
    k, v, tables = paged_kv(B, ctx, kvh, D, cfg["block_size"], device, dtype, gen)
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, H, D, generator=gen).to(dtype).to(device)
    scale = D ** -0.5
    out = paged_decode_attention(q, k, v, tables, ctx_lens, scale)
    expect = ref.paged_decode_attention(q, k, v, tables, ctx_lens, scale)
    err = rel_err(out, expect)
    t = bench_graph(lambda: paged_decode_attention(q, k, v, tables, ctx_lens, scale), device)
    nbytes = 2 * B * ctx * kvh * D * q.element_size() + 2 * q.numel() * q.element_size()
    # A decode step's rotary + K/V store, then attention: two launches (fused.rope_write_kv
    # and the kernel above) against the one that folds them (rope_paged_decode_attention).
    qkv = torch.randn(B, (H + 2 * kvh) * D, generator=gen).to(dtype).to(device)
    pos = (ctx_lens - 1).long()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    last = (ctx - 1) // cfg["block_size"]
    slots = (tables[:, last].long() * cfg["block_size"] + (ctx - 1) % cfg["block_size"])

    def rope_attn(fold, qkv=qkv):  # (two launches rotate q in place: timed last)
        return rope_paged_decode_attention(qkv, pos, inv, k, v, slots, tables, ctx_lens, scale,
                                           H, kvh, fold=fold)

    one, two = (functools.partial(rope_attn, f) for f in (True, False))
    err_rope = rel_err(one(), two(qkv.clone()))
    t_one, t_two = bench_graph(one, device), bench_graph(two, device)
    return dict(B=B, ctx=ctx, H=H, kvh=kvh, D=D, us=t * 1e3, GBps=nbytes / t / 1e6, err=err,
                us_rope_two=t_two * 1e3, us_rope_one=t_one * 1e3, err_rope=err_rope)


def tune_attention(cfg, device, dtype, gen):
    """Sweep the decode kernel's tiles (`attention.decode_config`'s keys: keys a step, warps,
    stages) at one split, then splits 2 and 4 and a register cap (`maxnreg` 80 or 64: the
    default holds 96 a thread, 5 programs an SM; `compile_check.py`) for the best three per
    shape; decode shapes of a 7B (32 heads, MHA) at a server's contexts. Returns JSON rows."""
    import slora.kernels.attention as attention

    if cfg["smoke"]:
        shapes, (H, kvh, D) = [(2, 13)], (4, 2, 16)
        cfgs = [dict(BLOCK_N=16, num_warps=4, num_stages=1)]
    else:
        shapes, (H, kvh, D) = [(32, 272), (128, 272), (32, 1024), (256, 272)], (32, 32, 128)
        cfgs = [dict(BLOCK_N=n, num_warps=w, num_stages=st)
                for n in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3)]
    rows = []
    for B, ctx in shapes:
        k, v, tables = paged_kv(B, ctx, kvh, D, cfg["block_size"], device, dtype, gen)
        ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(B, H, D, generator=gen).to(dtype).to(device)
        expect = ref.paged_decode_attention(q, k, v, tables, ctx_lens, D ** -0.5)
        nbytes = 2 * B * ctx * kvh * D * q.element_size() + 2 * q.numel() * q.element_size()

        def run(c, splits):
            fn = lambda: attention.paged_decode_attention(q, k, v, tables, ctx_lens, D ** -0.5,
                                                          num_splits=splits, cfg=c)
            try:
                err = rel_err(fn(), expect)
                us = bench_graph(fn, device, warmup_ms=5, rep_ms=25) * 1e3
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                print(f"  attention {c} splits {splits}: {type(e).__name__}", flush=True)
                return None
            row = dict(B=B, ctx=ctx, splits=splits, **(c or {}), us=us, GBps=nbytes / us / 1e3, err=err)
            rows.append(row)
            return row

        default = run(None, None)
        found = [w for w in (run(c, 1) for c in cfgs) if w is not None]
        for w in sorted(found, key=lambda w: w["us"])[:3]:
            c = {key: w[key] for key in ("BLOCK_N", "num_warps", "num_stages")}
            found += [w for w in (run(c, sp) for sp in (2, 4)) if w is not None]
            if not cfg["smoke"]:  # (a compile option: the interpreter has none)
                found += [w for w in (run(dict(c, maxnreg=m), 1) for m in (80, 64))
                          if w is not None]
        print(f"tune attention B={B:3d} ctx={ctx:5d}: default {default['us']:.2f} us "
              f"({default['GBps']:.0f} GB/s); best:", flush=True)
        for w in sorted(found, key=lambda w: w["us"])[:5]:
            c = {key: w[key] for key in ("splits", "BLOCK_N", "num_warps", "num_stages",
                                         "maxnreg") if key in w}
            print(f"    {c} {w['us']:.2f} us {w['GBps']:.0f} GB/s err {w['err']:.1e}", flush=True)
    return rows


def tune_gemm(cfg, device, dtype, gen):
    """A decode step's base GEMMs at a 7B's shapes and batch 1-128: F.linear (cuBLAS) against
    the few-rows Triton kernel (slora.kernels.gemm) at each tile of a sweep, and at the tiles
    `skinny_cfg` picks. Each op runs over enough layers' distinct weights (>= 256 MB) that L2
    holds none of them, and reports the time per layer and the weight bytes' share of copy
    bandwidth. Returns JSON rows."""
    import torch.nn.functional as F

    from slora.kernels import gemm

    d = cfg["hidden"]
    inter = 11008 if not cfg["smoke"] else 2 * d
    shapes = {"qkv": (3 * d, d), "o": (d, d), "gate_up": (2 * inter, d), "down": (d, inter)}
    copy = cfg["copy_GBps"]  # (measured by main at the start of the run)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    # tiles x K slices: about 1, 2 or 4 programs an SM
    tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, programs=p * sms)
             for bn in (32, 64, 128) for bk in (128, 256) for nw in (4, 8) for ns in (3, 4)
             for p in (1, 2, 4) if nw == 4 or bn == 128]
    if cfg["smoke"]:
        tiles = [dict(BLOCK_N=16, BLOCK_K=32, programs=4)]
    rows = []
    for M in ((1, 16, 32, 64) if not cfg["smoke"] else (2,)):
        for name, (N, K) in shapes.items():
            nbytes = N * K * torch.tensor([], dtype=dtype).element_size()
            L = layers_for(nbytes, cfg["smoke"])
            ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(device) for _ in range(L)]
            x = torch.randn(M, K, generator=gen).to(dtype).to(device)
            want = F.linear(x.float(), ws[0].float())

            def timed(kind, fn, **extra):
                try:
                    err = rel_err(fn(ws[0]).float(), want)
                    us = bench_graph(lambda: [fn(w) for w in ws], device, warmup_ms=5, rep_ms=20) / L * 1e3
                except triton.runtime.errors.OutOfResources:  # (shared memory, at large tiles)
                    return None
                row = dict(M=M, module=name, kind=kind, us=us, GBps=nbytes / us / 1e3, err=err, **extra)
                rows.append(row)
                return row

            base = timed("cublas", lambda w: F.linear(x, w))
            pick = gemm.skinny_cfg(M, N, K, device)
            default = timed("triton", lambda w: gemm.skinny_linear(x, w, cfg=pick), tile=pick)
            best = default
            for t in tiles:
                t = dict(t, BLOCK_M=max(16 if device.type == "cuda" else 1,
                                        triton.next_power_of_2(M)))
                n_tiles = triton.cdiv(N, t["BLOCK_N"])
                t["SPLIT"] = max(1, min(t.pop("programs") // n_tiles, triton.cdiv(K, t["BLOCK_K"])))
                r = timed("triton-sweep", lambda w: gemm.skinny_linear(x, w, cfg=t), tile=t)
                if r is not None:
                    best = min(best, r, key=lambda r: r["us"])
            del ws
            pc = (lambda r: f"{100 * r['GBps'] / copy:4.0f}%") if copy == copy else (lambda r: "  - ")
            bt = best["tile"]
            print(f"tune gemm M={M:3d} {name:8s} cublas {base['us']:7.1f} us {pc(base)} | triton "
                  f"{default['us']:7.1f} us {pc(default)} | best {best['us']:7.1f} us {pc(best)} "
                  f"N{bt['BLOCK_N']} K{bt['BLOCK_K']} split{bt['SPLIT']} w{bt.get('num_warps')} s{bt.get('num_stages')}"
                  f" | err {default['err']:.1e}", flush=True)
    return rows


def run_overlap(cfg, device, dtype, gen):
    """Whether a step's prompt GEMMs can run beside its decode attention. Decode attention (B
    rows at context ctx) and a T-token chunk's base GEMMs (q|k|v, o, gate|up, down), each over
    L layers: alone, one after the other, and forked onto two streams and joined inside one
    graph, the one launched first on a high-priority stream. Then the decode rows' own chain
    (their GEMMs, attention after q|k|v, layer by layer) beside the chunk's GEMMs on the
    high-priority stream, the GEMMs through cuBLASLt with `carveouts` SMs left to the chain
    (`torch._C._set_sm_carveout_experimental`, where torch has it). `bytes_share`: the GEMMs'
    weight bytes at the copy rate over their time alone, the part of them that competes with
    attention for HBM bandwidth whatever the SMs do."""
    B, ctx, T, L = cfg["overlap"]
    h, H, bs = cfg["hidden"], cfg["mixed_heads"], cfg["block_size"]
    D, inter = h // H, h * 43 // 16  # (Llama-2-7B: 11,008)
    k, v, tables = paged_kv(B, ctx, H, D, bs, device, dtype, gen)  # (each layer's: 1.6 GB)
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, H, D, generator=gen).to(dtype).to(device)
    ws = [torch.randn(n, kk, generator=gen).to(dtype).to(device) * kk ** -0.5
          for n, kk in ((3 * h, h), (h, h), (2 * inter, h), (h, inter))]
    xs = {kk: torch.randn(T, kk, generator=gen).to(dtype).to(device) for kk in (h, inter)}
    xd = {kk: torch.randn(B, kk, generator=gen).to(dtype).to(device) for kk in (h, inter)}

    def attn():
        for _ in range(L):
            paged_decode_attention(q, k, v, tables, ctx_lens, D ** -0.5)

    def gemms():
        for _ in range(L):
            for w in ws:
                torch.matmul(xs[w.shape[1]], w.t())

    def chain():
        for _ in range(L):
            for i, w in enumerate(ws):
                torch.matmul(xd[w.shape[1]], w.t())
                if i == 0:
                    paged_decode_attention(q, k, v, tables, ctx_lens, D ** -0.5)

    def forked(side_fn, main_fn):
        if device.type != "cuda":
            return lambda: (side_fn(), main_fn())
        side = torch.cuda.Stream(device, priority=-1)

        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                side_fn()
            main_fn()
            torch.cuda.current_stream().wait_stream(side)
        return run

    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    carveouts = (0, 32, 66, 88) if device.type == "cuda" and carve is not None else ()

    def carved(n):
        def run():
            carve(n)
            try:
                gemms()
            finally:
                carve(None)
        return run

    ops = {"attention": attn, "gemms": gemms, "serial": lambda: (attn(), gemms()),
           "streams_gemms_first": forked(gemms, attn),
           "streams_attention_first": forked(attn, gemms),
           "chain": chain, "chain_serial": lambda: (chain(), gemms()),
           "chain_streams": forked(gemms, chain)}
    row = dict(B=B, ctx=ctx, T=T, layers=L, carveouts=list(carveouts))
    row.update({f"ms_{name}": bench_graph(fn, device) for name, fn in ops.items()})
    if carveouts:
        backend = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")  # (the SM-count target's path)
        try:
            for n in carveouts:
                row[f"ms_gemms_carve{n}"] = bench_graph(carved(n), device)
                row[f"ms_chain_streams_carve{n}"] = bench_graph(forked(carved(n), chain), device)
        finally:
            torch.backends.cuda.preferred_blas_library(backend)
    nbytes = sum(w.numel() * w.element_size() for w in ws) * L
    row["bytes_share"] = nbytes / cfg["copy_GBps"] / 1e6 / row["ms_gemms"]
    forks = [v for k_, v in row.items() if k_.startswith("ms_chain_streams")]
    row["hidden_share"] = (row["ms_chain_serial"] - min(forks)) / row["ms_gemms"]
    return row


def run_prefill_attention(n_seq, n_tok, H, kvh, D, cfg, device, dtype, gen):
    """Causal prefill of n_seq prompts of n_tok tokens (KV already written), vs the twin."""
    k, v, tables = paged_kv(n_seq, n_tok, kvh, D, cfg["block_size"], device, dtype, gen)
    q_start = list(range(0, n_seq * n_tok + 1, n_tok))
    ctx = [n_tok] * n_seq
    q_start_t = torch.tensor(q_start, dtype=torch.int32, device=device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = torch.randn(n_seq * n_tok, H, D, generator=gen).to(dtype).to(device)
    scale = D ** -0.5
    tiles = work_tiles(q_start_t, None, q)

    def ours():
        return paged_prefill_attention(q, k, v, tables, q_start_t, ctx_t, scale, tiles)

    def twin():
        return ref.paged_attention(q, k, v, tables, q_start, ctx, scale)

    err = rel_err(ours(), twin())
    t = bench_graph(ours, device)
    if device.type == "cuda":
        t_twin = triton.testing.do_bench(twin, warmup=10, rep=50, return_mode="median")
    else:
        t_twin = bench_graph(twin, device)
    flops = 4 * n_seq * H * D * n_tok * (n_tok + 1) / 2  # QK^T and PV over the causal half
    return dict(n_seq=n_seq, n_tok=n_tok, H=H, kvh=kvh, D=D, us=t * 1e3, us_twin=t_twin * 1e3,
                TFLOPs=flops / t / 1e9, err=err)


def run_mixed(n_dec, cfg, device, dtype, gen):
    """A mixed step's attention and q/k/v LoRA: n_dec decode rows (context `mixed_ctx`, each its
    own rank-16 adapter) beside one prompt of `mixed_prompt` tokens (its own adapter). Timed
    two ways, both in CUDA graphs (as a graphed mixed step would run them):
      "one": every row through the prefill kernels, decode rows as one-token segments (the
             engine's eager mixed step: one launch per kernel);
      "split": the decode rows through the decode kernels (paged decode attention, MBGMV), the
             prompt through the prefill ones (prefill attention, MBGMM).
    Both are checked against the same reference."""
    H = kvh = cfg["mixed_heads"]
    Dh, ctx, n_p, r = 128, cfg["mixed_ctx"], cfg["mixed_prompt"], 16
    d, out_dims = cfg["hidden"], (cfg["hidden"],) * 3
    scale = Dh ** -0.5
    k, v, tables = paged_kv(n_dec + 1, ctx, kvh, Dh, cfg["block_size"], device, dtype, gen)
    T = n_dec + n_p
    q = torch.randn(T, H, Dh, generator=gen).to(dtype).to(device)
    q_start = list(range(n_dec + 1)) + [T]
    ctx_l = [ctx] * n_dec + [n_p]
    q_start_t = torch.tensor(q_start, dtype=torch.int32, device=device)
    ctx_t = torch.tensor(ctx_l, dtype=torch.int32, device=device)
    p_start = torch.tensor([0, n_p], dtype=torch.int32, device=device)
    # the engine's split (slora.graphs): the decode kernel over every sequence's first row,
    # context 1 past the decode rows; the prefill kernel over the prompt's tiles alone
    dec_ctx = torch.tensor([ctx] * n_dec + [1], dtype=torch.int32, device=device)
    all_tiles = work_tiles(q_start_t, None, q)
    prompt = torch.tensor([-1] * n_dec + [0], dtype=torch.int32, device=device)
    prompt_tiles = work_tiles(q_start_t, prompt, q)

    def attn_one():
        return paged_prefill_attention(q, k, v, tables, q_start_t, ctx_t, scale, all_tiles)

    def attn_split():
        out = torch.empty_like(q)
        out[:n_dec + 1] = paged_decode_attention(q[:n_dec + 1], k, v, tables, dec_ctx, scale)
        return paged_prefill_attention(q, k, v, tables, q_start_t, ctx_t, scale, prompt_tiles,
                                       out=out)

    expect = ref.paged_attention(q, k, v, tables, q_start, ctx_l, scale)
    errs = {"err_attn_one": rel_err(attn_one(), expect), "err_attn_split": rel_err(attn_split(), expect)}

    P = Pool(n_dec + 1, r, d, out_dims, cfg["page_size"], 1, dtype, device, gen)
    slots = torch.randperm(n_dec + 1, generator=gen).to(torch.int32).to(device)
    token_slot = torch.cat([slots[:n_dec], slots[n_dec:].repeat(n_p)])
    x = torch.randn(T, d, generator=gen).to(dtype).to(device)
    y = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(device)
    offa, offb = P.offsets[:, :, 0].contiguous(), P.offsets[:, :, 1].contiguous()
    pool_l = P.pool[0]
    one_tiles, p_tiles = work_tiles(q_start_t, slots, x), work_tiles(p_start, slots[n_dec:], x)

    def lora_one():
        xa = mbgmm.mbgmm_shrink(x, pool_l, P.pages, offa, P.ranks, q_start_t, slots, P.stride, r,
                               one_tiles)
        mbgmm.mbgmm_expand(xa, y, pool_l, P.pages, offb, P.ranks, q_start_t, slots, out_dims,
                          P.strides, one_tiles)

    def lora_split():
        xa = mbgmv.mbgmv_shrink(x[:n_dec], pool_l, P.pages, offa, P.ranks, slots[:n_dec], P.stride, r)
        mbgmv.mbgmv_expand(xa, y[:n_dec], pool_l, P.pages, offb, P.ranks, slots[:n_dec], out_dims,
                          P.strides)
        xa = mbgmm.mbgmm_shrink(x[n_dec:], pool_l, P.pages, offa, P.ranks, p_start, slots[n_dec:],
                               P.stride, r, p_tiles)
        mbgmm.mbgmm_expand(xa, y[n_dec:], pool_l, P.pages, offb, P.ranks, p_start, slots[n_dec:],
                          out_dims, P.strides, p_tiles)

    y0 = y.clone()
    y_ref = y0.clone()
    xa_ref = ref.lora_shrink(x, pool_l, P.pages, offa, P.ranks, token_slot, P.stride, r)
    ref.lora_expand(xa_ref, y_ref, pool_l, P.pages, offb, P.ranks, token_slot, out_dims, P.strides)
    for name, fn in (("one", lora_one), ("split", lora_split)):
        y.copy_(y0)
        fn()
        errs[f"err_lora_{name}"] = rel_err(y - y0, y_ref - y0)
    y.copy_(y0)
    times = {f"us_{what}_{how}": bench_graph(fn, device) * 1e3
             for what, fns in (("attn", (attn_one, attn_split)), ("lora", (lora_one, lora_split)))
             for how, fn in zip(("one", "split"), fns)}
    del P
    return dict(n_dec=n_dec, ctx=ctx, prompt=n_p, heads=H, rank=r, **times, **errs)


# ----------------------------------------------------------------------------- main

EXPERT_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


def run_experts(cfg, device, dtype, gen) -> list[dict]:
    """One layer of experts (EXPERT_SHAPES: hidden, expert width, experts, picked), routing
    included, at each of cfg's batches: grouped GEMMs over the picked experts against every
    expert on every token, and up to `fused_rows` tokens the Triton backend's few-rows
    kernels (router GEMM included); ms per layer, and the picked experts' and every expert's
    weight bytes at copy."""
    fused = TritonBackend(gemm_max_rows=32) if device.type == "cuda" or cfg["smoke"] else None
    rows = []
    for name, (H, I, E, k) in EXPERT_SHAPES.items():
        if cfg["smoke"]:
            H, I, E = 64, 32, max(k, 4)
        router = (torch.randn(E, H, generator=gen) * 0.02).to(dtype).to(device)
        gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(dtype).to(device)
        down = (torch.randn(E, H, I, generator=gen) * 0.02).to(dtype).to(device)
        floor_ms = (gate_up.numel() + down.numel()) * gate_up.element_size() / (
            cfg["copy_GBps"] * 1e6)
        layer = Experts(router, gate_up, down)
        for T in cfg["batches"]:
            x = torch.randn(T, H, generator=gen).to(dtype).to(device)
            picked = ref.route(x, router, k, True)[1].unique().numel()
            row = dict(model=name, tokens=T, experts=E, picked=k, floor_ms=floor_ms,
                       picked_floor_ms=floor_ms * picked / E)
            out = {}
            forms = {"grouped": ref.experts_grouped, "dense": ref.experts_dense}
            if fused is not None and T <= cfg["fused_rows"]:
                forms["fused"] = None
            for form, run in forms.items():
                def fn(run=run, form=form):
                    if run is None:  # the engine's few-rows path: router GEMM, then the kernels
                        out[form] = fused.experts(x, layer, k, True, ref.Glu())
                        return
                    w, pick = ref.route(x, router, k, True)
                    out[form] = run(x, gate_up, down, w, pick, ref.silu_mul)
                row[f"ms_{form}"] = bench_graph(fn, device)
            row["err"] = max((out[f].float() - out["dense"].float()).abs().max().item()
                             for f in out)
            rows.append(row)
            print(f"experts {name} T={T:5d}: " + ", ".join(
                f"{f} {row[f'ms_{f}']:.3f} ms" for f in forms) + f"; the picked experts' "
                f"bytes at copy {row['picked_floor_ms']:.3f} ms, every expert's "
                f"{floor_ms:.3f} ms; max difference {row['err']:.1e}", flush=True)
        del router, gate_up, down
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_arg(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--tune", nargs="?", const="all",
                    choices=("all", "mbgmv", "mbgmm", "attention", "gemm"),
                    help="sweep tile configs first (all, or one of mbgmv / mbgmm / decode "
                         "attention / the decode GEMMs: cuBLAS against the few-rows Triton kernel)")
    ap.add_argument("--tune-only", action="store_true", help="stop after the tile sweep")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--only-mixed", action="store_true",
                    help="only the mixed-step comparison (decode rows through the prefill kernels "
                         "or through the decode kernels)")
    ap.add_argument("--only", choices=("mbgmv", "attention", "overlap", "experts"),
                    help="only the ceilings and one table: MBGMV (batch x rank), attention, "
                         "the overlap of decode attention and prompt GEMMs on two streams, or "
                         "a layer of experts, grouped against dense")
    ints = lambda t: tuple(int(v) for v in t.split(",") if v)  # noqa: E731
    ap.add_argument("--batches", type=ints, help="MBGMV: tokens (default: 1-256); with --tune "
                    "mbgmv also its shapes, each at every --ranks (default there: 16, 64)")
    ap.add_argument("--ranks", type=ints, help="MBGMV: ranks (default: 8-128)")
    ap.add_argument("--sharing", type=ints, default=(0,),
                    help="MBGMV: adapters the tokens share, a list (0: every token its own)")
    shapes = lambda t: tuple(tuple(int(v) for v in s.split("x")) for s in t.split(",") if s)  # noqa: E731
    ap.add_argument("--mbgmm-shapes", type=shapes,
                    help="--tune mbgmm: SEGMENTSxTOKENS shapes, a list (default: 1x256,4x216,8x512)")
    ap.add_argument("--mbgmm-ranks", type=ints, help="--tune mbgmm: ranks (default: 16,32,64)")
    ap.add_argument("--overlap-tokens", type=int,
                    help="--only overlap: the prompt chunk's tokens (default 256)")
    ap.add_argument("--vllm", metavar="DIR",
                    help="MBGMV: also time vLLM's Triton LoRA kernels, unpacked into DIR by "
                         "experiments/vllm_peer.py")
    ap.add_argument("--fused-rows", type=int, default=64,
                    help="experts: time the few-rows kernels up to this many tokens")
    ap.add_argument("--modules", type=int, default=3,
                    help="MBGMV: modules of the group, each hidden -> r -> hidden (3: q/k/v)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        cfg = dict(smoke=True, hidden=128, page_size=512, batches=(1, 3), ranks=(8, 20),
                   segments=(2, 5), mbgmm_ranks=(8,), mbgmm_tune=((2, 5),), mbgmm_tune_ranks=(8,), block_size=4,
                   attn=[(2, 13, 4, 2, 16)], prefill_attn=[(2, 9, 4, 2, 16)],
                   mixed=(3,), mixed_ctx=20, mixed_prompt=7, mixed_heads=2,
                   overlap=(3, 20, 7, 2))
    else:
        cfg = dict(smoke=False, hidden=4096, page_size=16 * 2 * 32 * 128,  # Llama-2-7B block 16
                   batches=(1, 16, 32, 64, 128, 256), ranks=(8, 16, 32, 64, 128),
                   segments=(8, 512), mbgmm_ranks=(16, 64), block_size=16,
                   mbgmm_tune=((1, 256), (4, 216), (8, 512)), mbgmm_tune_ranks=(16, 32, 64),
                   attn=[(32, 272, 32, 32, 128), (128, 272, 32, 32, 128),
                         (32, 1024, 32, 32, 128), (128, 1024, 32, 32, 128),
                         (8, 4096, 32, 32, 128), (64, 1024, 32, 8, 128), (1, 4096, 32, 8, 128)],
                   prefill_attn=[(8, 512, 32, 32, 128), (2, 2048, 32, 8, 128)],
                   mixed=(32, 128, 256), mixed_ctx=272, mixed_prompt=128, mixed_heads=32,
                   overlap=(250, 400, 256, 32))
    cfg["modules"] = args.modules
    cfg["fused_rows"] = args.fused_rows
    if args.overlap_tokens:
        B, ctx, _, L = cfg["overlap"]
        cfg["overlap"] = (B, ctx, args.overlap_tokens, L)
    # --tune mbgmv's shapes: --batches x --ranks where --batches is given
    cfg["mbgmv_tune"] = ([(T, r) for T in args.batches for r in args.ranks or (16, 64)]
                         if args.batches else None)
    cfg["batches"] = args.batches or cfg["batches"]
    cfg["ranks"] = args.ranks or cfg["ranks"]
    cfg["mbgmm_tune"] = args.mbgmm_shapes or cfg["mbgmm_tune"]
    cfg["mbgmm_tune_ranks"] = args.mbgmm_ranks or cfg["mbgmm_tune_ranks"]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    t_start = time.time()
    res = {**header(__file__, device, ceilings(device), argv),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
           "dtype": str(dtype), "torch": torch.__version__, "triton": triton.__version__,
           "config": {k: v for k, v in cfg.items()}}
    cfg["copy_GBps"] = res["ceilings"]["copy_GBps"]
    if args.vllm:
        from vllm_peer import load

        cfg["vllm"], res["vllm"] = load(args.vllm)
    print(f"ceilings: {res['ceilings']}", flush=True)
    if args.tune:
        sweeps = {"mbgmv": tune_mbgmv, "mbgmm": tune_mbgmm, "attention": tune_attention,
                  "gemm": tune_gemm}
        res["tune"] = [row for name, sweep in sweeps.items() if args.tune in ("all", name)
                       for row in sweep(cfg, device, dtype, gen)]
        if args.tune_only:
            write_result(args.out, "bench_kernels_tune.json", res)
            return res
    if args.only == "experts":
        res["experts"] = run_experts(cfg, device, dtype, gen)
        write_result(args.out, "bench_kernels_experts.json", res)
        return res
    if args.only == "overlap":
        res["overlap"] = run_overlap(cfg, device, dtype, gen)
        o = res["overlap"]
        print(f"decode attention ({o['B']} rows at context {o['ctx']}) and a {o['T']}-token "
              f"chunk's GEMMs, {o['layers']} layers, ms: " + ", ".join(
                  f"{k[3:]} {v:.2f}" for k, v in o.items() if k.startswith("ms_")))
        print(f"the chunk's GEMMs hidden beside the decode chain, best fork: "
              f"{o['hidden_share']:.1%}; their weight bytes at copy: {o['bytes_share']:.1%} "
              f"of their time")
        write_result(args.out, "bench_kernels_overlap.json", res)
        return res
    res["mixed"] = [] if args.only else [run_mixed(n, cfg, device, dtype, gen)
                                               for n in cfg["mixed"]]
    if res["mixed"]:
        print(f"mixed step: {cfg['mixed_prompt']}-token prompt beside n decode rows (context "
              f"{cfg['mixed_ctx']}), us per layer: attention / q,k,v LoRA (rank 16)")
        print(f"{'n':>5} {'attn one':>9} {'attn split':>11} {'lora one':>9} {'lora split':>11}  errors")
        for m in res["mixed"]:
            errs = " ".join(f"{m[k]:.1e}" for k in m if k.startswith("err_"))
            print(f"{m['n_dec']:5d} {m['us_attn_one']:9.1f} {m['us_attn_split']:11.1f} "
                  f"{m['us_lora_one']:9.1f} {m['us_lora_split']:11.1f}  {errs}", flush=True)
    if args.only_mixed:
        write_result(args.out, "bench_kernels_mixed.json", res)
        return res
    res["mbgmv"] = []
    for T in cfg["batches"] if args.only in (None, "mbgmv") else ():
        for r in cfg["ranks"]:
            for n in sorted({min(n, T) for n in args.sharing}, key=lambda n: n or T):
                row = run_mbgmv(T, r, cfg, device, dtype, gen, adapters=n)
                res["mbgmv"].append(row)
                print(f"mbgmv T={T:4d} r={r:4d} adapters={row['adapters']:4d}: {row['us_ours']:8.2f}"
                      f" us {row['GBps_ours']:7.0f} GB/s | seg {row['us_seg']:8.2f} us | torch "
                      f"{row['us_torch']:8.2f} us | err {row.get('err_ours', 0):.1e} / "
                      f"{row.get('err_seg', 0):.1e} / {row.get('err_torch', 0):.1e}", flush=True)
    res["mbgmm"] = [] if args.only else [run_mbgmm(r, cfg, device, dtype, gen)
                                               for r in cfg["mbgmm_ranks"]]
    if not args.skip_attention and args.only in (None, "attention"):
        res["attention"] = [run_attention(*a, cfg, device, dtype, gen) for a in cfg["attn"]]
        res["prefill_attention"] = [run_prefill_attention(*a, cfg, device, dtype, gen)
                                    for a in cfg["prefill_attn"]]
    res["seconds"] = time.time() - t_start

    name = "bench_kernels_smoke.json" if args.smoke else "bench_kernels.json"
    path = write_result(args.out, name, res)

    copy = res["ceilings"]["copy_GBps"]
    pct = (lambda g: f"{100 * g / copy:5.1f}%") if copy == copy else (lambda g: "   - ")
    print(f"\n{res['device']}, {dtype}; copy {copy:.0f} GB/s, bf16 GEMM "
          f"{res['ceilings']['gemm_bf16_TFLOPs']:.0f} TFLOP/s; results in {path}")
    if res["mbgmv"]:
        print(f"MBGMV {cfg['modules']} x ({cfg['hidden']} -> r -> {cfg['hidden']}), T tokens on "
              "`adapters` adapters, shrink + expand; seg: MBGMM over the rows grouped by "
              "adapter; auto: the path the table picks for adapters of these bytes on 32 layers")
        print("(%copy: of the 2 GiB copy's rate; %same: of a copy of the same bytes per layer, "
              "timed alike; bytes count each distinct adapter once)")
        print(f"{'T':>5} {'rank':>5} {'adapt':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} {'%same':>6} | "
              f"{'seg us':>8} {'%copy':>6} {'auto':>9} | {'torch us':>9} {'%copy':>6} | "
              f"{'speedup':>7}")
    for w in res["mbgmv"]:
        cu = "".join(f" | {label} {w[f'us_{name}']:8.2f} us {pct(w[f'GBps_{name}'])} err "
                     f"{w.get(f'err_{name}', float('nan')):.1e}"
                     for name, label in (("cuda", "csrc"), ("vllm", f"vLLM {res.get('vllm')}"))
                     if f"us_{name}" in w)
        same = (f"{100 * w['GBps_ours'] / w['GBps_copy_same']:5.1f}%" if "GBps_copy_same" in w
                else "    - ")
        print(f"{w['T']:5d} {w['rank']:5d} {w['adapters']:6d} {w['us_ours']:8.2f} "
              f"{w['GBps_ours']:7.0f} {pct(w['GBps_ours'])} {same} | {w['us_seg']:8.2f} "
              f"{pct(w['GBps_seg'])} {w['auto']:>9} | {w['us_torch']:9.2f} "
              f"{pct(w['GBps_torch'])} | {w['us_torch'] / w['us_ours']:6.2f}x{cu}")
    if res["mbgmm"]:
        print(f"MBGMM prefill {cfg['segments'][0]} x {cfg['segments'][1]} tokens, q/k/v group")
    for m in res["mbgmm"]:
        print(f"  rank {m['rank']:3d}: {m['us_ours']:8.1f} us {m['TFLOPs_ours']:6.1f} TFLOP/s "
              f"{m['GBps_ours']:6.0f} GB/s | torch {m['us_torch']:8.1f} us "
              f"{m['TFLOPs_torch']:6.1f} TFLOP/s | err {m['err_ours']:.1e}")
    for a in res.get("attention", []):
        print(f"decode attn B={a['B']:3d} ctx={a['ctx']:5d} H={a['H']} KVH={a['kvh']} D={a['D']}: "
              f"{a['us']:8.1f} us {a['GBps']:6.0f} GB/s {pct(a['GBps'])} err {a['err']:.1e}"
              f" | rotary + K/V store + attention: two launches {a['us_rope_two']:.1f} us, "
              f"one {a['us_rope_one']:.1f} us (err {a['err_rope']:.1e})")
    for a in res.get("prefill_attention", []):
        print(f"prefill attn {a['n_seq']} x {a['n_tok']} H={a['H']} KVH={a['kvh']} D={a['D']}: "
              f"{a['us']:8.1f} us {a['TFLOPs']:6.1f} TFLOP/s | twin {a['us_twin']:8.1f} us "
              f"| err {a['err']:.1e}")
    return res


if __name__ == "__main__":
    main()
