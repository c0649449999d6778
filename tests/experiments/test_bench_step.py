"""Micro-benchmark: the host work of one decode step at batch 32 (schedule, batch building,
sampling, outputs) with the model's forward stubbed out. On a GPU this work sits beside a
7B decode step of a few milliseconds, so it must stay well under a millisecond.
(`./run test tests/experiments/test_bench_step.py --benchmark-enable`)"""

import torch

from slora import Engine, EngineConfig, SamplingParams


def test_decode_step_host_overhead(tiny_model_dir, benchmark):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=2048))
    engine.add_synthetic_adapter("a", 8)
    vocab = engine.model_config.vocab_size

    def forward(batch, pool):
        return torch.zeros(len(batch.q_start_list) - 1, vocab)

    engine.runner.model.forward = forward
    for i in range(32):
        engine.add_request(list(range(2, 40)), SamplingParams(max_tokens=100_000, ignore_eos=True),
                           adapter="a" if i % 2 else None)
    started: set[str] = set()
    while len(started) < 32:  # the prompts, in chunks of at most max_prefill_chunk tokens
        started.update(o.request_id for o in engine.step() if o.token_ids)
    # a fixed number of rounds: the tiny model's 256-token limit ends the requests after ~210
    outs = benchmark.pedantic(engine.step, rounds=150, iterations=1, warmup_rounds=5)
    assert len(outs) == 32 and all(len(o.token_ids) >= 2 for o in outs)
