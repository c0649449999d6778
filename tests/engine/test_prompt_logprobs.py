"""Prompt log-probs (SamplingParams.prompt_logprobs, vLLM's): every prompt token's log-prob
given the tokens before it, and the top N there, equal to PEFT's forward over the prompt
(fp32), with adapters (LoRA on lm_head too) and base rows in one batch, whole or chunked,
sync or async, beside requests that ask for none; such a request skips the prefix cache, and
a preempted one keeps the entries it has."""

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["The quick brown fox jumps over the lazy dog and runs far away",
           "Paris is the capital of", "Hi"]
TOP = 3


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, adapter_factory):
    return {"head": adapter_factory(tiny_model_dir, seed=1, r=6, lora_alpha=6,
                                    target_modules=["lm_head", "v_proj"]),
            "qv": adapter_factory(tiny_model_dir, seed=2)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    """(prompt ids, adapter) -> PEFT's (or HF's) log-softmax over each prompt position."""
    import peft
    import transformers

    cache = {}

    def get(ids, name):
        if name not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
            if name is not None:
                model = peft.PeftModel.from_pretrained(model, adapters[name])
            cache[name] = model.to(DEVICE).eval()
        with torch.no_grad():
            logits = cache[name](torch.tensor([ids], device=DEVICE)).logits[0]
        return torch.log_softmax(logits.float(), -1).cpu()

    return get


def check(out, want: torch.Tensor, top: int) -> None:
    """`out.prompt_logprobs` against the reference log-softmax rows `want` [n, vocab]."""
    ids = out.prompt_token_ids
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, entry = want[p - 1], got[p]
        best = torch.topk(row, top)
        assert set(entry) == set(best.indices.tolist()) | {ids[p]}, p
        assert entry[ids[p]] == pytest.approx(float(row[ids[p]]), abs=1e-4), p
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4), p


def engine_for(model_dir, adapters, **kw) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=kw.pop("num_pages", 128), **kw))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


@pytest.mark.parametrize("kw", [
    dict(max_prefill_chunk=0),
    dict(max_batch_tokens=12, max_prefill_chunk=5),
    dict(max_batch_tokens=12, max_prefill_chunk=5, async_scheduling=True),
], ids=["whole", "chunked", "chunked-async"])
def test_prompt_logprobs_match_peft(tiny_model_dir, adapters, reference, kw):
    """Every prompt with every adapter and the base model in one batch; the requests that
    ask for prompt log-probs beside ones that do not, whose tokens stay as alone."""
    engine = engine_for(tiny_model_dir, adapters, **kw)
    jobs = [(p, a) for p in PROMPTS for a in (None, "head", "qv")]
    plain = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    asked = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=TOP)
    outs = engine.generate([p for p, _ in jobs] * 2, [asked] * len(jobs) + [plain] * len(jobs),
                           adapters=[a for _, a in jobs] * 2)
    for (prompt, name), out, other in zip(jobs, outs, outs[len(jobs):]):
        check(out, reference(out.prompt_token_ids, name), TOP)
        assert out.token_ids == other.token_ids and other.prompt_logprobs is None
        assert out.num_cached_tokens == 0
    # the lm_head LoRA changes them: not base against base
    base, head = outs[0].prompt_logprobs, outs[1].prompt_logprobs
    assert any(base[p] != pytest.approx(head[p], abs=1e-3) for p in range(1, len(base)))


def test_prompt_logprobs_on_triton(tiny_model_dir, adapters, reference):
    """The Triton kernels' path (MBGMV over the head rows' adapters), chunked; interpreted on
    CPU, with one prompt. (On a GPU the test above runs them already.)"""
    pytest.importorskip("triton")
    engine = engine_for(tiny_model_dir, adapters, backend="triton", cuda_graphs=False,
                        max_batch_tokens=12, max_prefill_chunk=5)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    outs = engine.generate([PROMPTS[1]] * 3, sp, adapters=[None, "head", "qv"])
    for name, out in zip([None, "head", "qv"], outs):
        check(out, reference(out.prompt_token_ids, name), TOP)


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone(tiny_model_dir, adapters,
                                                            reference):
    engine = engine_for(tiny_model_dir, {})
    out = engine.generate(PROMPTS[1], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    assert [set(e) for e in out.prompt_logprobs[1:]] == [{t} for t in ids[1:]]
    check(out, reference(ids, None), 0)
    one = engine.generate([ids[:1]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model_dir, adapters, reference):
    """A prompt cached by an earlier request is computed again for prompt log-probs (its pages
    hold no logits); a request without them still finds it."""
    engine = engine_for(tiny_model_dir, adapters, enable_prefix_caching=True, block_size=4)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate(PROMPTS[0], sp, adapters="qv")
    again = engine.generate(PROMPTS[0], sp, adapters="qv")[0]
    assert again.num_cached_tokens > 0
    asked = engine.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True,
                                                       prompt_logprobs=1), adapters="qv")[0]
    assert asked.num_cached_tokens == 0
    check(asked, reference(asked.prompt_token_ids, "qv"), 1)


def test_preempted_request_keeps_its_prompt_logprobs(tiny_model_dir, adapters, reference):
    """A pool too small for every request at once: requests are preempted and recomputed;
    each prompt's log-probs are still each position's once, equal to PEFT's."""
    engine = engine_for(tiny_model_dir, {"qv": adapters["qv"]}, num_pages=24, block_size=4,
                        max_prefill_chunk=4, max_batch_tokens=8)
    jobs = [(p, a) for p in PROMPTS[:2] for a in (None, "qv", None)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = engine.generate([p for p, _ in jobs], sp, adapters=[a for _, a in jobs])
    assert engine.stats()["preemptions"] > 0
    for (_, name), out in zip(jobs, outs):
        assert out.finish_reason == "length"
        check(out, reference(out.prompt_token_ids, name), 2)


def test_prompt_logprobs_past_max_logprobs_are_refused(tiny_model_dir):
    engine = engine_for(tiny_model_dir, {}, max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs=5: at most EngineConfig.max_logprobs=4"):
        engine.add_request("hello", SamplingParams(prompt_logprobs=5))
    with pytest.raises(ValueError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)
