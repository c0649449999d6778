"""Qwen3 (per-head RMSNorm on q and k), Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint
and in its PEFT adapters), Gemma 2 and Gemma 3 text ((1 + w) norms, scaled embeddings, GeGLU,
four norms a layer, soft-capping, a rope base of its own on Gemma 3's sliding layers), Granite
(embedding, residual, attention and logits multipliers; LoRA and DoRA on the residual
branches, LoRA on the tied lm_head), Gemma 1, SmolLM3 (a layer without rotary), OLMo 2
(norms on each layer's outputs; q and k normed over all heads), OLMo 3 (a sliding layer
with its own rope), Helium, Ernie 4.5, GLM and GLM-4 (rotary over interleaved pairs; GLM's
fused gate|up and partial rotary, GLM-4's four norms), EXAONE 4 (output norms, no rotary on
its global layers), Seed-OSS (a bias on o of its own) and Cohere (LayerNorms, attention and
MLP side by side, q/k norms with a weight per head) and Mixtral (a mixture of experts) in the
one parameterised model,
fp32 on CPU. Every tiny model here has 8-token sliding windows
(tests/conftest.py's TINY), shorter than the prompts and outputs.

Greedy tokens and log-probs of the base models against HF transformers run in
tests/model/test_vs_hf.py (the "qwen3", "phi3", "gemma2" and "gemma3" kinds). Here: one batch
mixing PEFT adapters (LoRA on all seven modules among them) and base rows equals PEFT request
by request, tokens and log-probs; Gemma on the Triton backend (interpreted on CPU) equals HF
in a step mixing decode rows and prompts; configurations are read as HF reads them, and the
ones slora does not serve are refused with the reason."""

import json
import math
import re
import shutil

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import LORA_MODULES, ConfigError, EngineConfig, ModelConfig, max_model_len
from slora.kernels import experts as experts_kernels
from slora.model.loader import AdapterError, PeftAdapter, strides
from tests.conftest import batch_against_peft, peft_greedy

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
    "gemma2": {
        "all": dict(r=8, lora_alpha=16, target_modules=list(LORA_MODULES)),
        "attn": dict(r=4, lora_alpha=4, use_rslora=True,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    },
    "phi4_mini": {  # q and k rows served in the partial rotary's order (B's, DoRA's)
        "fused": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"]),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["qkv_proj"]),
    },
    "granite": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "head": dict(r=6, lora_alpha=6, target_modules=["lm_head", "o_proj", "down_proj"]),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["o_proj", "down_proj",
                                                                        "v_proj"]),
    },
    "gemma": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    },
    "smollm3": {  # LoRA on the layer without rotary and on the one with it
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    },
    "olmo2": {  # q and k LoRA under the norms over all heads; o and down under the post-norms
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"k_proj": 6}),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj",
                                                                        "down_proj"]),
    },
    "olmo3": {
        "all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    },
    # interleaved rotary: q's and k's B rows (and DoRA's magnitudes) served in its order
    "helium": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "k_proj"]),
    },
    "ernie4_5": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    },
    "glm": {  # PEFT's names for GLM's modules: gate|up is one fused module
        "fused": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate_up_proj",
                                                          "down_proj"]),
        "pattern": dict(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj", "gate_up_proj"],
                        rank_pattern={"gate_up_proj": 6}),
    },
    "glm4": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    },
    "exaone4": {  # LoRA on the layer with rotary and on the one without, under output norms
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["k_proj", "o_proj"]),
    },
    "seed_oss": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    },
    "cohere": {  # o's and down's rows summed into the residual stream together
        "all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["k_proj", "down_proj"]),
    },
    "cohere_qk_norm": {
        "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"]),
    },
    "cohere2": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    },
    "mixtral": {  # LoRA on the attention (the experts take none)
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["v_proj", "o_proj"]),
    },
    # the shared expert (layer 0) and the dense MLP (layer 1) take LoRA; named by their paths,
    # as a bare gate_proj also targets the experts' stacked weights in PEFT >= 0.22
    "qwen2_moe": {
        "all": dict(r=8, lora_alpha=16,
                    target_modules=["q_proj", "v_proj", "o_proj"] + [
                        f"{mlp}.{m}_proj" for mlp in ("shared_expert", "layers.1.mlp")
                        for m in ("gate", "up", "down")],
                    rank_pattern={"shared_expert.up_proj": 4}),
        "dora": dict(r=4, lora_alpha=8, use_dora=True,
                     target_modules=["k_proj", "shared_expert.down_proj", "layers.1.mlp.down_proj"]),
    },
    "qwen3_moe": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    },
    "granitemoe": {  # o's LoRA times the residual multiplier, as o is
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    },
    "olmoe": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj"]),
    },
    # gpt-oss: LoRA on the attention under its sinks (all-linear is q/k/v/o: the experts are
    # parameters, the router takes none)
    "gpt_oss": {
        "attn": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj"]),
    },
    "gemma3": {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"up_proj": 6}),
        "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                    layers_to_transform=[0]),
    },
}


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_adapters_in_one_batch_match_peft(tiny_models, adapter_factory, kind):
    model_dir = tiny_models(kind)
    paths = {name: adapter_factory(model_dir, seed=i, **kw)
             for i, (name, kw) in enumerate(ADAPTERS[kind].items())}
    by_prompt = batch_against_peft(model_dir, paths, PROMPTS, NEW, DEVICE)
    # every adapter changes the output of some prompt (its tokens, or the log-probs of the same
    # tokens): the comparison is not base vs base
    for name in paths:
        assert any(t[name][0] != t[None][0] or t[name][1] != pytest.approx(t[None][1], abs=0.05)
                   for t in by_prompt.values()), name


