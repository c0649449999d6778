"""Paged decode attention (Triton) against its torch twin (reference.paged_decode_attention).

Without CUDA the kernel runs under the Triton interpreter on small shapes; with CUDA the same
tests run on the GPU (bf16 included). K/V live in the pool's strided views (kv_views), pages
are shuffled, and every cache row no sequence owns holds NaN, so a kernel that reads past a
sequence's length, or into another sequence's page, fails loudly.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from slora.kernels import reference as ref  # noqa: E402
from slora.kernels.attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    rope_paged_decode_attention,
)
from slora.kernels.fused import rope_write_kv  # noqa: E402
from slora.kernels.tiles import tile_rows, token_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_cache(ctx_lens, block_size, kvh, D, dtype, gen, extra_pages=3):
    """A pool slice with each sequence's K/V in shuffled pages; NaN everywhere else."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_pages = sum(need) + extra_pages
    P = block_size * 2 * kvh * D
    pool_l = torch.full((num_pages, P), float("nan"), dtype=dtype)
    k_cache, v_cache = ref.kv_views(pool_l, block_size, kvh, D)
    perm = torch.randperm(num_pages, generator=gen)
    max_blocks = max(need) + 2
    # Slack entries point at real pages: reading one shows up as NaN, not as a crash.
    tables = perm[torch.randint(num_pages, (len(ctx_lens), max_blocks), generator=gen)]
    used = 0
    for s, c in enumerate(ctx_lens):
        tables[s, :need[s]] = perm[used:used + need[s]]
        used += need[s]
        for i in range(c):
            page, row = tables[s, i // block_size], i % block_size
            k_cache[page, row] = torch.randn(kvh, D, generator=gen).to(dtype)
            v_cache[page, row] = torch.randn(kvh, D, generator=gen).to(dtype)
    pool_l = pool_l.to(DEVICE)
    k_cache, v_cache = ref.kv_views(pool_l, block_size, kvh, D)
    return k_cache, v_cache, tables.to(torch.int32).to(DEVICE)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# (H, KVH, D): GQA 4:1, MHA, a group of 3 (non-power-of-two, padded), head_dim 80 (masked).
SHAPES = [(8, 2, 16), (4, 4, 32), (3, 1, 16), (4, 2, 80)]


@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H%d-KV%d-D%d" % s)
def test_decode_attention_matches_twin(shape, dtype, num_splits):
    H, kvh, D = shape
    block_size = 8
    # Lengths cross page boundaries: 1 token, exactly one page, one past, many pages.
    ctx_lens = [1, 8, 9, 29, 40]
    gen = torch.Generator().manual_seed(H * 100 + D + (num_splits or 0))
    k_cache, v_cache, tables = make_cache(ctx_lens, block_size, kvh, D, dtype, gen)
    assert not k_cache.is_contiguous()  # the strided pool view, used as is
    q = torch.randn(len(ctx_lens), H, D, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    scale = D ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    expect = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    assert rel_err(out, expect) < (1e-5 if dtype == torch.float32 else 1e-2)


def _rope_case(shape, dtype, seed):
    """A decode batch's new tokens for rotary + K/V store + attention: (qkv, the args after
    qkv that `rope_paged_decode_attention` takes up to its heads, the pool slice behind the
    cache, block_size)."""
    H, kvh, D = shape
    block_size = 8
    ctx_lens = [1, 8, 9, 29, 40]  # each sequence's new token sits at position ctx - 1
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(ctx_lens, block_size, kvh, D, dtype, gen)
    pool = k_cache.as_strided((k_cache.shape[0], 2 * block_size * kvh * D), (k_cache.stride(0), 1))
    tables_cpu = tables.cpu().long()
    slots = torch.tensor([int(tables_cpu[s, (c - 1) // block_size]) * block_size
                          + (c - 1) % block_size for s, c in enumerate(ctx_lens)], device=DEVICE)
    positions = torch.tensor([c - 1 + 3 * s for s, c in enumerate(ctx_lens)], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    qkv = torch.randn(len(ctx_lens), (H + 2 * kvh) * D, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    args = (positions, inv_freq, k_cache, v_cache, slots, tables, ctx, D ** -0.5)
    return qkv, args, pool, block_size


@pytest.mark.parametrize("fold", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H%d-KV%d-D%d" % s)
def test_rope_decode_attention_matches_twins(shape, dtype, num_splits, fold):
    """Rotary + K/V store + decode attention, in one launch and in two, against the twins run
    in turn (reference.rope_write_kv, then reference.paged_decode_attention): the output, and
    the cache with the new tokens' K and V at their slots (every other row untouched)."""
    H, kvh, D = shape
    qkv, args, pool, block_size = _rope_case(shape, dtype, H * 100 + D + 7 * (num_splits or 0))
    positions, inv_freq, _, _, slots, tables, ctx, scale = args

    pool_ref = pool.clone()
    kc_ref, vc_ref = ref.kv_views(pool_ref, block_size, kvh, D)
    q_ref = ref.rope_write_kv(qkv.clone(), positions, inv_freq, kc_ref, vc_ref, slots, H, kvh)
    expect = ref.paged_decode_attention(q_ref, kc_ref, vc_ref, tables, ctx, scale)

    before = qkv.clone()
    out = rope_paged_decode_attention(qkv, *args, H, kvh, num_splits=num_splits, fold=fold)
    assert torch.equal(qkv, before) or not fold  # one launch rotates q in registers
    assert out.shape == (len(ctx), H, D) and out.dtype == dtype
    assert not torch.isnan(out).any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, expect) < tol
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("fold", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_decode_attention_adds_the_lora_rows(dtype, num_splits, fold):
    """qkv's LoRA rows handed over unadded (`lora`, as an expand leaves them in zeros) give,
    bit for bit, the output, cache and q heads of qkv with the rows added as the expand adds
    them, in one launch and in two."""
    shape = (4, 2, 16)
    H, kvh, D = shape
    qkv, args, pool, block_size = _rope_case(shape, dtype, 11 + (num_splits or 0))
    lora = (torch.randn(qkv.shape, device=DEVICE) * 0.5).to(dtype)
    lora[1] = 0.0  # a row without an adapter
    added = (qkv.float() + lora.float()).to(dtype)
    pool_added = pool.clone()
    out = rope_paged_decode_attention(qkv, *args, H, kvh, num_splits=num_splits, fold=fold,
                                      lora=lora)
    args_added = args[:2] + ref.kv_views(pool_added, block_size, kvh, D) + args[4:]
    expect = rope_paged_decode_attention(added, *args_added, H, kvh, num_splits=num_splits,
                                         fold=fold)
    assert torch.equal(out, expect)
    torch.testing.assert_close(pool, pool_added, atol=0, rtol=0, equal_nan=True)
    if not fold:  # two launches: q's heads rotated in place, from the sum
        assert torch.equal(qkv[:, :H * D], added[:, :H * D])


@pytest.mark.parametrize("fold", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 2, 16), (3, 1, 40)], ids=lambda s: "H%d-KV%d-D%d" % s)
@pytest.mark.parametrize("own", [False, True], ids=["shared", "own"])
def test_rope_decode_attention_norms_q_and_k(shape, dtype, num_splits, fold, own):
    """Qwen3's q and k norms (one weight all heads share: folded into the decode kernel in
    one launch) and Cohere's (a weight of each head's own, centred: in their own launch
    first), with qkv's LoRA rows handed over unadded: the twins in turn (reference.qk_norm of
    qkv + the rows, rope_write_kv, paged_decode_attention) give the output and the cache."""
    H, kvh, D = shape
    qkv, args, pool, block_size = _rope_case(shape, dtype, 5 + D + (num_splits or 0))
    positions, inv_freq, _, _, slots, tables, ctx, scale = args
    lora = (torch.randn(qkv.shape, device=DEVICE) * 0.5).to(dtype)
    lora[1] = 0.0  # a row without an adapter
    weight = lambda n: (torch.rand(n, device=DEVICE) + 0.5).to(dtype)  # noqa: E731
    norm = ref.QkNorm(weight(H * D), weight(kvh * D), 1e-6, D, True) if own else \
        ref.QkNorm(weight(D), weight(D), 1e-6, D)
    added = (qkv.float() + lora.float()).to(dtype)
    pool_ref = pool.clone()
    kc_ref, vc_ref = ref.kv_views(pool_ref, block_size, kvh, D)
    normed = ref.qk_norm(added, H * D, kvh * D, norm)
    q_ref = ref.rope_write_kv(normed, positions, inv_freq, kc_ref, vc_ref, slots, H, kvh)
    expect = ref.paged_decode_attention(q_ref, kc_ref, vc_ref, tables, ctx, scale)
    out = rope_paged_decode_attention(qkv, *args, H, kvh, num_splits=num_splits, fold=fold,
                                      lora=lora, norm=norm)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, expect) < tol
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol, equal_nan=True)
    # the norms matter here: without them the output is another
    plain = ref.rope_write_kv(added.clone(), positions, inv_freq,
                              *ref.kv_views(pool.clone(), block_size, kvh, D), slots, H, kvh)
    assert rel_err(ref.paged_decode_attention(plain, kc_ref, vc_ref, tables, ctx, scale),
                   expect) > 0.01


def test_decode_attention_long_context_splits_agree():
    """Split-K and one pass give the same answer over a context of many pages."""
    gen = torch.Generator().manual_seed(5)
    ctx_lens = [150, 3]
    k_cache, v_cache, tables = make_cache(ctx_lens, 16, 2, 32, torch.float32, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    one = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, num_splits=1)
    many = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, num_splits=4)
    expect = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2)
    assert rel_err(one, expect) < 1e-5 and rel_err(many, expect) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 2, 16), (4, 4, 32), (3, 1, 16)],
                         ids=lambda s: "H%d-KV%d-D%d" % s)
