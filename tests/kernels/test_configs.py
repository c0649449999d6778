"""The kernels' tile tables (slora/kernels/configs/*.json) against the if-ladders they replace.

The `ladder_*` functions below are those rules, pinned: the H200 table, and the generic one
(any other CUDA GPU, at any SM count), must give exactly their choices over a sweep of decode
and prefill shapes, and the interpreter table their CPU choices. A kernel's launch takes its
config function's dict as keyword arguments, so equal dicts mean equal launches."""

import itertools
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from slora.kernels import attention, fused, gemm, mbgmm, mbgmv, tiles, tuning  # noqa: E402


def cdiv(a, b):
    return -(-a // b)


def pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- the ladders

def ladder_mbgmv_shrink(T, G, max_rank, d_in, cuda):
    if not cuda:
        return dict(BLOCK_R=min(16, pow2(max_rank)), CH=min(8, pow2(cdiv(d_in, 64))))
    block_r = 4
    while block_r > 1 and T * G * cdiv(max_rank, block_r) < 512:
        block_r //= 2
    block_r = min(block_r, pow2(max_rank))
    ch = min(32, pow2(cdiv(d_in, 64)))
    return dict(BLOCK_R=block_r, CH=ch, num_warps=4 if block_r > 1 else 8)


def ladder_mbgmv_expand(T, G, max_rank, max_out, cuda, table):
    chn = min(8, pow2(cdiv(max_out, 64)))
    if not cuda:
        return dict(BLOCK_R=min(16, pow2(max_rank)), CHN=min(4, chn))
    if table == "generic" and T * G < 16:  # few rows: every rank (or 32) a trip, 64 columns
        wide = T * G < 8
        return dict(BLOCK_R=min(64 if wide else 32, pow2(max_rank)), CHN=1,
                    num_warps=4 if wide else 2)
    if T * G < 128 or (G == 1 and T * cdiv(max_out, chn * 64) < 4096):
        return dict(BLOCK_R=min(4, pow2(max_rank)), CHN=min(4, chn), num_warps=4)
    return dict(BLOCK_R=min(2, pow2(max_rank)), CHN=chn, num_warps=4)


def ladder_tile_rows(cuda, dtype):
    if not cuda:
        return 16
    return 32 if dtype == torch.float32 else 64


def ladder_mbgmm(max_rank, cuda, dtype, shrink):
    block_m = ladder_tile_rows(cuda, dtype)
    block_r = max(16 if cuda else 1, min(64, pow2(max_rank)) if shrink else pow2(max_rank))
    if not cuda:
        return dict(BLOCK_M=block_m, BLOCK_R=block_r, num_warps=4, num_stages=1)
    if shrink:
        return dict(BLOCK_M=block_m, BLOCK_R=block_r, num_warps=8, num_stages=3)
    return dict(BLOCK_M=block_m, BLOCK_R=max(64, block_r), num_warps=4, num_stages=2,
                maxnreg=128)


def ladder_decode(D, cuda, table):
    if not cuda:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if D <= 128 and table == "generic":
        return dict(BLOCK_N=32, num_warps=2, num_stages=2)
    return dict(BLOCK_N=64 if D <= 128 else 32, num_warps=4, num_stages=2)


def ladder_splits(B, kvh, max_ctx, block_n, cuda, n_sm):
    if not cuda:
        return 1
    want = cdiv(2 * n_sm, B * kvh)
    return int(max(1, min(want, max_ctx // (2 * block_n), 64)))


def ladder_prefill(D, dtype, cuda):
    f32 = dtype == torch.float32
    return dict(BLOCK_N=(32 if f32 or D > 128 else 64) if cuda else 16, num_warps=4,
                num_stages=2 if cuda else 1)


def ladder_gemm(M, N, K, cuda, n_sm):
    if not cuda:
        return dict(BLOCK_M=pow2(M), BLOCK_N=min(64, pow2(N)), BLOCK_K=min(128, pow2(K)),
                    SPLIT=1)
    split = max(1, min(n_sm // cdiv(N, 64), cdiv(K, 128)))
    return dict(BLOCK_M=max(16, pow2(M)), BLOCK_N=64, BLOCK_K=128, SPLIT=split, num_warps=4,
                num_stages=3 if split == 1 else 4)


def ladder_rope(T):
    tb = 16 if T >= 512 else 1
    return dict(TB=tb, num_warps=1 if tb == 1 else 4)


# ----------------------------------------------------------------------------- the sweep

TOKENS = (1, 2, 3, 5, 16, 31, 32, 33, 42, 64, 100, 127, 128, 129, 170, 256, 511, 512, 1024,
          4096, 8192)
RANKS = (1, 2, 3, 4, 5, 8, 12, 16, 20, 32, 33, 64, 80, 128, 256)
WIDTHS = (32, 64, 96, 128, 1000, 1024, 4096, 5120, 11008, 14336)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (table, device type, SM count): the H200 (132 SMs), other GPUs, the interpreter
KINDS = [("h200", "cuda", 132), ("generic", "cuda", 132), ("generic", "cuda", 108),
         ("generic", "cuda", 78), ("interpreter", "cpu", 1)]


@pytest.fixture(params=KINDS, ids=lambda k: f"{k[0]}-{k[2]}sm")
def device(request, monkeypatch):
    table, dev_type, n_sm = request.param
    monkeypatch.setattr(tuning, "kind", lambda device: table)
    monkeypatch.setattr(tuning, "sms", lambda device: n_sm)
    dev = torch.device(dev_type, 0) if dev_type == "cuda" else torch.device("cpu")
    return types.SimpleNamespace(device=dev, cuda=dev_type == "cuda", n_sm=n_sm, table=table)


def test_mbgmv_tiles(device):
    for T, G, r, d in itertools.product(TOKENS, (1, 2, 3, 4), RANKS, WIDTHS):
        assert mbgmv._mbgmv_shrink_cfg(T, G, r, d, device.device) == \
            ladder_mbgmv_shrink(T, G, r, d, device.cuda), (T, G, r, d)
        assert mbgmv._mbgmv_expand_cfg(T, G, r, d, device.device) == \
            ladder_mbgmv_expand(T, G, r, d, device.cuda, device.table), (T, G, r, d)


def test_mbgmm_and_prefill_tiles(device):
    for r, dtype, shrink in itertools.product(RANKS, DTYPES, (True, False)):
        x = types.SimpleNamespace(device=device.device, dtype=dtype)
        assert mbgmm._mbgmm_cfg(r, x, shrink) == ladder_mbgmm(r, device.cuda, dtype, shrink)
    for dtype in DTYPES:
        assert tiles.tile_rows(device.device, dtype) == ladder_tile_rows(device.cuda, dtype)
        for D in (32, 64, 80, 96, 128, 160, 256):
            assert attention.prefill_config(D, dtype, device.device) == \
                ladder_prefill(D, dtype, device.cuda)


def test_decode_attention_choices(device):
    for D in (32, 64, 80, 96, 128, 160, 256):
        assert attention.decode_config(D, device.device) == ladder_decode(D, device.cuda, device.table)
    for B, kvh, ctx, bn in itertools.product((1, 2, 8, 32, 64, 128, 256), (1, 4, 8, 32),
                                             (16, 128, 1024, 4096, 32768), (16, 32, 64)):
        assert attention._default_splits(B, kvh, ctx, bn, device.device) == \
            ladder_splits(B, kvh, ctx, bn, device.cuda, device.n_sm), (B, kvh, ctx, bn)
    for programs in (1, 64, 255, 256, 300, 511, 512, 528, 529, 1024, 4096):
        assert attention.fold_rope(programs, device.device), programs  # every table: always


def test_gemm_and_rope_tiles(device):
    for M, N, K in itertools.product((1, 2, 3, 8, 16, 17, 31, 32, 33, 64), WIDTHS + (12288, 32000),
                                     (32, 64, 96, 128, 4096, 11008)):
        assert gemm.skinny_cfg(M, N, K, device.device) == \
            ladder_gemm(M, N, K, device.cuda, device.n_sm), (M, N, K)
    for T in TOKENS:
        assert fused.rope_config(T, device.device) == ladder_rope(T)


def test_every_table_holds_every_kernel_and_ends_with_a_rule_that_always_holds():
    names = {"h200", "generic", "interpreter"}
    kernels = set(tuning.table("h200"))
    for name in names:
        t = tuning.table(name)
        assert set(t) == kernels, name
        for kernel, rules in t.items():
            assert rules and "when" not in rules[-1], (name, kernel)
            for rule in rules:
                assert set(rule) <= {"when", "cfg"}, (name, kernel)
                assert all(len(b) == 2 for b in rule.get("when", {}).values()), (name, kernel)


def test_a_device_names_its_table(monkeypatch):
    for name, table in [("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"),
                        ("NVIDIA A100-SXM4-80GB", "generic"), ("NVIDIA H100 80GB HBM3", "generic")]:
        tuning._gpu_kind.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index, n=name: n)
        assert tuning.kind(torch.device("cuda", 0)) == table, name
    tuning._gpu_kind.cache_clear()
    assert tuning.kind(torch.device("cpu")) == "interpreter"


def test_a_rule_testing_an_unknown_quantity_is_an_error(monkeypatch):
    bad = {"k": [{"when": {"nope": [0, 1]}, "cfg": {}}, {"cfg": {}}]}
    monkeypatch.setattr(tuning, "table", lambda name: bad)
    with pytest.raises(KeyError, match="nope"):
        tuning.choose("x", "k", rows=3)
