"""FP8-weight kernels against their twins (`quant.linear`: the weight dequantized, then F.linear):
the few-rows GEMM reading E4M3 weights and their scales, the per-row activation quantizer, the
`_scaled_mm` path and `fp8.linear`'s choice among them; and an FP8 engine on CUDA (graphs and
async scheduling on) against the same engine on the twins. The kernels run under the Triton
interpreter on CPU where it can run them (fp32), for real on a GPU; the rest needs CUDA."""

import pytest
import torch

from slora.model import quant
from slora.model.quant import quantize_fp8

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def weight(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes: their scales differ
    w = torch.randn(N, K, generator=g) * (1 + torch.rand(N, 1, generator=g) * 4)
    return quantize_fp8(w * 0.05).to(torch.device(DEV))


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("M,N,K", [(1, 20, 40), (3, 64, 96), (5, 33, 132), (2, 16, 300)])
@pytest.mark.parametrize("unpack", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_gemm_reads_fp8_weights(M, N, K, unpack, bias):
    """fp32 x (the interpreter's path on CPU; the DOT_F32 variant on a GPU), W read as 32-bit
    words and unpacked (`UNPACK`) or converted tile by tile: equal to the twin to fp32
    rounding, K and N not multiples of the tiles, K split in slices."""
    from slora.kernels import gemm

    w = weight(N, K)
    x = torch.randn(M, K, device=DEV)
    b = torch.randn(N, device=DEV) if bias else None
    cfg = dict(gemm.skinny_cfg(M, N, K, x.device, 1), UNPACK=unpack)
    if K == 300:  # three K slices, the last one short
        cfg.update(BLOCK_K=64, SPLIT=3)
    got = gemm.skinny_linear(x, w.weight, b, cfg=cfg, scale=w.scale)
    torch.testing.assert_close(got, quant.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,N,K", [(1, 20, 40), (5, 33, 132), (2, 16, 300), (32, 64, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_gemm_w8a8(M, N, K, bias):
    """An FP8 x with its row scales (`quantize_rows_ref`) against the FP8 W: the twin over the
    dequantized x to fp32 rounding (on a GPU, to its FP8 tensor cores' accumulation), in the
    output dtype asked for, K and N not multiples of the tiles, K split in slices."""
    from slora.kernels import fp8, gemm

    w = weight(N, K)
    x = torch.randn(M, K, device=DEV) * torch.logspace(-2, 1, M, device=DEV)[:, None]
    xq, xs = fp8.quantize_rows_ref(x)
    b = torch.randn(N, device=DEV) if bias else None
    cfg = dict(gemm.skinny_cfg(M, N, K, x.device, 1), UNPACK=True)  # (no words for an FP8 x)
    if K == 300:
        cfg.update(BLOCK_K=64, SPLIT=3)
    got = gemm.skinny_linear(xq, w.weight, b, cfg=cfg, scale=w.scale, x_scale=xs,
                             out_dtype=torch.float32)
    want = quant.linear(xq.float() * xs, w, b)
    # (a GPU's FP8 tensor cores keep fewer bits of the running sum than fp32: the tolerance
    # of the `_scaled_mm` path's test there)
    tol = dict(rtol=1e-2, atol=1e-2 * want.abs().max().item()) if DEV == "cuda" else \
        dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, **tol)


def every_e4m3(N, K):
    """An FP8 weight [N, K] (N * K >= 256) holding each finite E4M3 value (zeros, subnormals,
    normals, both signs) once, the rest zeros, scale 1."""
    bits = torch.arange(256, dtype=torch.int32)
    bits = torch.where((bits & 0x7F) == 0x7F, 0, bits)  # the two NaNs -> 0
    flat = torch.zeros(N * K, dtype=torch.uint8)
    flat[:256] = bits.to(torch.uint8)
    return quant.Fp8Weight(flat.view(N, K).view(quant.FP8_DTYPE).to(DEV),
                           torch.ones(N, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_few_rows_gemm_unpacks_every_e4m3_value_exactly(dtype):
    """x = the identity picks W's columns one at a time: the output is W itself, bit for bit
    (every E4M3 value is exact in fp16 and bf16), so the unpacking by bit operations gives each
    of the 254 finite values, subnormals included, exactly. Both cfg paths; the default one on
    this device unpacks."""
    from slora.kernels import gemm

    w = every_e4m3(16, 16)
    x = torch.eye(16, device=DEV, dtype=dtype)
    want = w.weight.float().t()
    assert gemm.skinny_cfg(16, 16, 16, x.device, 1).get("UNPACK")
    for unpack in (True, False):
        cfg = dict(gemm.skinny_cfg(16, 16, 16, x.device, 1), UNPACK=unpack)
        got = gemm.skinny_linear(x, w.weight, cfg=cfg, scale=w.scale)
        assert torch.equal(got.float(), want), unpack


def test_few_rows_gemm_unpacks_words_only():
    """`words`: the 32-bit view needs K, the row stride and the address in multiples of 4
    bytes; a 16-bit weight is never unpacked."""
    from slora.kernels import gemm

    w = weight(8, 64).weight
    assert gemm.words(w)
    assert not gemm.words(weight(8, 66).weight)  # K
    assert not gemm.words(w[:, 2:62])  # address
    assert not gemm.words(torch.zeros(8, 64, dtype=torch.bfloat16))


def test_a_gemm_rule_may_ask_for_more_programs_per_sm(monkeypatch):
    """`programs_per_sm` in a rule cuts K for that many programs an SM (the H200's o: 64 output
    tiles, 2 slices at one program per SM, 4 at two); it is the grid's, not a kernel argument."""
    from slora.kernels import gemm, tuning

    rule = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, UNPACK=True)
    try:
        for per_sm, slices in ((1, 2), (2, 4)):
            fake = dict(tuning.table("h200"), gemm=[{"cfg": dict(rule, programs_per_sm=per_sm)}])
            monkeypatch.setattr(tuning, "table", lambda name, fake=fake: fake)
            gemm._skinny_cfg.cache_clear()
            cfg = gemm._skinny_cfg("h200", True, 132, 32, 4096, 4096, 1)
            assert cfg == dict(rule, BLOCK_M=32, SPLIT=slices)
    finally:
        gemm._skinny_cfg.cache_clear()  # (no choice made from the fake tables outlives it)


FUSED_CALLS = {
    "rms_norm": lambda f, x, w, feeds: f.rms_norm(x, w, 1e-6, feeds=feeds),
    "add_rms_norm": lambda f, x, w, feeds: f.add_rms_norm(x, x * 0.5, w, 1e-6, feeds=feeds)[1],
    "silu_mul": lambda f, x, w, feeds: f.silu_mul(x, feeds=feeds),
    "gelu_tanh_mul": lambda f, x, w, feeds: f.gelu_tanh_mul(x, feeds=feeds),
}


@pytest.mark.parametrize("kernel", list(FUSED_CALLS))
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("N", [72, 2200])
def test_norms_and_glus_round_what_they_feed_as_quantize_rows(kernel, dtype, N, monkeypatch):
    """A norm or GLU whose output feeds a GEMM that rounds its input (`fp8.quantizes`) returns
    that output with its E4M3 rounding, equal to `quantize_rows` of it (an all-zero row, a
    graph's padding, to zeros); one feeding any other GEMM returns the plain tensor. (GLU
    rows of 2,200 span three column blocks unrounded, one tile rounded.)"""
    from slora.kernels import fp8, fused

    x = (torch.randn(6, N, device=DEV) * torch.logspace(-2, 1, 6, device=DEV)[:, None]).to(dtype)
    x[2] = 0
    w = torch.rand(N // 2 if "mul" in kernel else N, device=DEV).to(dtype) + 0.5
    plain = FUSED_CALLS[kernel](fused, x, w, None)
    assert isinstance(FUSED_CALLS[kernel](fused, x, w, torch.empty(8, 8)), torch.Tensor)
    monkeypatch.setattr(fp8, "quantizes", lambda x, w: w == "fp8")  # (on CPU too)
    got = FUSED_CALLS[kernel](fused, x, w, "fp8")
    assert isinstance(got, quant.Fp8Rows) and torch.equal(got.x, plain)
    q, scale = fp8.quantize_rows(plain)
    assert torch.equal(got.scale, scale) and torch.equal(got.q.float(), q.float())
    assert got.q[2].float().eq(0).all()


@pytest.mark.parametrize("M,K", [(3, 40), (4, 1030), (2, 5000)])
def test_quantize_rows_whole_row_and_two_passes_round_alike(M, K):
    """The quantizer's two forms (the row held whole, or walked in 1,024-column blocks twice)
    give the same scales and E4M3 values: the same maximum and the same divisions."""
    from slora.kernels import fp8

    x = (torch.randn(M, K) * torch.logspace(-3, 2, M)[:, None]).to(torch.bfloat16).to(DEV)
    x[0] = 0
    whole = fp8.quantize_rows(x)
    blocks = fp8.empty_rows(M, K, x.device)
    fp8._quantize_rows_kernel[(M,)](x, *blocks, K, x.stride(0), blocks[0].stride(0),
                                    **fp8.ROUNDING, BLOCK_K=1024, WHOLE=False, PDL=False)
    assert torch.equal(whole[1], blocks[1])
    assert torch.equal(whole[0].float(), blocks[0].float())


# ----------------------------------------------------------------------------- CUDA only
# (the interpreter's float32 -> E4M3 conversion rounds ties away from zero and flushes
# subnormals, so the quantizer is tested on a GPU alone)

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 40), (4, 130), (3, 1024), (64, 11008), (2, 40000)])
def test_quantize_rows_matches_its_twin(dtype, M, K):
    from slora.kernels import fp8

    x = torch.randn(M, K, device="cuda") * torch.logspace(-3, 2, M, device="cuda")[:, None]
    x = x.to(dtype)
    x[0, :] = 0  # an all-zero row (a graph's padding) quantizes to zeros
    q, s = fp8.quantize_rows(x)
    qr, sr = fp8.quantize_rows_ref(x)
    assert torch.equal(s, sr)  # (both divisions IEEE-rounded: the same E4M3 values)
    assert torch.equal(q.float(), qr.float())
    assert q[0].float().eq(0).all() and q.float().abs().amax(dim=1)[1:].eq(448).all()


SHAPES = [(64, 128), (200, 72), (4096, 4096), (256, 4096), (4096, 11008)]  # (N, K): ragged, split K


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", SHAPES)
def test_few_rows_gemm_fp8_sweep(dtype, N, K):
    """16-bit x, M 1..64, with and without bias, W unpacked from words (the default) and
    converted: the fp32 twin rounded once to x's dtype."""
    from slora.kernels import gemm

    w = weight(N, K)
    for M in (1, 2, 7, 16, 31, 32, 33, 64):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        for b in (None, torch.randn(N, device="cuda", dtype=dtype)):
            want = quant.linear(x.float(), w, None if b is None else b.float())
            for unpack in (True, False):
                cfg = dict(gemm.skinny_cfg(M, N, K, x.device, 1), UNPACK=unpack)
                got = gemm.skinny_linear(x, w.weight, b, cfg=cfg, scale=w.scale)
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                           atol=1e-2 * want.abs().max().item())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_few_rows_gemm_unpacks_every_e4m3_value_exactly_on_the_gpu(dtype):
    """The GPU's 16-bit paths (bf16's exponent bias differs from fp16's): W itself, bit for
    bit, through the identity."""
    from slora.kernels import gemm

    w = every_e4m3(64, 64)
    x = torch.eye(64, device="cuda", dtype=dtype)
    for unpack in (True, False):
        cfg = dict(gemm.skinny_cfg(64, 64, 64, x.device, 1), UNPACK=unpack)
        got = gemm.skinny_linear(x, w.weight, cfg=cfg, scale=w.scale)
        assert torch.equal(got.float(), w.weight.float().t()), unpack


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(64, 128), (4096, 4096), (12288, 4096), (4096, 11008)])
def test_scaled_mm_path(dtype, N, K):
    """16-bit x, M 1..64 and prefill sizes, with and without bias: the twin over x's per-row
    FP8 round trip (the same products) to bf16 rounding; the plain twin to E4M3's precision."""
    from slora.kernels import fp8

    w = weight(N, K)
    for M in (1, 5, 16, 33, 64, 300, 2048):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        for b in (None, torch.randn(N, device="cuda", dtype=dtype)):
            got = fp8.scaled_mm_linear(x, w, b)
            xq, xs = fp8.quantize_rows_ref(x)
            bf = None if b is None else b.float()
            want = quant.linear(xq.float() * xs, w, bf)
            assert got.dtype == dtype and got.shape == (M, N)
            torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                       atol=1e-2 * want.abs().max().item())
            assert rel_err(got, quant.linear(x.float(), w, bf)) < 0.04  # (E4M3 rounding: ~0.026)