def test_prefill_attention_matches_twin(shape, dtype):
    """A mixed batch: whole prompts, a decode row, chunked prefill over a cached prefix,
    a prompt longer than one query tile; causal within each sequence."""
    H, kvh, D = shape
    n_new = [5, 1, 7, 17, 3]
    ctx_lens = [5, 9, 20, 17, 40]
    gen = torch.Generator().manual_seed(H * 10 + D)
    k_cache, v_cache, tables = make_cache(ctx_lens, 8, kvh, D, dtype, gen)
    q_start = [0]
    for n in n_new:
        q_start.append(q_start[-1] + n)
    q = torch.randn(q_start[-1], H, D, generator=gen).to(dtype).to(DEVICE)
    scale = D ** -0.5
    q_start_t = torch.tensor(q_start, dtype=torch.int32, device=DEVICE)
    ctx_t = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, q_start_t, ctx_t, scale)
    expect = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    # two programs taking the tiles in turn (as a graph's bounded grid does): the same rows
    tiles = torch.tensor(token_tiles(q_start, tile_rows(q.device, dtype)), dtype=torch.int32,
                         device=DEVICE)
    assert int(tiles[0]) > 2
    turns = paged_prefill_attention(q, k_cache, v_cache, tables, q_start_t, ctx_t, scale, tiles,
                                    programs=2)
    assert torch.equal(turns, out)
    assert rel_err(out, expect) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_prefill_attention_skips_empty_segments_and_keeps_out():
    """A graphed mixed step's split (slora.graphs): decode rows 0..d-1 get the decode kernel,
    the prefill kernel's work list holds the prompts' tiles alone and it writes only their
    rows of `out`."""
    H, kvh, D, d = 4, 2, 16, 3
    n_new = [1, 1, 1, 6, 9]
    ctx_lens = [7, 12, 5, 6, 20]
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = make_cache(ctx_lens, 8, kvh, D, torch.float32, gen)
    q_start = [0, 1, 2, 3, 9, 18]
    q = torch.randn(18, H, D, generator=gen).to(DEVICE)
    scale = D ** -0.5
    expect = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale)
    out = torch.full_like(q, float("nan"))
    out[:5] = paged_decode_attention(q[:5], k_cache, v_cache, tables,
                                     torch.tensor(ctx_lens[:d] + [1, 1], dtype=torch.int32,
                                                  device=DEVICE), scale)
    q_start_t = torch.tensor(q_start, dtype=torch.int32, device=DEVICE)
    prompts = [s >= d for s in range(len(ctx_lens))]
    tiles = torch.tensor(token_tiles(q_start, tile_rows(q.device, q.dtype), prompts),
                         dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, q_start_t,
                                  torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale,
                                  tiles, out=out)
    assert got is out
    assert rel_err(out, expect) < 1e-5  # decode rows from the decode kernel, the rest prefill
    # the prefill kernel wrote nothing in the decode rows: only the decode kernel's values
    alone = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, q_start_t,
                            torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale,
                            tiles, out=alone)
    assert torch.isnan(alone[:d]).all() and not torch.isnan(alone[d:]).any()


