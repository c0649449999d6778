"""slora's greedy tokens equal HF transformers' on tiny random Llama-family models (fp32, CPU),
for a batch of prompts of different lengths, and the chosen-token log-probs agree to 1e-3."""

import pytest
import torch

# On a GPU the same comparison runs on CUDA (Triton kernels), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from slora import Engine, EngineConfig, SamplingParams
from tests.conftest import TINY, peft_greedy

PROMPTS = ["The quick brown fox", "Hello", "Serving many LoRA adapters from one GPU needs",
           "Paris is the capital of France. Berlin is"]
NEW = 32


@pytest.mark.parametrize("kind", sorted(TINY))
def test_greedy_matches_transformers(tiny_models, kind):
    model_dir = tiny_models(kind)
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=64, block_size=16))
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=2)
    outs = engine.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ids = engine.tokenizer.encode(prompt)
        toks, lps = peft_greedy(model_dir, None, ids, NEW, DEVICE)
        assert out.token_ids == toks, f"{kind}: {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3)
        assert all(len(lp) in (2, 3) for lp in out.logprobs)  # top-2 plus the chosen token
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats["pages_kv"] == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