@cuda
def test_fp8_linear_dispatch():
    """fp8.linear: the few-rows kernel over x quantized per row up to max_rows of a 16-bit x,
    `_scaled_mm` past them (dims multiples of 16), the twin otherwise; a tensor weight goes
    to gemm.linear. `quantizes` says where an x is rounded, and a rounding x carries is used."""
    from slora.kernels import fp8, gemm

    w, odd = weight(256, 512), weight(200, 72)
    x = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize_rows(x[:32])
    assert torch.equal(fp8.linear(x[:32], w, max_rows=32),
                       gemm.skinny_linear(xq, w.weight, scale=w.scale, x_scale=xs,
                                          out_dtype=x.dtype))
    assert torch.equal(fp8.linear(x, w, max_rows=32), fp8.scaled_mm_linear(x, w))
    assert torch.equal(fp8.linear(x.half(), w, max_rows=32), fp8.scaled_mm_linear(x.half(), w))
    xo = torch.randn(48, 72, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp8.linear(xo, odd, max_rows=32), quant.linear(xo, odd))
    xf = x.float()
    assert torch.equal(fp8.linear(xf, w, max_rows=32), quant.linear(xf, w))
    dense = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp8.linear(x, dense, max_rows=32), gemm.linear(x, dense, max_rows=32))
    # an x that carries its rounding (quant.Fp8Rows, as the norms write it) is not rounded
    # again: both paths take the rounding it carries
    assert fp8.quantizes(x, w) and not any(fp8.quantizes(a, b) for a, b in
                                           ((xo, odd), (xf, w), (x, dense)))
    for rows in (x[:32], x):
        carried = quant.Fp8Rows(rows, *fp8.quantize_rows(rows))
        assert torch.equal(fp8.linear(carried, w, max_rows=32), fp8.linear(rows, w, max_rows=32))
        blank = carried._replace(q=torch.zeros_like(carried.q))
        assert not fp8.linear(blank, w, max_rows=32).any()