# (window, softcap): a sliding window shorter than a page, one spanning pages, a softcap alone,
# both (Gemma 2's sliding layers).
MASKS = [(3, 0.0), (11, 0.0), (0, 2.0), (11, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,softcap", MASKS, ids=lambda v: str(v))
def test_window_and_softcap_match_twin(window, softcap, dtype):
    """Sliding-window and soft-capped attention, decode (one pass, split-K, rope folded in)
    and prefill (prompts and chunks longer than the window, block tables of several pages),
    against the twins. Scores are scaled up so that the softcap bites."""
    H, kvh, D, bs = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(window + int(softcap))
    scale = 3 * D ** -0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ctx_lens = [1, 3, 12, 29]
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, dtype, gen)
    q = torch.randn(len(ctx_lens), H, D, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    expect = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window, softcap)
    full = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert rel_err(expect, full) > 1e-3  # the window or the cap changes the answer
    for splits in (1, 3):
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=splits,
                                     window=window, softcap=softcap)
        assert rel_err(out, expect) < tol, splits

    # rope folded into the decode kernel, the new token's K/V stored by the split holding it
    pool = k_cache.as_strided((k_cache.shape[0], 2 * bs * kvh * D), (k_cache.stride(0), 1))
    tcpu = tables.cpu().long()
    slots = torch.tensor([int(tcpu[s, (c - 1) // bs]) * bs + (c - 1) % bs
                          for s, c in enumerate(ctx_lens)], device=DEVICE)
    positions = ctx.long() - 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    qkv = torch.randn(len(ctx_lens), (H + 2 * kvh) * D, generator=gen).to(dtype).to(DEVICE)
    pool_ref = pool.clone()
    kc_ref, vc_ref = ref.kv_views(pool_ref, bs, kvh, D)
    q_ref = ref.rope_write_kv(qkv.clone(), positions, inv_freq, kc_ref, vc_ref, slots, H, kvh)
    expect = ref.paged_decode_attention(q_ref, kc_ref, vc_ref, tables, ctx, scale, window,
                                        softcap)
    out = rope_paged_decode_attention(qkv, positions, inv_freq, k_cache, v_cache, slots, tables,
                                      ctx, scale, H, kvh, num_splits=2, fold=True, window=window,
                                      softcap=softcap)
    assert rel_err(out, expect) < tol
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol, equal_nan=True)

    # prefill: a whole prompt past the window, a chunk over a cached prefix, a decode row
    n_new = [20, 6, 1]
    ctx_lens = [20, 26, 17]
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, dtype, gen)
    q_start = [0, 20, 26, 27]
    q = torch.randn(q_start[-1], H, D, generator=gen).to(dtype).to(DEVICE)
    expect = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, window,
                                 softcap)
    out = paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor(q_start, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale, window=window,
        softcap=softcap)
    assert not torch.isnan(out).any()
    assert rel_err(out, expect) < tol