def test_qk_norm_adds_the_deferred_lora_rows(tiny_models, adapter_factory):
    """On the Triton backend a decode step hands Qwen3's q|k|v output to attention, which
    norms q and k in its decode kernel, with its LoRA rows not yet added (`backend.Pending`,
    where every decode row runs MBGMV): a batch of adapters and base rows still equals
    PEFT."""
    model_dir = tiny_models("qwen3")
    paths = {name: adapter_factory(model_dir, seed=i, **kw)
             for i, (name, kw) in enumerate(ADAPTERS["qwen3"].items())}
    batch_against_peft(model_dir, paths, PROMPTS, NEW, DEVICE, backend="triton",
                       decode_lora="mbgmv", cuda_graphs=False)


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


def test_phi3_longrope_serves_its_short_window(tiny_models):
    """LongRoPE (as rope_scaling or rope_parameters; Phi-3's "su" and "yarn" spell it too) is
    served within original_max_position_embeddings, the short factors' window (HF's and slora's
    tokens agree there: test_vs_hf.py's phi3_longrope); a longer max_model_len is refused with
    the reason, as are factors that do not fit head_dim."""
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    for key, kind in (("rope_scaling", "longrope"), ("rope_parameters", "longrope"),
                      ("rope_scaling", "su"), ("rope_scaling", "yarn")):
        # (HF takes a top-level original_max_position_embeddings first, as Phi-3's configs
        # write it)
        cfg = ModelConfig.from_dict(_config(tiny_models, "phi3", max_position_embeddings=1024,
                                            original_max_position_embeddings=64,
                                            **{key: {**longrope, "rope_type": kind}}))
        assert cfg.rope_kind == "longrope" and cfg.context_window == 64, (key, kind)
        # the attention factor: sqrt(1 + ln(1024 / 64) / ln(64)), squared into the scale
        assert cfg.attn_scale == pytest.approx(16 ** -0.5 * (1 + math.log(16) / math.log(64)))
    with pytest.raises(ConfigError, match="long_factor=.* must be 8 numbers > 0"):
        ModelConfig.from_dict(_config(tiny_models, "phi3", rope_scaling={
            **longrope, "long_factor": [2.0] * 4}))
    cfg = ModelConfig.from_dict(_config(tiny_models, "phi3", rope_scaling=longrope,
                                        original_max_position_embeddings=64))
    with pytest.raises(ConfigError, match="original_max_position_embeddings 64: LongRoPE is served "
                                          "with its short factors"):
        max_model_len(EngineConfig(max_model_len=65), cfg, 100)


def test_unsupported_phi3_configs_say_why(tiny_models):
    """(A partial rotary is served: test_vs_hf.py's phi4_mini; its rows' order and scale are
    read as HF rotates them.)"""
    cfg = ModelConfig.from_dict(_config(tiny_models, "phi3", partial_rotary_factor=0.5))
    assert cfg.rotary == 8 and cfg.rotary_permutation() == [0, 1, 2, 3, 8, 9, 10, 11,
                                                            4, 5, 6, 7, 12, 13, 14, 15]
    for bad in (0.3, 0.0, 1.5):  # 0.3 * 16 = 4.8 -> 4 elements rotate: served; others not
        if bad == 0.3:
            assert ModelConfig.from_dict(_config(tiny_models, "phi3",
                                                 partial_rotary_factor=bad)).rotary == 4
            continue
        with pytest.raises(ConfigError, match=f"partial_rotary_factor={bad} must be a number"):
            ModelConfig.from_dict(_config(tiny_models, "phi3", partial_rotary_factor=bad))
    with pytest.raises(ConfigError, match="with q/k norms is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "qwen3", partial_rotary_factor=0.5))
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "phi3", hidden_act="gelu"))


def test_family_configs(tiny_models):
    qwen3 = ModelConfig.from_dict(_config(tiny_models, "qwen3"))
    assert qwen3.qk_norm and not qwen3.fused_modules and not qwen3.attention_bias
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    assert (qwen3.sliding_window, qwen3.sliding_layers) == (8, (1,))  # from max_window_layers
    no_swa = ModelConfig.from_dict(_config(tiny_models, "qwen3", use_sliding_window=False))
    assert no_swa.sliding_window is None and no_swa.window(1) == 0
    phi3 = ModelConfig.from_dict(_config(tiny_models, "phi3"))
    assert phi3.fused_modules == ("qkv_proj", "gate_up_proj") and not phi3.qk_norm
    assert phi3.rope_scaling is None
    assert phi3.checkpoint_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # a sliding window no longer bounds the context: every Phi-3 layer slides
    assert phi3.max_position_embeddings == 256 and phi3.sliding_layers == (0, 1)
    assert phi3.window(0) == phi3.window(1) == 8 and phi3.attn_scale == 16 ** -0.5
    g2 = ModelConfig.from_dict(_config(tiny_models, "gemma2"))
    assert (g2.hidden_act, g2.norm_plus_one, g2.sandwich_norms, g2.qk_norm) == \
        ("gelu_pytorch_tanh", True, True, None)
    assert g2.embed_scale == 8.0 and g2.attn_scale == 24 ** -0.5
    assert (g2.attn_softcap, g2.final_softcap) == (2.0, 3.0) and g2.tie_word_embeddings
    assert [g2.window(i) for i in range(2)] == [8, 0] and g2.rope_local_theta is None
    g3 = ModelConfig.from_dict(_config(tiny_models, "gemma3"))
    assert g3.qk_norm and g3.sandwich_norms and g3.attn_softcap is g3.final_softcap is None
    assert (g3.rope_theta, g3.rope_local_theta, g3.sliding_layers) == (10000.0, 100.0, (0,))


