"""Qwen3 (per-head RMSNorm on q and k) and Phi-3 (fused qkv_proj / gate_up_proj in the
checkpoint and in its PEFT adapters) in the one parameterised model, fp32 on CPU.

Greedy tokens and log-probs of the base models against HF transformers run in
tests/model/test_vs_hf.py (the "qwen3" and "phi3" kinds of tests/conftest.py's TINY). Here: one
batch mixing PEFT adapters and base rows equals PEFT request by request, tokens and log-probs;
the configurations slora does not serve are refused with the reason."""

import json

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import LORA_MODULES, ConfigError, ModelConfig
from slora.model.loader import AdapterError, PeftAdapter, strides

# On a GPU the batch runs on CUDA (Triton kernels, CUDA graphs), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

NEW = 12
PROMPTS = ["The quick brown fox", "Serving many LoRA adapters", "Paris is the capital of"]
ADAPTERS = {
    "qwen3": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear",
                    rank_pattern={"k_proj": 6}),
    },
    "phi3": {
        # PEFT's names for Phi-3's linear layers: LoRA on the fused q|k|v and gate|up modules
        "fused": dict(r=8, lora_alpha=16,
                      target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "qkv_only": dict(r=4, lora_alpha=4, use_rslora=True, target_modules=["qkv_proj"],
                         layers_to_transform=[1]),
        "mlp_pattern": dict(r=4, lora_alpha=8, target_modules=["gate_up_proj", "down_proj"],
                            rank_pattern={"gate_up_proj": 10}, alpha_pattern={"down_proj": 2}),
    },
}


def peft_greedy(model_dir, adapter_path, ids, n):
    """PEFT's (or, without an adapter, HF's) greedy tokens and their log-probs, run alone."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path)
    model = model.to(DEVICE).eval()
    x = torch.tensor([ids], device=DEVICE)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]
    return toks, lps


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_adapters_in_one_batch_match_peft(tiny_models, adapter_factory, kind):
    model_dir = tiny_models(kind)
    paths = {name: adapter_factory(model_dir, seed=i, **kw)
             for i, (name, kw) in enumerate(ADAPTERS[kind].items())}
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=128))
    for name, path in paths.items():
        engine.add_adapter(name, path)
    jobs = [(p, a) for p in PROMPTS for a in (None, *paths)]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = engine.generate([p for p, _ in jobs], sp, adapters=[a for _, a in jobs])
    by_prompt = {}
    for (prompt, name), out in zip(jobs, outs):
        toks, lps = peft_greedy(model_dir, paths.get(name), engine.tokenizer.encode(prompt), NEW)
        assert out.token_ids == toks, f"{kind}: adapter {name}, prompt {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"{kind}: adapter {name}, {prompt!r}"
        by_prompt.setdefault(prompt, {})[name] = out.token_ids
    # every adapter changes the output of some prompt: the comparison is not base vs base
    for name in paths:
        assert any(t[name] != t[None] for t in by_prompt.values()), name


def test_fused_adapter_is_split_by_rows(tiny_models, peft_files, tmp_path):
    """A LoRA on Phi-3's qkv_proj is q, k and v LoRAs with its A and B's row slices, and its
    pack holds exactly those (scaled by alpha / r)."""
    cfg = ModelConfig.from_dir(tiny_models("phi3"))
    t = peft_files.tensors(cfg, r=4, modules=("qkv_proj", "gate_up_proj"), seed=3)
    d = peft_files.write(tmp_path / "a", t, dict(peft_type="LORA", r=4, lora_alpha=8,
                                                 target_modules=["qkv_proj", "gate_up_proj"]))
    ad = PeftAdapter("a", d, cfg)
    assert ad.layout.modules == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    flat = ad.pack(page_size=4096, dtype=torch.float32)
    pre = "base_model.model.model.layers.1."
    A, B = t[pre + "self_attn.qkv_proj.lora_A.weight"], t[pre + "self_attn.qkv_proj.lora_B.weight"]
    rows = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.q_size + cfg.kv_size),
            "v_proj": (cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)}
    for m, (s, e) in rows.items():
        i = LORA_MODULES.index(m)
        off_a, off_b = ad.layout.offsets[i]
        s_in, s_out = strides(cfg, m)
        d_in, d_out = cfg.module_dims(m)
        got_a = flat[1, off_a:off_a + 4 * s_in].view(4, s_in)[:, :d_in]
        got_b = flat[1, off_b:off_b + 4 * s_out].view(4, s_out)[:, :d_out]
        assert torch.equal(got_a, A)
        assert torch.equal(got_b, (B[s:e] * 2.0).T)


def test_module_names_of_the_other_family_are_refused(tiny_models, peft_files, tmp_path):
    phi3 = ModelConfig.from_dir(tiny_models("phi3"))
    llama = ModelConfig.from_dir(tiny_models("llama"))
    engine = Engine(EngineConfig(model=str(tiny_models("phi3")), device="cpu", dtype="float32",
                                 num_pages=16))
    split = peft_files.write(tmp_path / "split", peft_files.tensors(phi3, modules=("q_proj",)),
                             dict(peft_type="LORA", r=4, lora_alpha=8, target_modules="q_proj"))
    with pytest.raises(AdapterError, match="Phi3ForCausalLM model has no q_proj.*qkv_proj"):
        engine.add_adapter("split", split)
    fused = peft_files.write(tmp_path / "fused", peft_files.tensors(phi3, modules=("qkv_proj",)),
                             dict(peft_type="LORA", r=4, lora_alpha=8,
                                  target_modules=["qkv_proj"]))
    with pytest.raises(AdapterError, match=r"\['qkv_proj'\] are not linear modules of this "
                                           "LlamaForCausalLM model"):
        PeftAdapter("fused", fused, llama)


def _config(tiny_models, kind, **changes):
    c = json.loads((tiny_models(kind) / "config.json").read_text())
    c.update(changes)
    return c


def test_unsupported_phi3_configs_say_why(tiny_models):
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(ConfigError, match="'longrope'.*LongRoPE.*not supported"):
            ModelConfig.from_dict(_config(tiny_models, "phi3", **{key: longrope}))
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "phi3", partial_rotary_factor=0.5))
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "phi3", hidden_act="gelu"))


def test_family_configs(tiny_models):
    qwen3 = ModelConfig.from_dict(_config(tiny_models, "qwen3"))
    assert qwen3.qk_norm and not qwen3.fused_checkpoint and not qwen3.attention_bias
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    phi3 = ModelConfig.from_dict(_config(tiny_models, "phi3"))
    assert phi3.fused_checkpoint and not phi3.qk_norm and phi3.rope_scaling is None
    assert phi3.checkpoint_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # a sliding window is full causal attention up to its length: the model's limit
    windowed = ModelConfig.from_dict(_config(tiny_models, "phi3", sliding_window=100))
    assert windowed.max_position_embeddings == 100