def test_window_twin_is_causal_attention_over_the_window():
    """The twin's window, spelled out on one sequence: token i attends to keys
    max(0, i - window + 1)..i, the same as full attention over those keys alone."""
    H, kvh, D, bs, window = 2, 1, 8, 4, 5
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = make_cache([13], bs, kvh, D, torch.float32, gen)
    q = torch.randn(13, H, D, generator=gen).to(DEVICE)
    out = ref.paged_attention(q, k_cache, v_cache, tables, [0, 13], [13], 0.3, window)
    k = k_cache[tables[0, :4].long()].reshape(-1, kvh, D)[:13, 0]
    v = v_cache[tables[0, :4].long()].reshape(-1, kvh, D)[:13, 0]
    for i in range(13):
        lo = max(0, i - window + 1)
        p = torch.softmax(q[i] @ k[lo:i + 1].T * 0.3, dim=-1)
        torch.testing.assert_close(out[i], p @ v[lo:i + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_attention_chunks_over_a_long_cached_prefix(dtype):
    """Chunked prefill: chunks of several query tiles over cached prefixes longer than
    themselves (starting mid-page and on a page boundary), a one-token chunk, and a whole
    prompt beside them; against the twin."""
    H, kvh, D, block_size = 4, 2, 16, 8
    n_new = [40, 1, 33, 12]
    ctx_lens = [140, 77, 97, 12]  # prefixes of 100, 76, 64 (a page boundary) and 0 tokens
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables = make_cache(ctx_lens, block_size, kvh, D, dtype, gen)
    q_start = [0]
    for n in n_new:
        q_start.append(q_start[-1] + n)
    q = torch.randn(q_start[-1], H, D, generator=gen).to(dtype).to(DEVICE)
    scale = D ** -0.5
    out = paged_prefill_attention(q, k_cache, v_cache, tables,
                                  torch.tensor(q_start, dtype=torch.int32, device=DEVICE),
                                  torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale)
    expect = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale)
    assert not torch.isnan(out).any()
    assert rel_err(out, expect) < (1e-5 if dtype == torch.float32 else 1e-2)


# ----------------------------------------------------------------------------- sinks

# Per-head sink logits: large (the sink takes most of each softmax's mass) and negative.
SINK_RANGES = {"dominant": (8.0, 10.0), "negative": (-4.0, -1.0)}
SINK_DTYPES = [torch.float32, torch.bfloat16]


def _sinks(H, kind, gen):
    lo, hi = SINK_RANGES[kind]
    return (lo + (hi - lo) * torch.rand(H, generator=gen)).to(DEVICE)


def _check_sinks_bite(expect, without, kind):
    """The sinks change the answer; dominant ones shrink it (their mass has no value)."""
    assert rel_err(expect, without) > 1e-2
    if kind == "dominant":
        assert expect.float().norm() < 0.5 * without.float().norm()


@pytest.mark.parametrize("window", [0, 5, 40], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("kind", list(SINK_RANGES))
def test_sinks_twin_is_hf_eager_attention(kind, window):
    """The twin's sinks are HF's GptOssAttention eager path (the sink logit concatenated to
    each row's scores, softmax, the sink's column dropped): a whole prompt and a chunk over
    a cached prefix, GQA, with and without a sliding window."""
    hf = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    H, kvh, D, bs = 4, 2, 8, 4
    n_new, ctx_lens = [9, 5], [9, 14]
    gen = torch.Generator().manual_seed(window + len(kind))
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, torch.float32, gen)
    q = torch.randn(sum(n_new), H, D, generator=gen).to(DEVICE)
    sinks = _sinks(H, kind, gen)
    q_start = [0, n_new[0], sum(n_new)]
    out = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, 0.3, window,
                              sinks=sinks)
    module = type("Attn", (), dict(sinks=sinks, num_key_value_groups=H // kvh, training=False))
    for s, (n, ctx) in enumerate(zip(n_new, ctx_lens)):
        pages = tables[s, :-(-ctx // bs)].long()
        k = k_cache[pages].reshape(-1, kvh, D)[:ctx].transpose(0, 1)[None]  # [1, KVH, ctx, D]
        v = v_cache[pages].reshape(-1, kvh, D)[:ctx].transpose(0, 1)[None]
        qpos = torch.arange(ctx - n, ctx, device=DEVICE)[:, None]
        kpos = torch.arange(ctx, device=DEVICE)[None, :]
        seen = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
        mask = torch.zeros(n, ctx, device=DEVICE).masked_fill(~seen, float("-inf"))
        expect, _ = hf.eager_attention_forward(module, q[q_start[s]:q_start[s + 1]]
                                               .transpose(0, 1)[None], k, v, mask[None, None],
                                               0.3)
        torch.testing.assert_close(out[q_start[s]:q_start[s + 1]], expect[0])


@pytest.mark.parametrize("dtype", SINK_DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(SINK_RANGES))
@pytest.mark.parametrize("window", [0, 11], ids=lambda w: f"window{w}")
def test_decode_attention_with_sinks_matches_twin(window, kind, dtype):
    """Decode with sinks: one pass and split-K (a context of many pages over four splits,
    the last of them past its end, and a one-token context whose later splits hold no key:
    the sink enters the merge once), GQA 4:1, and the rotary folded in; against the twin."""
    H, kvh, D, bs = 8, 2, 16, 8
    gen = torch.Generator().manual_seed(window + 7 * len(kind))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ctx_lens = [1, 9, 70]
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, dtype, gen)
    q = torch.randn(len(ctx_lens), H, D, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    sinks = _sinks(H, kind, gen)
    scale = D ** -0.5
    expect = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window,
                                        sinks=sinks)
    _check_sinks_bite(expect, ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx,
                                                         scale, window), kind)
    for splits in (1, 4):
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=splits,
                                     window=window, sinks=sinks)
        assert not torch.isnan(out).any()
        assert rel_err(out, expect) < tol, splits

    # the rotary folded in, against the twin over q and the cache as `fused.rope_write_kv`
    # rotates them (in fp32, rounded once, as the fold does: a dominant sink leaves the
    # softmax's sum free to follow the scores, so the twin's 16-bit rotary would show)
    qkv, args, pool, _ = _rope_case((H, kvh, D), dtype, 3 + window)
    positions, inv_freq, _, _, slots, tables, ctx, _ = args
    kc_ref, vc_ref = ref.kv_views(pool.clone(), 8, kvh, D)
    q_ref = rope_write_kv(qkv.clone(), positions, inv_freq, kc_ref, vc_ref, slots, H, kvh)
    expect = ref.paged_decode_attention(q_ref, kc_ref, vc_ref, tables, ctx, scale, window,
                                        sinks=sinks)
    out = rope_paged_decode_attention(qkv, *args, H, kvh, num_splits=2, fold=True,
                                      window=window, sinks=sinks)
    assert rel_err(out, expect) < tol


@pytest.mark.parametrize("dtype", SINK_DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(SINK_RANGES))
@pytest.mark.parametrize("window", [0, 11], ids=lambda w: f"window{w}")
def test_prefill_attention_with_sinks_matches_twin(window, kind, dtype):
    """Prefill with sinks: a whole prompt of several query tiles, a chunk over a cached
    prefix, a decode row; GQA 4:1; against the twin."""
    H, kvh, D, bs = 8, 2, 16, 8
    n_new, ctx_lens = [20, 6, 1], [20, 26, 17]
    gen = torch.Generator().manual_seed(window + 11 * len(kind))
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, dtype, gen)
    q_start = [0, 20, 26, 27]
    q = torch.randn(q_start[-1], H, D, generator=gen).to(dtype).to(DEVICE)
    sinks = _sinks(H, kind, gen)
    scale = D ** -0.5
    expect = ref.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, window,
                                 sinks=sinks)
    _check_sinks_bite(expect, ref.paged_attention(q, k_cache, v_cache, tables, q_start,
                                                  ctx_lens, scale, window), kind)
    out = paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor(q_start, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale, window=window,
        sinks=sinks)
    assert not torch.isnan(out).any()
    assert rel_err(out, expect) < (1e-5 if dtype == torch.float32 else 1e-2)


