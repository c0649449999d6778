"""The priority policy (vLLM's priority scheduling): the waiting queue is served lowest
priority first, arrival order among equals; a preemption takes the running request of the
highest priority value (the latest admitted among equals); a priority needs the policy."""

import pytest

from slora import Engine, EngineConfig, SamplingParams
from slora.core.policies import make_policy
from slora.request import Request


def test_order_is_priority_then_arrival():
    reqs = [Request(str(i), [1, 2], SamplingParams(), None, float(i), priority=p)
            for i, p in enumerate([2, 0, 1, 0, 2])]
    order = make_policy("priority").order(reqs, set())
    assert [r.request_id for r in order] == ["1", "3", "2", "0", "4"]


def test_engine_serves_low_priority_values_first_and_preempts_the_high_ones(tiny_model_dir):
    """max_num_seqs 2: the two lowest priority values run first whatever their arrival; in
    a pool too small for all, preemption takes the highest priority value."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=64, policy="priority", max_num_seqs=2))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = engine.generate(["a b c", "d e f", "g h i", "j k l"], sp, priority=[3, 1, 2, 0])
    first = sorted(outs, key=lambda o: o.metrics.scheduled_time)[:2]
    assert {o.prompt_token_ids[1] for o in first} == {
        engine.tokenizer.encode(p)[1] for p in ("d e f", "j k l")}
    tight = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                num_pages=10, block_size=4, policy="priority",
                                max_prefill_chunk=0))
    prompt = "The quick brown fox"
    outs = tight.generate([prompt] * 3, SamplingParams(max_tokens=30, ignore_eos=True),
                          priority=[5, 0, 1])
    assert tight.stats()["preemptions"] > 0
    assert outs[0].metrics.finish_time >= max(o.metrics.finish_time for o in outs[1:])
    assert all(o.finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="priority=1: requests take priorities under "
                                         "EngineConfig.policy='priority'"):
        Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=16)).add_request("hi", priority=1)