def test_configs_as_hf_reads_them(tiny_models):
    """Configs written before transformers 5 (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types), Mistral's window on every layer, Gemma 2's
    default alternation; Llama has no sliding window."""
    old = _config(tiny_models, "gemma3", layer_types=None, rope_parameters=None,
                  num_hidden_layers=7, rope_theta=1e6, rope_local_base_freq=1e4,
                  sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    g3 = ModelConfig.from_dict(old)
    assert g3.sliding_layers == (0, 1, 3, 4, 6) and g3.rope_local_theta == 1e4
    assert g3.rope_theta == 1e6 and g3.rope_scaling["factor"] == 8.0  # the global layers'
    g2 = ModelConfig.from_dict(_config(tiny_models, "gemma2", layer_types=None,
                                       num_hidden_layers=5))
    assert g2.sliding_layers == (0, 2, 4)
    mistral = ModelConfig.from_dict(_config(tiny_models, "mistral", sliding_window=16))
    assert mistral.sliding_layers == (0, 1) and mistral.window(1) == 16
    llama = ModelConfig.from_dict(_config(tiny_models, "llama", sliding_window=16))
    assert llama.sliding_window is None and llama.sliding_layers == ()


YARN = [  # Qwen2.5's long-context setting, DeepSeek's mscale pair, a given attention factor
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=4.0, original_max_position_embeddings=32768),
    dict(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),
    dict(factor=2.0, attention_factor=1.3, truncate=False, beta_fast=16, beta_slow=2,
         original_max_position_embeddings=128),
    dict(factor=None, original_max_position_embeddings=64),  # max_position_embeddings / 64
]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("yarn", YARN)
def test_yarn_as_hf_computes_it(tiny_models, kind, yarn):
    """YaRN's inverse frequencies equal HF's bit for bit, its attention factor is HF's (in
    attn_scale, squared), and the context window is the pretraining length times the factor
    (vLLM's rule). The end-to-end greedy match is the "qwen2_yarn" kind of test_vs_hf.py."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from slora.model.llama import rope_inv_freq

    c = _config(tiny_models, kind, rope_scaling={"rope_type": "yarn", **yarn})
    hf = transformers.AutoConfig.for_model(**c)
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_dict(c)
    assert torch.equal(rope_inv_freq(cfg), inv.float())
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(attention, rel=1e-12)
    plain = ModelConfig.from_dict(_config(tiny_models, kind))
    assert cfg.attn_scale == pytest.approx(plain.attn_scale * attention ** 2, rel=1e-12)
    factor = yarn["factor"] or 256 / 64
    assert cfg.context_window == max(256, int(yarn["original_max_position_embeddings"] * factor))


def test_yarn_configs_say_why(tiny_models):
    # a pretraining length at the top level of the config comes first, as in HF
    top = ModelConfig.from_dict(_config(
        tiny_models, "qwen2", original_max_position_embeddings=32,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}))
    assert top.rope_scaling["original_max_position_embeddings"] == 32
    assert top.context_window == 256  # 32 x 8, not past max_position_embeddings
    # the window bounds max_model_len: past max_position_embeddings, within 64 x 4
    long = ModelConfig.from_dict(_config(tiny_models, "qwen2_yarn", max_position_embeddings=64))
    assert max_model_len(EngineConfig(max_model_len=256, block_size=16), long, 64) == 256
    assert max_model_len(EngineConfig(block_size=16), long, 64) == 256  # unset: the window
    with pytest.raises(ConfigError, match=r"max_model_len=257: past the model's context window "
                       r"\(256: original_max_position_embeddings 64 x the yarn rope_scaling "):
        max_model_len(EngineConfig(max_model_len=257, block_size=16), long, 64)
    for bad, why in ((dict(factor=0.5), "factor=0.5 must be a number >= 1"),
                     (dict(factor="4"), "factor='4' must be a number >= 1"),
                     (dict(factor=4, original_max_position_embeddings=-1),
                      "original_max_position_embeddings=-1 must be an integer > 0"),
                     (dict(factor=4, attention_factor=-1.0),
                      r"attention_factor=-1.0 must be a number >= 0 \(or null\)")):
        with pytest.raises(ConfigError, match=r"rope_scaling \(yarn\) " + why):
            ModelConfig.from_dict(_config(tiny_models, "qwen2",
                                          rope_scaling={"rope_type": "yarn", **bad}))
    with pytest.raises(ConfigError, match=r"type 'dynamic' is not supported \(supported: "
                                          r"linear, llama3, yarn, longrope"):
        ModelConfig.from_dict(_config(tiny_models, "llama",
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_unsupported_gemma_configs_say_why(tiny_models):
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported.*GeGLU"):
        ModelConfig.from_dict(_config(tiny_models, "gemma2", hidden_activation="gelu"))
    with pytest.raises(ConfigError, match="attn_logit_softcapping=0 must be a number > 0"):
        ModelConfig.from_dict(_config(tiny_models, "gemma2", attn_logit_softcapping=0))
    with pytest.raises(ConfigError, match="use_bidirectional_attention=True is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "gemma3", use_bidirectional_attention=True))
    with pytest.raises(ConfigError, match="layer_types must list"):
        ModelConfig.from_dict(_config(tiny_models, "gemma2", layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="sliding_window=0 must be an integer >= 1"):
        ModelConfig.from_dict(_config(tiny_models, "gemma2", sliding_window=0))
    # a vision-language checkpoint's text model is its text_config
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration without a text_config"):
        ModelConfig.from_dict(_config(tiny_models, "gemma3",
                                      architectures=["Gemma3ForConditionalGeneration"]))
    with pytest.raises(ConfigError, match="architecture.*PaliGemmaForConditionalGeneration.*not "
                                          "supported.*Gemma3ForCausalLM.*and the text model of "
                                          "Gemma3ForConditionalGeneration"):
        ModelConfig.from_dict(_config(tiny_models, "gemma3",
                                      architectures=["PaliGemmaForConditionalGeneration"]))


def test_gemma1_smollm3_olmo_configs(tiny_models):
    """Gemma 1: (1 + w) norms, scaled embeddings, GeGLU under hidden_act's legacy "gelu", two
    norms a layer, no window. SmolLM3: its layers without rotary from no_rope_layers, or HF's
    every-fourth rule; with use_sliding_window those layers slide. OLMo 2: norms on each
    layer's outputs, q and k normed over all heads, which a tensor-parallel split refuses.
    OLMo 3: sliding layers (all but every fourth by default) with a rope of their own."""
    from slora.distributed.shapes import check_degree

    # (a config's "gelu" is the tanh approximation as transformers 5.25 reads it: the
    # activation Gemma was trained with; some earlier releases ran the exact gelu for it)
    g1 = ModelConfig.from_dict(_config(tiny_models, "gemma", hidden_act="gelu"))
    assert (g1.hidden_act, g1.norm_plus_one, g1.sandwich_norms, g1.pre_norms, g1.qk_norm) == \
        ("gelu_pytorch_tanh", True, False, True, None)
    assert g1.embed_scale == 8.0 and g1.attn_scale == 32 ** -0.5 and g1.sliding_layers == ()
    s3 = ModelConfig.from_dict(_config(tiny_models, "smollm3"))
    assert s3.nope_layers == (1,) and s3.sliding_window is None and s3.o_bias
    hf_rule = ModelConfig.from_dict(_config(
        tiny_models, "smollm3", no_rope_layers=None, layer_types=None, num_hidden_layers=8,
        use_sliding_window=True, sliding_window=16))
    assert hf_rule.nope_layers == (3, 7) and hf_rule.sliding_layers == (3, 7)
    with pytest.raises(ConfigError, match="no_rope_layers must list 0 .* for each of the 2"):
        ModelConfig.from_dict(_config(tiny_models, "smollm3", no_rope_layers=[1, 2]))
    o2 = ModelConfig.from_dict(_config(tiny_models, "olmo2"))
    assert (o2.qk_norm, o2.pre_norms, o2.sandwich_norms, o2.sliding_layers) == \
        ("all", False, False, ())
    from safetensors.torch import load_file  # every fp32 tensor of the checkpoint, counted
    tensors = load_file(str(tiny_models("olmo2") / "model.safetensors"))
    assert o2.weight_bytes(4) == sum(4 * t.numel() for t in tensors.values())
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 with q/k norms"):
        ModelConfig.from_dict(_config(tiny_models, "olmo2", partial_rotary_factor=0.5))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*q and k norms"):
        check_degree(o2, 2)
    check_degree(ModelConfig.from_dict(_config(tiny_models, "qwen3")), 2)  # (per-head norms)
    # OLMo 3: YaRN on the full layers; the sliding ones keep their own rope, unscaled
    g3 = ModelConfig.from_dict(_config(tiny_models, "gemma3_yarn"))  # (as OLMo 3's below)
    assert (g3.rope_kind, g3.rope_local_theta, g3.attn_scale_local) == ("yarn", 100.0, 48 ** -0.5)
    assert g3.attn_scale == pytest.approx(g3.rope_attention_factor ** 2 / math.sqrt(48))
    o3 = ModelConfig.from_dict(_config(tiny_models, "olmo3"))
    assert (o3.qk_norm, o3.pre_norms, o3.sliding_layers, o3.window(0), o3.window(1)) == \
        ("all", False, (0,), 8, 0)
    assert (o3.rope_theta, o3.rope_local_theta, o3.rope_kind) == (10000.0, 500.0, "yarn")
    assert o3.attn_scale == pytest.approx(o3.rope_attention_factor ** 2 / math.sqrt(16))
    assert o3.attn_scale_local == 16 ** -0.5 and o3.rope_attention_factor > 1
    hf_rule = ModelConfig.from_dict(_config(tiny_models, "olmo3", layer_types=None,
                                            num_hidden_layers=8))
    assert hf_rule.sliding_layers == (0, 1, 2, 4, 5, 6)


def test_interleaved_rope_families_configs(tiny_models):
    """Helium, Ernie 4.5, GLM and GLM-4 rotate interleaved pairs (2i, 2i + 1): each q and k
    head is served with the pairs' first elements, then their second (HF's unrotated
    elements split between the halves where rotary covers part of the head, GLM's half).
    GLM holds gate|up fused and its adapters target that name; GLM-4 adds four norms a layer;
    Helium and GLM bias q/k/v and not o; Ernie 4.5's use_bias would bias the MLP too."""
    helium = ModelConfig.from_dict(_config(tiny_models, "helium"))
    assert helium.interleaved_rope and helium.attention_bias and not helium.o_bias
    assert helium.rotary_permutation() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    glm = ModelConfig.from_dict(_config(tiny_models, "glm"))
    assert (glm.rotary, glm.fused_modules, glm.attention_bias, glm.o_bias) == \
        (16, ("gate_up_proj",), True, False)
    assert glm.rotary_permutation() == [*range(0, 16, 2), *range(16, 24),
                                        *range(1, 16, 2), *range(24, 32)]
    assert glm.checkpoint_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                      "down_proj")
    glm4 = ModelConfig.from_dict(_config(tiny_models, "glm4"))
    assert glm4.sandwich_norms and glm4.fused_modules == ("gate_up_proj",)
    ernie = ModelConfig.from_dict(_config(tiny_models, "ernie4_5"))
    assert ernie.interleaved_rope and not (ernie.attention_bias or ernie.mlp_bias)
    biased = ModelConfig.from_dict(_config(tiny_models, "ernie4_5", use_bias=True))
    assert biased.attention_bias and biased.o_bias and biased.mlp_bias
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        from slora.model.loader import load_weights
        load_weights(tiny_models("ernie4_5"), biased, torch.float32, torch.device("cpu"))


