"""Fused Triton kernels (add + RMSNorm, rotary + KV write, SwiGLU) and the few-rows GEMM
(slora.kernels.gemm) against their torch twins (F.linear for the GEMM), interpreted on CPU
(fp32, fp16) and for real on CUDA (bf16 too; the GEMM at the engine's tiles)."""

import pytest
import torch
import torch.nn.functional as F

from slora.kernels import fused, gemm
from slora.kernels import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [64, 96])
@pytest.mark.parametrize("center", [False, True], ids=["rms", "layer"])
def test_add_rms_norm(dtype, N, center):
    # center: a LayerNorm without bias (Cohere's); rows off zero mean, so that it shows
    x, d, w = _rand(5, N, dtype=dtype) + 1, _rand(5, N, dtype=dtype), _rand(N, dtype=dtype)
    s_ref, y_ref = ref.add_rms_norm(x, d, w, 1e-6, center=center)
    s, y = fused.add_rms_norm(x, d, w, 1e-6, center=center)
    torch.testing.assert_close(s, s_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6, center=center),
                               ref.rms_norm(x, w, 1e-6, center=center),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    if center:  # the mean is off: not the RMSNorm of the same rows
        assert not torch.allclose(y.float(), ref.add_rms_norm(x, d, w, 1e-6)[1].float(),
                                  atol=0.05)


