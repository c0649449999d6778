"""Shared fixtures: tiny random Llama-family models with a real (tiny) tokenizer, and PEFT
adapters for them. transformers and peft are used here as references only."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# The tests' tensors are tiny: one thread is faster, and far faster on a busy machine
# (./run sets OMP_NUM_THREADS=1 too; this covers a bare `pytest`).
torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when its kernels are first imported: set it before any test
# module imports slora.kernels, so without a GPU every Triton kernel runs interpreted on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving many LoRA adapters from one GPU needs a unified memory pool.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20

# name -> kwargs of the HF config. Small, but covering GQA/MQA, tied embeddings, head_dim that
# differs from hidden/heads, q/k/v bias (Qwen2), attention_bias (Llama), rope scaling (linear,
# llama3, YaRN), per-head q/k RMSNorm (Qwen3), fused qkv_proj / gate_up_proj (Phi-3), Gemma 2
# / 3 ((1 + w) norms, scaled embeddings, GeGLU, four norms a layer, query_pre_attn_scalar,
# soft-capping, a rope base of its own on Gemma 3's sliding layers), Phi-3's LongRoPE, a
# partial rotary (Phi-4-mini), Granite (embedding,
# residual, attention and logits multipliers, tied embeddings), Gemma 1 ((1 + w) norms, scaled
# embeddings, GeGLU), SmolLM3 (a layer without rotary), OLMo 2
# (norms on each layer's outputs, not its inputs; q and k normed over all heads), OLMo 3 (its
# sliding layer's own unscaled rope beside YaRN on the full one). Sliding windows of 8
# tokens, shorter than the tests' prompts plus outputs: on every layer (Mistral, Phi-3), on
# layer 1 (Qwen3), on layer 0 (Gemma).
# `random_norms` draws every RMSNorm weight around its initial value (HF's ones, or Gemma's
# zeros) instead of leaving it there, so that a norm applied wrongly shows; `random_biases`
# draws every bias (HF's are zeros), so that a bias left out shows.
TINY = {
    "llama": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama_tied_llama3": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1,
                              tie_word_embeddings=True,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16}),
    "llama_headdim_linear": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4,
                                 head_dim=32, attention_bias=True,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=8),
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True),
    "qwen2_yarn": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 64}),
    "qwen3": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  random_norms=True, use_sliding_window=True, sliding_window=8,
                  max_window_layers=1),
    "phi3": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
                 random_norms=True, sliding_window=8),
    "gemma2": dict(arch="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, random_norms=True),
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                   query_pre_attn_scalar=48, sliding_window=8, sliding_window_pattern=2,
                   rope_theta=10000.0, rope_local_base_freq=100.0, random_norms=True),
    # Gemma 3 with YaRN on its global layer: the sliding one keeps its own rope, unscaled
    "gemma3_yarn": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, query_pre_attn_scalar=48, sliding_window=8,
                        sliding_window_pattern=2, random_norms=True,
                        rope_parameters={"full_attention": {
                            "rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64, "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # Phi-3.5's LongRoPE, served within original_max_position_embeddings (its short factors)
    "phi3_longrope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2,
                          pad_token_id=None, max_position_embeddings=1024,
                          original_max_position_embeddings=128,
                          rope_scaling={"type": "longrope",
                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                        "long_factor": [1.5, 2, 3, 5, 8, 13, 21, 34]}),
    # Phi-4-mini's shape: a partial rotary (3/4 of each head), LongRoPE, tied embeddings
    "phi4_mini": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2,
                      pad_token_id=None, partial_rotary_factor=0.75, tie_word_embeddings=True,
                      max_position_embeddings=1024, original_max_position_embeddings=128,
                      rope_scaling={"type": "longrope",
                                    "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.4],
                                    "long_factor": [2, 3, 5, 8, 13, 21]}, random_norms=True),
    "granite": dict(arch="granite", num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=True, embedding_multiplier=3.0, residual_multiplier=0.4,
                    attention_multiplier=0.3, logits_scaling=2.5, random_norms=True),
    "gemma": dict(arch="gemma", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  hidden_act="gelu_pytorch_tanh", random_norms=True),
    "smollm3": dict(arch="smollm3", num_attention_heads=4, num_key_value_heads=2,
                    pad_token_id=None, no_rope_layers=[1, 0], attention_bias=True),
    "olmo2": dict(arch="olmo2", num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, random_norms=True),
    # OLMo 3: OLMo 2 with a sliding layer whose rope (base 500, unscaled) is not the full
    # layer's (YaRN)
    "olmo3": dict(arch="olmo3", num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64,
                                                      "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 500.0}},
                  random_norms=True),
    # rotary over interleaved pairs (2i, 2i + 1): Helium (q/k/v biases, none on o), Ernie 4.5,
    # GLM (half of each head rotated, q/k/v biases, gate|up fused in the checkpoint) and GLM-4
    # (GLM with four norms a layer)
    "helium": dict(arch="helium", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   attention_bias=True, pad_token_id=None, random_biases=True),
    "ernie4_5": dict(arch="ernie4_5", num_attention_heads=4, num_key_value_heads=2,
                     pad_token_id=None),
    "glm": dict(arch="glm", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                partial_rotary_factor=0.5, pad_token_id=None, random_norms=True,
                random_biases=True),
    "glm4": dict(arch="glm4", num_attention_heads=4, num_key_value_heads=2,
                 partial_rotary_factor=0.5, pad_token_id=None, random_norms=True,
                 random_biases=True),
    # EXAONE 4: OLMo's norms on the outputs, per-head q/k norms, a sliding layer with rotary
    # and a global one without; Seed-OSS: biases on q/k/v and on o
    "exaone4": dict(arch="exaone4", num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    pad_token_id=None, random_norms=True),
    "seed_oss": dict(arch="seed_oss", num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, attention_bias=True, attention_out_bias=True,
                     pad_token_id=None, random_biases=True),
    # Cohere (Command R): LayerNorms, attention and MLP side by side on one norm, interleaved
    # rotary, logits times logit_scale; with use_qk_norm (Command R+) q and k LayerNormed
    # per head under each head's own weight
    "cohere": dict(arch="cohere", num_attention_heads=4, num_key_value_heads=2,
                   logit_scale=0.25, attention_bias=True, pad_token_id=None, random_norms=True,
                   random_biases=True),
    "cohere_qk_norm": dict(arch="cohere", num_attention_heads=4, num_key_value_heads=2,
                           use_qk_norm=True, pad_token_id=None, random_norms=True),
    # Cohere 2 (Command R7B): Cohere with a sliding layer (rotary) and a global one (none)
    "cohere2": dict(arch="cohere2", num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    logit_scale=0.5, pad_token_id=None, random_norms=True),
    # Mixtral: a mixture of 4 experts a layer, 2 picked for each token
    "mixtral": dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2),
    # Qwen2-MoE: 4 experts and a gated shared expert in layer 0, a dense MLP in layer 1, the
    # picked experts' weights not renormalised; Qwen3-MoE: experts alone, renormalised, with
    # per-head q/k norms
    "qwen2_moe": dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=128, mlp_only_layers=[1],
                      norm_topk_prob=False, random_biases=True),
    "qwen3_moe": dict(arch="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, random_norms=True),
    # OLMoE: experts alone in every layer (not renormalised), q and k normed over all heads
    "olmoe": dict(arch="olmoe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, random_norms=True),
    # Granite MoE: Granite's four multipliers around experts stored stacked
    "granitemoe": dict(arch="granitemoe", num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
                       residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5,
                       random_norms=True),
    # gpt-oss: attention sinks, biases on q/k/v/o, a sliding layer and a full one (YaRN),
    # experts with biases, a biased router and the clamped SwiGLU over interleaved gate/up
    "gpt_oss": dict(arch="gpt_oss", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 64},
                    pad_token_id=None, random_norms=True, random_biases=True),
}


def _tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "chat_template": '
        '"{% for m in messages %}<{{ m.role }}>{{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}<assistant>{% endif %}"}')
    return tok.get_vocab_size()


def build_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny random model of `kind` (TINY) saved at `path`; `overrides`: config fields."""
    import transformers

    spec = {"max_position_embeddings": 256, **TINY[kind], **overrides}
    arch = spec.pop("arch")
    random_norms = spec.pop("random_norms", False)
    random_biases = spec.pop("random_biases", False)
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
           "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
           "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
           "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
           "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
           "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
           "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
           "helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM),
           "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
           "glm": (transformers.GlmConfig, transformers.GlmForCausalLM),
           "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
           "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
           "seed_oss": (transformers.SeedOssConfig, transformers.SeedOssForCausalLM),
           "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
           "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
           "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
           "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}[arch]
    cfg = cls[0](vocab_size=vocab + 20, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, bos_token_id=0,
                 eos_token_id=1, initializer_range=0.2, **spec)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if random_norms and name.endswith("norm.weight"):
                p.normal_(float(p.mean()), 0.2)
            if random_biases and name.endswith("bias"):
                p.normal_(0.0, 0.2)
            if name.endswith("sinks"):  # (gpt-oss) sinks that take a visible share
                p.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> model dir, built on first use and shared by the whole test run."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(kind: str = "llama") -> Path:
        if kind not in cache:
            cache[kind] = build_tiny_model(root / kind, kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models) -> Path:
    return tiny_models("llama")