@pytest.mark.parametrize("path", ["few rows", "scaled_mm"])
def test_fp8_linear_takes_the_rounding_x_carries(monkeypatch, path):
    """Each GPU path of fp8.linear, forced on any device, gets the E4M3 values and row scales an
    `Fp8Rows` x carries (not a rounding of its 16-bit rows) and returns in the rows' dtype."""
    from slora.kernels import fp8, gemm

    w = weight(32, 64)
    x = torch.randn(4, 64, device=DEV)
    q, scale = fp8.quantize_rows_ref(x)
    carried = quant.Fp8Rows(x, torch.zeros_like(q), scale)  # zeros: not x's rounding
    got = []
    if path == "few rows":
        monkeypatch.setattr(gemm, "uses_kernel", lambda *a: True)
        monkeypatch.setattr(gemm, "skinny_linear", lambda xq, *a, x_scale, **k: got.append(
            (xq, x_scale)) or torch.zeros(4, 32, dtype=k["out_dtype"]))
    else:
        monkeypatch.setattr(fp8, "uses_scaled_mm", lambda *a: True)
        monkeypatch.setattr(fp8, "scaled_mm_linear", lambda x, w, b, quantize: got.append(
            quantize(x)) or torch.zeros(4, 32, dtype=x.dtype))
    assert fp8.linear(carried, w, max_rows=8).dtype == x.dtype
    (xq, xs), = got
    assert xq is carried.q and xs is carried.scale


