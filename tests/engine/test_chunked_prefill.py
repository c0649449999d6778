"""Chunked prefill (EngineConfig.max_prefill_chunk): prompts several times max_batch_tokens
long run in chunks, each attending to the KV of the chunks before it, and give the tokens and
log-probs of the unchunked engine and of HF transformers / PEFT (greedy, fp32), with adapters
and base rows mixed; a chunk short of its prompt's end samples nothing. The same through the
Triton kernels, the graphs' static buffers and async scheduling."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slora import Engine, EngineConfig, SamplingParams  # noqa: E402
from tests.conftest import build_tiny_model, peft_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [300, 417, 523, 600, 690]  # the last reaches max_model_len (700) after 10 tokens
ADAPTERS = [None, "a", "b", "a", "b"]
MAX_LEN, NEW = 700, 6


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama with room for 1,024 positions."""
    return build_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama",
                            max_position_embeddings=1024)


@pytest.fixture(scope="module")
def adapters(long_model, adapter_factory):
    return {"a": adapter_factory(long_model, r=8, target_modules=["q_proj", "v_proj"]),
            "b": adapter_factory(long_model, r=16, target_modules="all-linear", seed=1)}


def _prompts(vocab: int) -> list[list[int]]:
    """Random prompts of LENS tokens; the fourth starts with the second (the same adapter):
    admitted while the second is still in chunks, it finds that one's committed pages."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in LENS]
    prompts[3][:LENS[1]] = prompts[1]
    return prompts


def _engine(model, adapters, **kw) -> Engine:
    e = Engine(EngineConfig(model=str(model), device=DEVICE, dtype="float32", num_pages=256,
                            max_model_len=MAX_LEN, **kw))
    for name, path in adapters.items():
        e.add_adapter(name, path)
    return e


def _record_plans(e: Engine) -> list:
    """Every plan the engine's scheduler makes, with its rows' chunks as scheduled."""
    plans, schedule = [], e.scheduler.schedule

    def logged(now):
        plan = schedule(now)
        plans.append((plan.num_tokens, len(plan.decode), dict(plan.chunks), set(plan.partial),
                      {r.request_id: r.num_computed for r in plan.prefill}))
        return plan

    e.scheduler.schedule = logged
    return plans


def test_chunks_give_the_unchunked_and_hf_tokens(long_model, adapters):
    sp = SamplingParams(max_tokens=NEW * 2, ignore_eos=True, logprobs=1)
    whole = _engine(long_model, adapters, max_prefill_chunk=0)
    prompts = _prompts(whole.model_config.vocab_size)
    want = whole.generate(prompts, sp, adapters=ADAPTERS)

    chunked = _engine(long_model, adapters, max_batch_tokens=64)
    plans = _record_plans(chunked)
    got = chunked.generate(prompts, sp, adapters=ADAPTERS)

    for a, b, n in zip(got, want, LENS):
        assert a.token_ids == b.token_ids and len(a.token_ids) == min(2 * NEW, MAX_LEN - n)
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.logprobs) == len(a.token_ids)  # one entry per token: chunks add none
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert list(la.values()) == pytest.approx(list(lb.values()), abs=1e-4)
    # every step within the budget, prompts cut in chunks that continue where the last ended
    assert all(tokens <= 64 for tokens, *_ in plans)
    assert sum(len(partial) for *_, partial, _ in plans) >= 2 * len(LENS)
    done = {}
    for _, _, chunks, partial, start in plans:
        for rid, n in chunks.items():
            if rid not in done:  # its first chunk: from 0, or past a cached prefix of pages
                assert start[rid] % 16 == 0
            else:  # each next chunk where the last ended
                assert start[rid] == done[rid]
            done[rid] = start[rid] + n
    assert sorted(done.values()) == LENS
    stats = chunked.stats()
    assert stats["pages_kv"] == 0 and stats["preemptions"] == 0
    assert stats["prefix_hit_tokens"] > 0  # chunks' full pages are cached as they are computed

    for ids, name, out in zip(prompts, ADAPTERS, got):
        toks, lps = peft_greedy(long_model, adapters.get(name), ids, len(out.token_ids),
                                device=DEVICE)
        assert out.token_ids == toks, (len(ids), name)
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3)


def test_seeded_sampling_is_the_same_chunked(long_model, adapters):
    """A chunk short of its prompt's end draws nothing from the request's generator."""
    sps = [SamplingParams(max_tokens=5, temperature=0.9, seed=11 + i) for i in range(2)]
    outs = []
    for kw in (dict(max_prefill_chunk=0), dict(max_batch_tokens=48, max_prefill_chunk=40)):
        e = _engine(long_model, adapters, **kw)
        outs.append([o.token_ids for o in e.generate(_prompts(e.model_config.vocab_size)[:2],
                                                     sps, adapters=["a", None])])
    assert outs[0] == outs[1]


def test_chunks_through_triton_graphs_and_async_scheduling(tiny_model_dir, adapter_factory):
    """Mixed steps of decode rows and chunks through the Triton kernels (prefill attention
    over a cached prefix, MBGMM over chunk segments) and the graphs' static buffers (run
    eagerly, capture=False, as on CPU), with async scheduling: the torch backend's unchunked
    tokens. (The sync order is the same code with each step collected at once; the
    interpreter's time keeps this to one engine.)"""
    paths = {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
             "r8": adapter_factory(tiny_model_dir, r=8, target_modules=["o_proj"], seed=1)}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (30, 3, 21)]
    names = ["r3", None, "r8"]
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 4, 2)]

    def run(**kw):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                                num_pages=32, max_num_seqs=4, **kw))
        for name, path in paths.items():
            e.add_adapter(name, path)
        graphs = kw.get("backend") == "triton"
        if graphs:
            e.runner.graphs = e.runner.make_graphs(4, mixed_tokens=16, capture=False)
        plans = _record_plans(e)
        ids = [e.add_request(prompts[0], sps[0], names[0])]
        done = {o.request_id: o for o in e.step() if o.finished}  # the others join mid-prefill
        ids += [e.add_request(p, sp, a) for p, sp, a in zip(prompts[1:], sps[1:], names[1:])]
        while e.has_unfinished():
            done.update({o.request_id: o for o in e.step() if o.finished})
        if graphs:
            assert {k[0] for k in e.runner.graphs.graphs} == {"decode", "mixed"}
        return [done[i].token_ids for i in ids], plans

    want, _ = run(backend="torch", max_prefill_chunk=0, cuda_graphs=False)
    got, plans = run(backend="triton", max_batch_tokens=12, async_scheduling=True)
    assert got == want
    # steps mixing decode rows with a chunk short of its prompt's end
    assert any(decode and partial for _, decode, _, partial, _ in plans)
