"""EngineConfig.quantization="fp8" on CPU (fp32, the torch twins): the FP8 engine's greedy tokens
and log-probs equal HF transformers' on the same tiny model whose linear weights (q/k/v/o and
gate/up/down of every layer) were replaced by their FP8 round trip (`quant.round_trip`), for
Llama, Mistral and Qwen2, and with PEFT adapters mixed with base rows in one batch, PEFT's on
that round-tripped model. Also: what the runner quantizes and what it leaves, the config's
check, and the FP8 weight bytes the benchmarks count."""

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ConfigError, ModelConfig
from slora.model.quant import LINEAR_FIELDS, Fp8Weight, quantize_fp8, quantize_weights, round_trip

PROMPTS = ["The quick brown fox", "Hello", "Serving many LoRA adapters from one GPU needs",
           "Paris is the capital of France. Berlin is"]
NEW = 24
KINDS = ("llama", "mistral", "qwen2", "llama_headdim_linear")  # the last: q/k/v and o biases
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_tripped_hf(model_dir):
    """The HF model (fp32) with each linear weight of every layer replaced by its FP8 round
    trip: the model slora's FP8 engine serves."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    replaced = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJ:
                mod.weight.copy_(round_trip(mod.weight))
                replaced += 1
    assert replaced == 7 * model.config.num_hidden_layers
    return model.eval()


def greedy(model, ids, n):
    """Tokens and chosen-token log-probs of HF's greedy decode of one prompt."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    return toks, [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]


def fp8_engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                               num_pages=96, quantization="fp8", **kw))


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_engine_equals_transformers_on_the_round_tripped_model(tiny_models, kind):
    model_dir = tiny_models(kind)
    engine = fp8_engine(model_dir)
    for lw in engine.runner.model.w.layers:
        assert all(isinstance(getattr(lw, f), Fp8Weight) for f in LINEAR_FIELDS)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1))
    hf = round_tripped_hf(model_dir)
    for prompt, out in zip(PROMPTS, outs):
        toks, lps = greedy(hf, engine.tokenizer.encode(prompt), NEW)
        assert out.token_ids == toks, f"{kind}: {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"{kind}: {prompt!r}"


ADAPTERS = {
    "all_r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp_rslora": dict(r=6, lora_alpha=6, use_rslora=True,
                       target_modules=["o_proj", "gate_proj", "down_proj"]),
}


@pytest.mark.parametrize("kind", ("llama", "mistral", "qwen2"))
def test_fp8_engine_with_adapters_equals_peft_on_the_round_tripped_model(tiny_models,
                                                                         adapter_factory, kind):
    """One batch: every adapter and the base model on each prompt; each request's tokens are
    PEFT's for that request alone, its adapter over the round-tripped base model."""
    import peft

    model_dir = tiny_models(kind)
    paths = {name: adapter_factory(model_dir, seed=i, **kw)
             for i, (name, kw) in enumerate(ADAPTERS.items())}
    engine = fp8_engine(model_dir)
    for name, path in paths.items():
        engine.add_adapter(name, path)
    jobs = [(p, a) for p in PROMPTS[:3] for a in (None, *ADAPTERS)]
    outs = engine.generate([p for p, _ in jobs], SamplingParams(max_tokens=12, ignore_eos=True),
                           adapters=[a for _, a in jobs])
    by_job = {}
    for (prompt, name), out in zip(jobs, outs):
        model = round_tripped_hf(model_dir)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, paths[name]).eval()
        want, _ = greedy(model, engine.tokenizer.encode(prompt), 12)
        assert out.token_ids == want, f"{kind}: adapter {name}, prompt {prompt!r}"
        by_job[prompt, name] = out.token_ids
    # the adapters change the outputs: the batch really mixed adapters with base rows
    assert sum(by_job[p, a] != by_job[p, None] for p in PROMPTS[:3] for a in ADAPTERS) >= 6


def test_quantize_weights_keeps_fp8_weights_and_quantizes_the_rest(tiny_models):
    """A pre-quantized checkpoint's Fp8Weights stay as loaded (the same objects); the tensors
    beside them are quantized; norms and biases stay tensors."""
    from slora.model.loader import load_weights

    model_dir = tiny_models("qwen2")
    cfg = ModelConfig.from_dir(model_dir)
    w = load_weights(model_dir, cfg, torch.float32, torch.device("cpu"))
    given = quantize_fp8(w.layers[0].o)
    w.layers[0].o = given
    qkv = w.layers[1].qkv.clone()
    out = quantize_weights(w)
    assert out is w and w.layers[0].o is given
    assert all(isinstance(getattr(lw, f), Fp8Weight) for lw in w.layers for f in LINEAR_FIELDS)
    assert all(isinstance(lw.ln1, torch.Tensor) and isinstance(lw.qkv_bias, torch.Tensor)
               for lw in w.layers)
    torch.testing.assert_close(w.layers[1].qkv.dequantize(torch.float32), round_trip(qkv),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kind", ("llama", "qwen2"))
def test_fp8_weight_bytes_are_what_the_engine_holds(tiny_models, kind):
    """ModelConfig.weight_bytes(_, "fp8") (what the decode benchmark's byte floor counts) is
    the bytes of the FP8 engine's weights, biases left out; without quantization, the float32
    engine's."""
    cfg = ModelConfig.from_dir(tiny_models(kind))
    for quantization in (None, "fp8"):
        w = Engine(EngineConfig(model=str(tiny_models(kind)), device="cpu", dtype="float32",
                                num_pages=8, quantization=quantization)).runner.model.w
        held = {id(t): t.nbytes for t in (w.embed, w.lm_head, w.norm)}
        for lw in w.layers:
            held.update({id(f): f.nbytes for f in (lw.ln1, lw.ln2)})
            held.update({id(getattr(lw, f)): getattr(lw, f).nbytes for f in LINEAR_FIELDS})
        assert sum(held.values()) == cfg.weight_bytes(4, quantization)  # (tied: one table)
    assert cfg.weight_bytes(2, "fp8") < cfg.weight_bytes(2) < cfg.weight_bytes(4)


def test_quantization_is_checked():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization=8)