PROMPTS = torch.randint(3, 250, (40, 12), generator=torch.Generator().manual_seed(0)).tolist()


def engine_run(model_dir, **cfg) -> dict:
    """An fp16 FP8 engine's first token of each of PROMPTS with the top log-prob, then 16
    greedy tokens each, all 40 in one batch."""
    from slora import Engine, EngineConfig, SamplingParams

    e = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float16", num_pages=256,
                            quantization="fp8", **cfg))
    first = e.generate(PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=3))
    out = dict(first=[o.token_ids[0] for o in first],
               top=[max(o.logprobs[0].values()) for o in first],
               tokens=[o.token_ids for o in e.generate(
                   PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))])
    e.close()
    return out


def agreement(a: dict, b: dict) -> tuple[int, float, float]:
    """(first tokens equal, mean |top log-prob difference|, the share of greedy tokens before
    each sequence's first difference)."""
    same = sum(x == y for x, y in zip(a["first"], b["first"]))
    diff = sum(abs(x - y) for x, y in zip(a["top"], b["top"])) / len(a["top"])
    prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
                 for x, y in zip(a["tokens"], b["tokens"]))
    return same, diff, prefix / sum(len(x) for x in a["tokens"])


def assert_moves_as_far(plain: dict, rounded: dict, ours: dict) -> float:
    """That `ours` lies as near the plain twin's run as the twin with the activations' rounding
    does (first tokens and top log-probs); returns that twin's mean log-prob distance."""
    (same, diff, _), (ref_same, ref_diff, _) = agreement(plain, ours), agreement(plain, rounded)
    assert ref_diff > 0.01  # (the rounding is there to compare with)
    assert diff <= 1.5 * ref_diff + 0.02 and same >= ref_same - 6, (same, diff, ref_same, ref_diff)
    return ref_diff