def _qk_case(mode, T, H, KVH, D, dtype):
    """(qkv, the `reference.QkNorm` of `mode`): head, one weight all heads share (Qwen3);
    heads, each head's own, centred (Cohere); all, a token's whole q and whole k (OLMo 2)."""
    qkv = _rand(T, (H + 2 * KVH) * D, dtype=dtype) + 0.5
    qw, kw = (_rand(D, dtype=dtype), _rand(D, dtype=dtype)) if mode == "head" else \
        (_rand(H * D, dtype=dtype), _rand(KVH * D, dtype=dtype))
    return qkv, ref.QkNorm(qw, kw, 1e-6, None if mode == "all" else D, mode == "heads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["head", "heads", "all"])
def test_qk_norm(dtype, mode):
    # 3 query heads of 40 and 1 KV head, so the groups' widths differ from their blocks and,
    # under "all", q's from k's
    T, H, KVH, D = 5, 3, 1, 40
    qkv, norm = _qk_case(mode, T, H, KVH, D, dtype)
    want = ref.qk_norm(qkv, H * D, KVH * D, norm)
    got = fused.qk_norm(qkv.clone(), H * D, KVH * D, norm)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    assert torch.equal(got[:, -KVH * D:], qkv[:, -KVH * D:])  # v untouched
    if mode != "head":  # each group is its own: the whole-q norm differs from the per-head one
        other = norm._replace(head_dim=D if mode == "all" else None)
        assert not torch.allclose(got.float(), ref.qk_norm(qkv, H * D, KVH * D, other).float(),
                                  atol=0.05)


@pytest.mark.parametrize("tb", [1, 16], ids=["token", "token-block"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(4, 2, 16), (3, 1, 40), (2, 2, 8)])
def test_rope_write_kv(dtype, H, KVH, D, tb, monkeypatch):
    # a program a token (decode batches), or a block of 16 tokens (here 7: one partial block)
    monkeypatch.setattr(fused, "rope_config",
                        lambda T, device: dict(TB=tb, num_warps=1 if tb == 1 else 4))
    T, bs, pages = 7, 4, 6
    qkv = _rand(T, (H + 2 * KVH) * D, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 9, 33, 100, 4], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    slots = torch.randperm(pages * bs, device=DEVICE)[:T]
    pool_ref = torch.full((pages, 2 * bs * KVH * D), float("nan"), device=DEVICE).to(dtype)
    pool = pool_ref.clone()
    q_ref = ref.rope_write_kv(qkv.clone(), positions, inv_freq,
                              *ref.kv_views(pool_ref, bs, KVH, D), slots, H, KVH)
    q = fused.rope_write_kv(qkv.clone(), positions, inv_freq, *ref.kv_views(pool, bs, KVH, D),
                            slots, H, KVH)
    tol = TOL[dtype] * 10
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol, equal_nan=True)  # untouched stay NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [48, 1500])
@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
def test_act_mul(dtype, N, act):
    gu = _rand(3, 2 * N, dtype=dtype) * 3  # gelu's tails (|x| > 3) and its middle
    torch.testing.assert_close(getattr(fused, act)(gu), getattr(ref, act)(gu),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_rows_are_added_as_the_expand_adds_them(dtype):
    """`lora`: a layer's LoRA rows that an expand added into zeros (each rounded to the
    dtype). The residual add and the GLUs given them equal, bit for bit, the same kernels
    given the output the expand would have made by adding them in place."""
    N = 96
    x, out, w = _rand(5, N, dtype=dtype), _rand(5, N, dtype=dtype), _rand(N, dtype=dtype)
    delta = torch.randn(5, N, device=DEVICE) * 0.3
    delta[2] = 0.0  # a row without an adapter
    lora = delta.to(dtype)  # what the expand leaves in zeros
    added = (out.float() + delta.to(dtype).float()).to(dtype)  # what it leaves in out
    for a, b in zip(fused.add_rms_norm(x, out, w, 1e-6, lora=lora),
                    fused.add_rms_norm(x, added, w, 1e-6)):
        assert torch.equal(a, b)
    gu = _rand(5, 2 * N, dtype=dtype)
    delta2 = (torch.randn(5, 2 * N, device=DEVICE) * 0.3).to(dtype)
    added2 = (gu.float() + delta2.float()).to(dtype)
    for act in ("silu_mul", "gelu_tanh_mul"):
        assert torch.equal(getattr(fused, act)(gu, lora=delta2), getattr(fused, act)(added2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["head", "all"])
def test_qk_norm_adds_the_lora_rows(dtype, mode):
    """qkv's LoRA rows handed over unadded give, bit for bit, the normed q and k and the v of
    qkv with the rows added as the expand adds them."""
    T, H, KVH, D = 5, 4, 2, 16
    qkv, norm = _qk_case(mode, T, H, KVH, D, dtype)
    lora = (torch.randn(qkv.shape, device=DEVICE) * 0.5).to(dtype)
    lora[3] = 0.0  # a row without an adapter
    added = (qkv.float() + lora.float()).to(dtype)
    got = fused.qk_norm(qkv.clone(), H * D, KVH * D, norm, lora=lora)
    assert torch.equal(got, fused.qk_norm(added.clone(), H * D, KVH * D, norm))
    assert torch.equal(got[:, -KVH * D:], added[:, -KVH * D:])


@pytest.mark.parametrize("tb", [1, 16], ids=["token", "token-block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_adds_the_lora_rows(dtype, tb, monkeypatch):
    """qkv's LoRA rows handed over unadded give, bit for bit, the rotated q heads and the
    stored K and V of qkv with the rows added as the expand adds them."""
    monkeypatch.setattr(fused, "rope_config",
                        lambda T, device: dict(TB=tb, num_warps=1 if tb == 1 else 4))
    T, bs, pages, H, KVH, D = 7, 4, 6, 4, 2, 16
    qkv = _rand(T, (H + 2 * KVH) * D, dtype=dtype)
    lora = (torch.randn(qkv.shape, device=DEVICE) * 0.5).to(dtype)
    lora[3] = 0.0  # a row without an adapter
    added = (qkv.float() + lora.float()).to(dtype)
    positions = torch.tensor([0, 1, 2, 9, 33, 100, 4], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    slots = torch.randperm(pages * bs, device=DEVICE)[:T]
    pools = [torch.full((pages, 2 * bs * KVH * D), float("nan"), device=DEVICE).to(dtype)
             for _ in range(2)]
    q = fused.rope_write_kv(qkv, positions, inv_freq, *ref.kv_views(pools[0], bs, KVH, D), slots,
                            H, KVH, lora=lora)
    q_added = fused.rope_write_kv(added, positions, inv_freq, *ref.kv_views(pools[1], bs, KVH, D),
                                  slots, H, KVH)
    assert torch.equal(q, q_added)
    torch.testing.assert_close(pools[0], pools[1], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 64, 128), (5, 96, 200), (16, 130, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(dtype, M, N, K, bias):
    # x a row slice of a wider tensor (row stride > K), N and K not multiples of the tiles
    x = _rand(M, K + 24, dtype=dtype)[:, 8:K + 8]
    w = _rand(N, K, dtype=dtype) / K ** 0.5
    b = _rand(N, dtype=dtype) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemm.skinny_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    tol = max(TOL[dtype], 1e-4)  # (fp32: sums of up to 200 products)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT=1),
                                 dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=64, SPLIT=1),
                                 dict(BLOCK_M=8, BLOCK_N=16, BLOCK_K=16, SPLIT=3),
                                 dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT=9)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_tiles(cfg, bias):
    # the benchmark's sweep passes tiles; masks cover N and K tails at each. Split launches
    # sum K slices through the last slice to finish (SPLIT=9 over 100 columns of 32: 4 slices
    # hold any); three launches in a row check each leaves its tile counters at zero.
    x, w = _rand(7, 100, dtype=torch.float32), _rand(50, 100, dtype=torch.float32)
    b = _rand(50, dtype=torch.float32) if bias else None
    if DEVICE == "cuda":
        cfg = dict(cfg, BLOCK_M=max(16, cfg["BLOCK_M"]))
    for _ in range(3):
        torch.testing.assert_close(gemm.skinny_linear(x, w, b, cfg=cfg), F.linear(x, w, b),
                                   atol=1e-4, rtol=1e-4)
    assert not gemm.prepare(x.device).any()


def test_skinny_linear_rejects_rows_past_its_tile():
    x, w = _rand(20, 32, dtype=torch.float32), _rand(16, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="20 rows do not fit BLOCK_M=16"):
        gemm.skinny_linear(x, w, cfg=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32))


def test_linear_dispatch():
    # off CUDA, or past max_rows, or fp32: F.linear itself (bit-identical)
    x, w = _rand(3, 32, dtype=torch.float32), _rand(8, 32, dtype=torch.float32)
    assert torch.equal(gemm.linear(x, w, max_rows=32), F.linear(x, w))
    if DEVICE == "cuda":
        x, w = _rand(32, 256, dtype=torch.bfloat16), _rand(512, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(gemm.linear(x, w, max_rows=32).float(), F.linear(x.float(), w.float()),
                                   atol=3e-2, rtol=3e-2)
        # the engine's tiles with K split (4,096 columns over 16 tiles of W's rows)
        x, w = _rand(32, 4096, dtype=torch.bfloat16), _rand(1024, 4096, dtype=torch.bfloat16) / 64
        assert gemm.skinny_cfg(32, 1024, 4096, x.device)["SPLIT"] > 1
        torch.testing.assert_close(gemm.linear(x, w, max_rows=32).float(), F.linear(x.float(), w.float()),
                                   atol=3e-2, rtol=3e-2)
        assert torch.equal(gemm.linear(x, w, max_rows=0), F.linear(x, w))  # cuBLAS always
        x = _rand(33, 4096, dtype=torch.bfloat16)
        assert torch.equal(gemm.linear(x, w, max_rows=32), F.linear(x, w))