def _step(n_new, ctx_lens, num_decode, tables, bs, dtype):
    """The `Batch` of a step over sequences with n_new new tokens each and ctx_lens cached
    (new ones included), the first num_decode of them decode rows, as the runner builds it."""
    from slora.model.llama import Batch

    q_start = [0]
    for n in n_new:
        q_start.append(q_start[-1] + n)
    tcpu = tables.cpu().long()
    positions = [p for n, c in zip(n_new, ctx_lens) for p in range(c - n, c)]
    seq = [s for s, n in enumerate(n_new) for _ in range(n)]
    slots = [int(tcpu[s, p // bs]) * bs + p % bs for s, p in zip(seq, positions)]
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    b = Batch(input_ids=torch.zeros(q_start[-1], dtype=torch.long, device=DEVICE),
              positions=torch.tensor(positions, device=DEVICE),
              slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=tables,
              ctx_lens=ctx, ctx_lens_list=list(ctx_lens), q_start_list=q_start,
              q_start_tensor=torch.tensor(q_start, dtype=torch.int32, device=DEVICE),
              num_decode=num_decode, logits_index=ctx.long(), lora=None)
    if num_decode < len(n_new):
        prompts = [s >= num_decode for s in range(len(n_new))]
        b.tiles = torch.tensor(token_tiles(q_start, tile_rows(torch.device(DEVICE), dtype),
                                           prompts), dtype=torch.int32, device=DEVICE)
        if num_decode:
            b.dec_ctx_lens = ctx[:num_decode]
    return b


@pytest.mark.parametrize("dtype", SINK_DTYPES, ids=str)
@pytest.mark.parametrize("mixed", [False, True], ids=["decode-only", "mixed"])
def test_backend_attention_passes_sinks_to_every_path(mixed, dtype):
    """TritonBackend.attention and .rope_attention with sinks (and a sliding window) equal
    TorchBackend's, in a decode-only step (the decode kernel, the rotary folded in) and a
    mixed one (decode rows through the decode kernel, the prompts' tiles through the
    prefill kernel)."""
    from slora.kernels.backend import TorchBackend, TritonBackend

    H, kvh, D, bs, window = 4, 2, 16, 8, 11
    n_new, ctx_lens = ([1, 1, 1], [3, 17, 30]) if not mixed else ([1, 1, 20, 5], [3, 30, 20, 24])
    gen = torch.Generator().manual_seed(2 + mixed)
    k_cache, v_cache, tables = make_cache(ctx_lens, bs, kvh, D, dtype, gen)
    b = _step(n_new, ctx_lens, 2 if mixed else 3, tables, bs, dtype)
    sinks = _sinks(H, "negative", gen)
    sinks[1] = 9.0  # one head's sink dominant
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch_be, triton_be = TorchBackend(), TritonBackend(gemm_max_rows=16)
    q = torch.randn(sum(n_new), H, D, generator=gen).to(dtype).to(DEVICE)
    expect = torch_be.attention(q, k_cache, v_cache, b, 0.3, window, sinks=sinks)
    out = triton_be.attention(q, k_cache, v_cache, b, 0.3, window, sinks=sinks)
    assert rel_err(out, expect) < tol

    pool = k_cache.as_strided((k_cache.shape[0], 2 * bs * kvh * D), (k_cache.stride(0), 1))
    pool_ref = pool.clone()
    kc_ref, vc_ref = ref.kv_views(pool_ref, bs, kvh, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    qkv = torch.randn(sum(n_new), (H + 2 * kvh) * D, generator=gen).to(dtype).to(DEVICE)
    expect = torch_be.rope_attention(qkv.clone(), inv_freq, kc_ref, vc_ref, b, 0.3, H, kvh,
                                     window, sinks=sinks)
    out = triton_be.rope_attention(qkv, inv_freq, k_cache, v_cache, b, 0.3, H, kvh, window,
                                   sinks=sinks)
    assert rel_err(out, expect) < tol
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol, equal_nan=True)