def make_adapter(model_dir: Path, path: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter with random (non-zero) A and B for a tiny model."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    kwargs = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                  init_lora_weights=False)
    kwargs.update(lora_kwargs)
    model = peft.get_peft_model(base, peft.LoraConfig(**kwargs))
    # init_lora_weights=False draws B small; make adapters change outputs clearly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def hf_model(model_dir):
    """The HF transformers model at model_dir in fp32, as the references run it: eager
    attention, the one HF implementation that applies every family's attention options
    (Gemma 2's soft-capping is skipped by some versions' SDPA path); gpt-oss's experts under
    the config's swiglu_limit and swiglu_alpha, which slora reads and some transformers
    versions replace by the released model's 7.0 and 1.702."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    for m in model.modules():
        if type(m).__name__ == "GptOssExperts":
            m.limit = model.config.swiglu_limit
            m.alpha = getattr(model.config, "swiglu_alpha", 1.702)
    return model


def peft_greedy(model_dir, adapter_path, ids, n, device="cpu", transform=None):
    """PEFT's (or, without an adapter, HF's) greedy tokens and their log-probs for one prompt
    run alone, in fp32 on `device`; `transform(model)` edits the base model first."""
    import peft

    model = hf_model(model_dir)
    if transform is not None:
        transform(model)
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path)
    model = model.to(device).eval()
    x = torch.tensor([ids], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


def batch_against_peft(model_dir, paths, prompts, new, device="cpu", transform=None,
                       **engine_kw):
    """Every prompt with every adapter of `paths` (name -> PEFT dir) and the base model, in one
    engine batch (fp32), against `peft_greedy` request by request: greedy tokens equal,
    log-probs within 1e-3. Returns {prompt: {adapter name or None: (tokens, log-probs)}}."""
    from slora import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                 num_pages=128, **engine_kw))
    for name, path in paths.items():
        engine.add_adapter(name, path)
    jobs = [(p, a) for p in prompts for a in (None, *paths)]
    sp = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=1)
    outs = engine.generate([p for p, _ in jobs], sp, adapters=[a for _, a in jobs])
    got = {}
    for (prompt, name), out in zip(jobs, outs):
        toks, lps = peft_greedy(model_dir, paths.get(name), engine.tokenizer.encode(prompt), new,
                                device, transform)
        assert out.token_ids == toks, f"adapter {name}, prompt {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"adapter {name}, prompt {prompt!r}"
        got.setdefault(prompt, {})[name] = (out.token_ids, mine)
    return got


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    counter = iter(range(10**6))

    def make(model_dir: Path, **kwargs) -> Path:
        return make_adapter(model_dir, root / f"a{next(counter)}", **kwargs)

    return make