def test_exaone4_and_seed_oss_configs(tiny_models):
    """EXAONE 4 norms its layers' outputs and each head of q and k; with a sliding window its
    global layers take no rotary, without one every layer does; its sliding layers come from
    layer_types, else all but every sliding_window_pattern-th. Seed-OSS biases o by
    attention_out_bias, apart from q/k/v's attention_bias."""
    ex = ModelConfig.from_dict(_config(tiny_models, "exaone4"))
    assert (ex.pre_norms, ex.qk_norm, ex.sliding_layers, ex.nope_layers) == \
        (False, "head", (0,), (1,))
    no_window = ModelConfig.from_dict(_config(tiny_models, "exaone4", sliding_window=None))
    assert no_window.sliding_layers == () and no_window.nope_layers == ()
    pattern = ModelConfig.from_dict(_config(tiny_models, "exaone4", layer_types=None,
                                            num_hidden_layers=6, sliding_window_pattern=3))
    assert pattern.sliding_layers == (0, 1, 3, 4) and pattern.nope_layers == (2, 5)
    with pytest.raises(ConfigError, match="sliding_window_pattern='LLG' without layer_types"):
        ModelConfig.from_dict(_config(tiny_models, "exaone4", layer_types=None,
                                      sliding_window_pattern="LLG"))
    seed = ModelConfig.from_dict(_config(tiny_models, "seed_oss"))
    assert seed.attention_bias and seed.o_bias
    assert not ModelConfig.from_dict(_config(tiny_models, "seed_oss",
                                             attention_out_bias=False)).o_bias


