"""Prefix caching on the real engine (tiny model, fp32; on the GPU where there is one):
requests that find their prefix cached give the tokens and log-probs of the engine without the
cache (on the torch twins; on a GPU, on the Triton kernels too: interpreted on CPU they take
minutes); hit counters are exact; the cache keys KV by the adapter's content and the request's
cache_salt."""

import math

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from tests.conftest import make_adapter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16
SYSTEM = list(range(3, 3 + 40))  # two full pages and 8 tokens
SP = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)


def _engine(model_dir, **kw):
    return Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                               num_pages=128, block_size=BS, **kw))


def _check(engine):
    engine.allocator.check()
    if engine.scheduler.prefix is not None:
        engine.scheduler.prefix.check()


def _same(outs, want):
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids
        for got, ref in zip(o.logprobs, w.logprobs):
            assert got.keys() == ref.keys()
            assert all(math.isclose(got[t], ref[t], abs_tol=1e-4) for t in got)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_adapters")
    return [make_adapter(tiny_model_dir, root / name, seed=i + 1) for i, name in enumerate("ab")]


@pytest.mark.parametrize("backend,async_scheduling", [
    ("torch", False), ("torch", True), *([("triton", False), ("triton", True)] * (DEVICE == "cuda"))])
def test_shared_prefixes_give_the_uncached_outputs_and_exact_hits(tiny_model_dir, adapters,
                                                                  backend, async_scheduling):
    warm = ([SYSTEM + [50, 51], SYSTEM + [52]], [None, "a"])
    batch = ([SYSTEM + [60, 61, 62], SYSTEM + [63], SYSTEM + [64], SYSTEM + [63], [70, 71, 72],
              SYSTEM[:33], SYSTEM[:32]],
             [None, "a", "b", "a", None, None, "a"])
    results = {}
    for on in (False, True):
        engine = _engine(tiny_model_dir, enable_prefix_caching=on, backend=backend,
                         async_scheduling=async_scheduling)
        for name, path in zip("ab", adapters):
            engine.add_adapter(name, path)
        first = engine.generate(*warm[:1], SP, adapters=warm[1])
        before = engine.stats()
        outs = engine.generate(batch[0], SP, adapters=batch[1])
        _check(engine)
        results[on] = (first, outs, before, engine.stats())
    (first0, outs0, _, _), (first1, outs1, before, after) = results[False], results[True]
    _same(first1, first0)
    _same(outs1, outs0)
    assert [o.num_cached_tokens for o in outs0] == [0] * 7
    # the warm-up's two pages per (base, "a"); "b" and the unrelated prompt find none; a
    # prompt of 32 tokens computes its last, so finds one page
    want = [32, 32, 0, 32, 0, 32, 16]
    assert [o.num_cached_tokens for o in outs1] == want
    assert before["prefix_hit_tokens"] == 0
    assert after["prefix_hit_tokens"] == sum(want)
    assert after["prefix_query_tokens"] - before["prefix_query_tokens"] == sum(map(len, batch[0]))
    assert after["pages_kv"] == 0 and after["pages_cached"] > 0
    assert (after["pages_free"] + after["pages_kv"] + after["pages_adapter"]
            + after["pages_cached"] == after["pages_total"])


def test_readding_a_name_with_new_weights_does_not_hit_old_pages(tiny_model_dir, tmp_path):
    path = make_adapter(tiny_model_dir, tmp_path / "x", seed=11)
    engine = _engine(tiny_model_dir)
    engine.add_adapter("x", path)
    prompt = SYSTEM + [80]
    engine.generate([prompt], SP, adapters="x")
    engine.remove_adapter("x")
    make_adapter(tiny_model_dir, path, seed=12)  # new weights in the same directory
    engine.add_adapter("x", path)
    out = engine.generate([prompt], SP, adapters="x")[0]
    assert out.num_cached_tokens == 0
    fresh = _engine(tiny_model_dir, enable_prefix_caching=False)
    fresh.add_adapter("x", path)
    _same([out], fresh.generate([prompt], SP, adapters="x"))
    # the same content under another name is the same adapter: its pages are found
    engine.add_adapter("y", path)
    assert engine.generate([prompt], SP, adapters="y")[0].num_cached_tokens == 32
    _check(engine)


def test_cache_salts_keep_tenants_apart_and_reset_forgets(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompt = SYSTEM + [90]

    def hit(salt):
        return engine.generate([prompt], SP, cache_salt=salt)[0].num_cached_tokens

    assert [hit("t1"), hit("t2"), hit(None), hit("t1"), hit("t2"), hit(None)] == [0, 0, 0, 32, 32, 32]
    assert engine.reset_prefix_cache() > 0
    assert engine.stats()["pages_cached"] == 0 and hit("t1") == 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, SP, cache_salt="")
    with pytest.raises(ValueError, match="cache_prefix"):
        engine.add_request(prompt, SP, cache_prefix="no")
    _check(engine)
