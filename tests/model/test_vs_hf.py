"""slora's greedy tokens equal HF transformers' on tiny random Llama-family models (fp32, CPU),
for a batch of prompts of different lengths, and the chosen-token log-probs agree to 1e-3."""

import pytest
import torch

# On a GPU the same comparison runs on CUDA (Triton kernels), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from slora import Engine, EngineConfig, SamplingParams
from tests.conftest import TINY

PROMPTS = ["The quick brown fox", "Hello", "Serving many LoRA adapters from one GPU needs",
           "Paris is the capital of France. Berlin is"]
NEW = 32


def hf_greedy(model_dir, prompt_ids, new_tokens):
    """HF's own greedy decode of one prompt; returns tokens and chosen-token log-probs."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").to(DEVICE).eval()
    ids = torch.tensor([prompt_ids], device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]
    return toks, lps


@pytest.mark.parametrize("kind", sorted(TINY))
def test_greedy_matches_transformers(tiny_models, kind):
    model_dir = tiny_models(kind)
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=64, block_size=16))
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=2)
    outs = engine.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ids = engine.tokenizer.encode(prompt)
        toks, lps = hf_greedy(model_dir, ids, NEW)
        assert out.token_ids == toks, f"{kind}: {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3)
        assert all(len(lp) in (2, 3) for lp in out.logprobs)  # top-2 plus the chosen token
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats["pages_kv"] == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