GRAPHED = dict(backend="triton", cuda_graphs=True, async_scheduling=True)


def w8a8_twin(x, w, bias=None):
    """The twin of the GPU's FP8 GEMMs: a 16-bit x rounded per row to E4M3
    (`quantize_rows_ref`), then `quant.linear`."""
    from slora.kernels import fp8

    if isinstance(w, quant.Fp8Weight) and x.dtype in (torch.float16, torch.bfloat16):
        xq, xs = fp8.quantize_rows_ref(x)
        x = (xq.float() * xs).to(x.dtype)
    return quant.linear(x, w, bias)


@pytest.fixture(scope="module")
def twins(tiny_models):
    """The torch backend's runs over the FP8 weights: plain (`quant.linear`) and with the
    activations' rounding (`w8a8_twin`)."""
    from slora.kernels import backend

    model_dir = tiny_models("llama_headdim_linear")  # q/k/v and o biases
    plain = engine_run(model_dir, backend="torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend.TorchBackend, "linear", staticmethod(w8a8_twin))
        rounded = engine_run(model_dir, backend="torch")
    return model_dir, plain, rounded


@cuda
def test_fp8_engine_on_the_few_rows_kernel_agrees_with_the_twins(twins):
    """Every base GEMM of every step (prefill chunks of at most 64 tokens, decode rows) through
    the few-rows W8A8 kernel, with CUDA graphs and async scheduling. Rounding the activations
    to E4M3 moves this tiny random model's top log-probs by about a tenth of a nat from the
    plain twin; the engine moves as far from it, and lies nearer the twin with the same
    rounding than the plain twin does (they still differ: an fp16 difference upstream moves
    an activation across an E4M3 boundary). A wrong scale or layout moves them by nats."""
    model_dir, plain, rounded = twins
    ours = engine_run(model_dir, gemm_max_rows=64, max_batch_tokens=64, **GRAPHED)
    ref_diff = assert_moves_as_far(plain, rounded, ours)
    twin_diff = agreement(rounded, ours)[1]
    assert twin_diff < ref_diff, (twin_diff, ref_diff)


@cuda
def test_fp8_engine_moves_as_far_as_its_activation_rounding(twins):
    """Prefill (480 rows) and decode of 40 rows through `_scaled_mm`, with CUDA graphs and async
    scheduling. Rounding the activations to E4M3 moves this tiny random model's top log-probs
    by about a tenth of a nat from the plain twin and flips some first tokens; the twin with
    the same rounding moves them as far. A wrong scale or layout moves them by nats."""
    model_dir, plain, rounded = twins
    assert_moves_as_far(plain, rounded, engine_run(model_dir, **GRAPHED))