def test_cohere_configs(tiny_models):
    """Cohere: LayerNorms (layer_norm_eps), one a layer, attention and MLP side by side,
    interleaved rotary, logits times logit_scale (divided by its inverse); use_qk_norm's
    per-head weights, which a tensor-parallel split refuses. Cohere 2 adds sliding layers,
    the only ones with rotary."""
    from slora.distributed.shapes import check_degree

    c = ModelConfig.from_dict(_config(tiny_models, "cohere", layer_norm_eps=1e-3))
    assert (c.layer_norm, c.parallel_block, c.interleaved_rope, c.qk_norm) == \
        (True, True, True, None)
    assert (c.rms_norm_eps, c.logits_scaling, c.attention_bias, c.o_bias) == (1e-3, 4.0, True, True)
    check_degree(c, 2)
    qk = ModelConfig.from_dict(_config(tiny_models, "cohere_qk_norm"))
    assert qk.qk_norm == "heads" and qk.logits_scaling == 16.0  # (HF's default logit_scale)
    from safetensors.torch import load_file  # every fp32 tensor of the checkpoint, counted
    tensors = load_file(str(tiny_models("cohere_qk_norm") / "model.safetensors"))
    assert qk.weight_bytes(4) == sum(4 * t.numel() for t in tensors.values())
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*a weight for each head"):
        check_degree(qk, 2)
    with pytest.raises(ConfigError, match="logit_scale=0 must be a number > 0"):
        ModelConfig.from_dict(_config(tiny_models, "cohere", logit_scale=0))
    # Cohere 2: rotary on its sliding layers alone (every fourth global, without layer_types)
    c2 = ModelConfig.from_dict(_config(tiny_models, "cohere2"))
    assert (c2.layer_norm, c2.parallel_block, c2.sliding_layers, c2.nope_layers) == \
        (True, True, (0,), (1,))
    old = ModelConfig.from_dict(_config(tiny_models, "cohere2", layer_types=None,
                                        num_hidden_layers=8))
    assert old.sliding_layers == (0, 1, 2, 4, 5, 6) and old.nope_layers == (3, 7)


