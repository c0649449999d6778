"""Fused Triton kernels (add + RMSNorm, rotary + KV write, SwiGLU) against their torch twins,
interpreted on CPU (fp32, fp16) and for real on CUDA (bf16 too)."""

import pytest
import torch

from slora.kernels import fused
from slora.kernels import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [64, 96])
def test_add_rms_norm(dtype, N):
    x, d, w = _rand(5, N, dtype=dtype), _rand(5, N, dtype=dtype), _rand(N, dtype=dtype)
    s_ref, y_ref = ref.add_rms_norm(x, d, w, 1e-6)
    s, y = fused.add_rms_norm(x, d, w, 1e-6)
    torch.testing.assert_close(s, s_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(4, 2, 16), (3, 1, 40), (2, 2, 8)])
def test_rope_write_kv(dtype, H, KVH, D):
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
def test_silu_mul(dtype, N):
    gu = _rand(3, 2 * N, dtype=dtype)
    torch.testing.assert_close(fused.silu_mul(gu), ref.silu_mul(gu), atol=TOL[dtype] * 4,
                               rtol=TOL[dtype] * 4)