def test_mixtral_config_and_what_it_refuses(tiny_models, adapter_factory, tmp_path):
    """Mixtral: its experts and top-k read from config.json and counted in the weights'
    bytes; adapters on the attention serve, on the experts are refused naming the modules,
    as are FP8 weights and a tensor-parallel degree its experts' width does not split over."""
    from safetensors.torch import load_file

    from slora.distributed.shapes import check_degree

    model_dir = tiny_models("mixtral")
    m = ModelConfig.from_dict(_config(tiny_models, "mixtral"))
    assert (m.num_experts, m.experts_per_token) == (4, 2)
    assert m.checkpoint_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert m.weight_bytes(4) == sum(4 * t.numel() for t in tensors.values())
    with pytest.raises(ConfigError, match="num_local_experts=4 and num_experts_per_tok=5"):
        ModelConfig.from_dict(_config(tiny_models, "mixtral", num_experts_per_tok=5))
    check_degree(m, 2)  # (each expert splits on its rows: tests/distributed)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3.*experts' intermediate size "
                                          "128 is not divisible by 3"):
        check_degree(m, 3)
    with pytest.raises(ConfigError, match="quantization='fp8' is not supported with a "
                                          "mixture-of-experts model"):
        Engine(EngineConfig(model=str(model_dir), device="cpu", quantization="fp8",
                            num_pages=16))
    e = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=32))
    experts = adapter_factory(model_dir, target_modules=["q_proj", "w1", "w2", "w3"])
    with pytest.raises(AdapterError, match=r"target_parameters=\[.*'gate_up_proj'.*\] "
                                           r"is not supported .* served: target_modules among "
                                           r"q_proj, k_proj, v_proj, o_proj"):
        e.add_adapter("experts", experts)  # (PEFT's form of LoRA on the experts)
    conf = json.loads((experts / "adapter_config.json").read_text())
    conf.update(target_modules=["q_proj", "w2"], target_parameters=None)
    (experts / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(AdapterError, match=r"target_modules \['w2'\] are not linear modules "
                                           r"of this MixtralForCausalLM model"):
        e.add_adapter("experts", experts)
    assert e.list_adapters() == []


def test_gpt_oss_config_and_its_mxfp4_experts(tiny_models, tmp_path):
    """gpt-oss: sinks, biases and the clamped SwiGLU read from config.json (HF's defaults
    where it is silent), a bad limit refused; an MXFP4 checkpoint (gpt-oss's released form:
    the experts' E2M1 blocks and E8M0 scales) serves the tokens and log-probs of the same
    experts as transformers dequantizes them, stored in float32."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = _config(tiny_models, "gpt_oss")
    m = ModelConfig.from_dict(raw)
    assert (m.hidden_act, m.swiglu_limit, m.swiglu_alpha, m.experts_bias, m.attention_sinks,
            m.attention_bias, m.o_bias, m.sliding_layers) == (
        "swiglu_oai", 1.5, 1.702, True, True, True, True, (0,))
    assert m.rope_scaling["truncate"] is False
    bare = {k: v for k, v in raw.items() if k not in ("swiglu_limit", "swiglu_alpha",
                                                       "attention_bias")}
    d = ModelConfig.from_dict(bare)
    assert (d.swiglu_limit, d.swiglu_alpha, d.attention_bias) == (7.0, 1.702, True)
    with pytest.raises(ConfigError, match="swiglu_limit=-1 must be a number > 0"):
        ModelConfig.from_dict(dict(raw, swiglu_limit=-1))

    src = tiny_models("gpt_oss")
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    for d in (plain, packed):
        shutil.copytree(src, d)
    quantized = dict(tensors)
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        E, rows_in, out = tensors[key].shape  # HF's [E, in, out]
        blocks = torch.randint(0, 256, (E, out, rows_in // 32, 16), generator=g,
                               dtype=torch.uint8)
        scales = torch.randint(121, 125, (E, out, rows_in // 32), generator=g,
                               dtype=torch.uint8)
        tensors[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del quantized[key]
        quantized[key + "_blocks"], quantized[key + "_scales"] = blocks, scales
    save_file(tensors, str(plain / "model.safetensors"))
    save_file(quantized, str(packed / "model.safetensors"))
    conf = json.loads((packed / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (packed / "config.json").write_text(json.dumps(conf))
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    outs = [Engine(EngineConfig(model=str(d), device="cpu", dtype="float32", num_pages=32))
            .generate(PROMPTS, sp) for d in (plain, packed)]
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_generation_config_eos_ids_stop_generation(tiny_models, tmp_path):
    """generation_config.json's eos_token_id joins config.json's as stop ids (gpt-oss ends a
    tool call with <|call|>, named there alone); one that is not token ids is refused."""
    model = tmp_path / "m"
    shutil.copytree(tiny_models("llama"), model)
    sp = SamplingParams(max_tokens=8)
    free = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                               num_pages=32)).generate(PROMPTS[0], sp)[0]
    stop = free.token_ids[2]
    assert stop not in free.token_ids[:2] and free.finish_reason == "length"
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    assert stop in ModelConfig.from_dir(model).eos_token_ids
    out = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                              num_pages=32)).generate(PROMPTS[0], sp)[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        ModelConfig.from_dir(model)


def test_qwen_moe_config_and_what_it_refuses(tiny_models, adapter_factory, tmp_path):
    """Qwen2-MoE, Qwen3-MoE (and OLMoE's config): experts, top-k, their width and
    renormalisation, the dense layers (mlp_only_layers, decoder_sparse_step) and Qwen2-MoE's
    shared expert read from config.json and counted in the weights' bytes; LoRA on the shared
    expert and the dense layers serves, on the experts (PEFT's per-expert keys) or on an MLP
    the layer lacks is refused naming the tensor and the reason."""
    from safetensors.torch import load_file, save_file

    q2 = ModelConfig.from_dict(_config(tiny_models, "qwen2_moe"))
    assert (q2.num_experts, q2.experts_per_token, q2.expert_intermediate_size, q2.norm_topk_prob,
            q2.dense_layers, q2.shared_expert, q2.intermediate_size, q2.attention_bias) == \
        (4, 2, 48, False, (1,), True, 128, True)
    assert [q2.mlp_path(i) for i in range(2)] == ["mlp.shared_expert", "mlp"]
    assert "down_proj" in q2.checkpoint_modules
    q3 = ModelConfig.from_dict(_config(tiny_models, "qwen3_moe"))
    assert (q3.num_experts, q3.norm_topk_prob, q3.dense_layers, q3.shared_expert,
            q3.qk_norm) == (4, True, (), False, "head")
    assert q3.checkpoint_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    for kind, cfg in (("qwen2_moe", q2), ("qwen3_moe", q3)):
        tensors = load_file(str(tiny_models(kind) / "model.safetensors"))
        assert cfg.weight_bytes(4) == sum(4 * t.numel() for k, t in tensors.items()
                                          if not k.endswith("bias")), kind
    # Qwen's num_experts (as its released configs spell it); every second layer sparse
    sparse = ModelConfig.from_dict({**_config(tiny_models, "qwen3_moe", num_experts=8,
                                              decoder_sparse_step=2, num_hidden_layers=4)})
    assert (sparse.num_experts, sparse.dense_layers) == (8, (0, 2))
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size 96 are not supported"):
        ModelConfig.from_dict(_config(tiny_models, "qwen2_moe", shared_expert_intermediate_size=96))
    with pytest.raises(ConfigError, match="moe_intermediate_size=0 must be an integer >= 1"):
        ModelConfig.from_dict(_config(tiny_models, "qwen3_moe", moe_intermediate_size=0))
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 must be integers"):
        ModelConfig.from_dict(_config(tiny_models, "qwen3_moe", num_experts_per_tok=9))
    # OLMoE: OLMo 2's q/k norms with input norms, experts of intermediate_size, no clipping
    olmoe = ModelConfig.from_dict(_config(tiny_models, "olmoe"))
    assert (olmoe.pre_norms, olmoe.qk_norm, olmoe.num_experts, olmoe.expert_intermediate_size,
            olmoe.norm_topk_prob, olmoe.dense_layers) == (True, "all", 4, 128, False, ())
    with pytest.raises(ConfigError, match="clip_qkv=8.0 is not supported"):
        ModelConfig.from_dict(_config(tiny_models, "olmoe", clip_qkv=8.0))

    model_dir = tiny_models("qwen2_moe")
    e = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=32))
    good = adapter_factory(model_dir, target_modules=["q_proj", "shared_expert.gate_proj"])
    weights = load_file(str(good / "adapter_model.safetensors"))
    assert any(".mlp.shared_expert.gate_proj." in k for k in weights)
    e.add_adapter("good", good)
    pre = "base_model.model.model.layers."
    cases = {  # key renamed -> the reason named
        (pre + "0.mlp.shared_expert.gate_proj", pre + "0.mlp.experts.1.gate_proj"):
            "LoRA on a mixture of experts' experts is not supported",
        (pre + "0.mlp.shared_expert.gate_proj", pre + "0.mlp.gate_proj"):
            "layer 0's dense MLP is model.layers.0.mlp.shared_expert",
        # (PEFT >= 0.22's LoRA on the stacked experts, where a target names their weights)
        (pre + "0.mlp.shared_expert.gate_proj", pre + "0.mlp.experts"):
            "LoRA on a mixture of experts' experts is not supported",
    }
    for n, ((old, new), why) in enumerate(cases.items()):
        bad = tmp_path / f"bad{n}"
        shutil.copytree(good, bad)
        save_file({k.replace(old, new): v for k, v in weights.items()},
                  str(bad / "adapter_model.safetensors"))
        with pytest.raises(AdapterError, match=re.escape(new) + ".*" + re.escape(why)):
            e.add_adapter("bad", bad)
    assert e.list_adapters() == ["good"]
    e3 = Engine(EngineConfig(model=str(tiny_models("qwen3_moe")), device="cpu",
                             dtype="float32", num_pages=32))
    bad = tmp_path / "qwen3"
    shutil.copytree(good, bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj"]}))
    save_file({k.replace(pre + "0.mlp.shared_expert.gate_proj", pre + "1.mlp.gate_proj"): v
               for k, v in weights.items()}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"this Qwen3MoeForCausalLM model has no gate_proj"):
        e3.add_adapter("bad", bad)


def test_moe_experts_forms_agree(tiny_models, monkeypatch):
    """EngineConfig.moe_experts: the picked experts as grouped GEMMs, every expert on every
    token, and the fused Triton kernels at every step (prompts included) give the same greedy
    tokens and log-probs; "grouped" where torch's grouped GEMM would need a host sync, and
    "fused" on the torch backend, are refused naming what to use instead."""
    import slora.model.llama as llama

    model = str(tiny_models("qwen2_moe"))
    prompts = ["Hello", "The quick brown fox jumps"]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    runs = {}
    # the twins on the CPU; the Triton backend's fused experts beside its dense ones on the
    # GPU where there is one (float32: no grouped GEMM there), else interpreted
    for experts, backend in (("grouped", "torch"), ("dense", "torch"), ("fused", "triton"),
                             ("dense", "triton")):
        e = Engine(EngineConfig(model=model, device="cpu" if backend == "torch" else DEVICE,
                                dtype="float32", num_pages=32, moe_experts=experts,
                                backend=backend, cuda_graphs=False))
        assert (e.runner.model.fused_experts_rows > 1000) == (experts == "fused")
        assert e.runner.model.grouped_experts == (experts == "grouped" or experts == "fused"
                                                  and DEVICE == "cpu")
        runs[experts, backend] = e.generate(prompts, sp)
    for a, b in ((("grouped", "torch"), ("dense", "torch")),
                 (("fused", "triton"), ("dense", "triton"))):
        for g, d in zip(runs[a], runs[b]):
            assert g.token_ids == d.token_ids
            assert [lp[t] for lp, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
                [lp[t] for lp, t in zip(d.logprobs, d.token_ids)], abs=1e-5)
    with pytest.raises(ConfigError, match="EngineConfig.moe_experts='fast': expected one of"):
        EngineConfig(moe_experts="fast")
    with pytest.raises(ConfigError, match="moe_experts='fused'.*backend is 'torch'.*'auto'"):
        Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=32,
                            moe_experts="fused", backend="torch"))
    monkeypatch.setattr(llama, "grouped_gemm", lambda like: False)
    with pytest.raises(ConfigError, match="moe_experts='grouped'.*use 'dense' or 'auto'"):
        Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=32,
                            moe_experts="grouped"))
    auto = Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=32))
    assert not auto.runner.model.grouped_experts
    assert auto.runner.model.fused_experts_rows == 0  # (the CPU's backend: torch)
    triton = Engine(EngineConfig(model=model, device=DEVICE, dtype="float32", num_pages=32,
                                 backend="triton", cuda_graphs=False))
    assert triton.runner.model.fused_experts_rows == experts_kernels.few_rows(4, 2)


def test_gemma_norms_fold_one_plus_w_exactly(tiny_models):
    """Gemma's (1 + w) norms are stored as float32 w + 1 (the value HF computes at each call),
    in a bfloat16 model too, where 1 + w in bfloat16 would lose w's low bits."""
    from safetensors.torch import load_file

    from slora.model.loader import load_weights

    d = tiny_models("gemma3")
    cfg = ModelConfig.from_dir(d)
    raw = load_file(d / "model.safetensors")
    for dtype in (torch.float32, torch.bfloat16):
        w = load_weights(d, cfg, dtype, torch.device("cpu"))
        pre = "model.layers.1."
        expect = {"ln1": "input_layernorm", "post_attn": "post_attention_layernorm",
                  "ln2": "pre_feedforward_layernorm", "post_mlp": "post_feedforward_layernorm",
                  "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        for field, name in expect.items():
            got = getattr(w.layers[1], field)
            src = raw[pre + name + ".weight"].to(dtype).float()
            assert got.dtype == torch.float32 and torch.equal(got, src + 1), (dtype, field)
        assert torch.equal(w.norm, raw["model.norm.weight"].to(dtype).float() + 1)
        assert w.embed.dtype == dtype


@pytest.mark.parametrize("kind", ["gemma2", "olmo2", "smollm3", "cohere", "cohere_qk_norm",
                                  "qwen3", "mixtral", "qwen2_moe", "gpt_oss"])
def test_triton_backend_matches_hf(tiny_models, kind):
    """The Triton kernels in Gemma 2 (sliding-window and soft-capped attention in decode and
    prefill, GeGLU, norms with float32 weights), OLMo 2 (residual adds without input norms,
    so no LoRA rows handed to them; q and k normed whole), SmolLM3 (a layer without rotary,
    in the fused decode kernel too), Cohere (LayerNorms in the fused norm kernel, attention
    and MLP side by side; with use_qk_norm, q's and k's heads LayerNormed under weights of
    their own), Qwen3 (q's and k's heads normed under one weight), Mixtral (the experts' GLU
    through the fused kernel; a decode step's experts through slora.kernels.experts),
    Qwen2-MoE (a shared expert through the LoRA GEMMs beside its experts) and gpt-oss
    (attention sinks in the decode and prefill kernels, the experts' biases and clamped
    SwiGLU in the fused kernels): a step mixing decode rows with prompts (longer than
    Gemma's window), then decode past it, equal HF's greedy tokens and log-probs."""
    model_dir = tiny_models(kind)
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=48, backend="triton", cuda_graphs=False))
    prompts = ["Hello", "The quick brown fox", "Serving many LoRA adapters"]
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in (12, 5, 5)]
    ids = [engine.add_request(prompts[0], sps[0])]
    done = {o.request_id: o for o in engine.step() if o.finished}
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[1:], sps[1:])]
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for prompt, sp, i in zip(prompts, sps, ids):
        out = done[i]
        toks, lps = peft_greedy(model_dir, None, engine.tokenizer.encode(prompt), sp.max_tokens,
                                DEVICE)
        assert out.token_ids == toks, f"{kind}: {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"{kind}: {prompt!r}"


def test_granite_config_is_read_as_hf_reads_it(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models("granite"))
    assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == (3.0, 0.4, 0.3, 2.5)
    assert cfg.attn_scale == 0.3 and cfg.tie_word_embeddings
    raw = json.loads((tiny_models("granite") / "config.json").read_text())
    with pytest.raises(ConfigError, match="residual_multiplier=-1 must be a number > 0"):
        ModelConfig.from_dict({**raw, "residual_multiplier": -1})
    # the multipliers belong to Granite: a Llama config that carries one is read without it
    llama = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    assert (llama.embed_multiplier, llama.residual_multiplier, llama.logits_scaling) == (
        None, 1.0, 1.0)
