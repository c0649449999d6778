"""The text model of a vision-language checkpoint (`config.MULTIMODAL`: Gemma 3 4B and up ship
as Gemma3ForConditionalGeneration, Mistral Small 3.1 as Mistral3ForConditionalGeneration):
slora serves its language model, and an adapter trained on the whole model (its LoRA on the
vision tower too) serves as PEFT runs it on text. The reference is HF transformers' and PEFT's
model of the whole checkpoint, fed text alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ModelConfig

PROMPTS = ["The quick brown fox", "Serving many LoRA adapters from one GPU needs"]
NEW = 12


def _model_class(kind: str):
    import transformers

    return {"gemma3": transformers.Gemma3ForConditionalGeneration,
            "mistral": transformers.Mistral3ForConditionalGeneration}[kind]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def vlm(request, tiny_models, tmp_path_factory) -> Path:
    """A tiny vision-language model: the tiny text model's shape (Gemma 3's or Mistral's)
    beside a one-layer vision tower (SigLIP's or Pixtral's), random weights, saved as
    transformers saves it."""
    import transformers

    kind = request.param
    text = json.loads((tiny_models(kind) / "config.json").read_text())
    text = {k: v for k, v in text.items()
            if k not in ("architectures", "model_type", "transformers_version")}
    vocab = text["vocab_size"]
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, image_size=28, patch_size=14)
    if kind == "gemma3":
        cfg = transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text),
            vision_config=transformers.SiglipVisionConfig(**tower), mm_tokens_per_image=4,
            image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    else:
        cfg = transformers.Mistral3Config(
            text_config=transformers.MistralConfig(**text),
            vision_config=transformers.PixtralVisionConfig(**tower, head_dim=16),
            image_token_index=vocab - 1)
    torch.manual_seed(0)
    model = _model_class(kind)(cfg).eval()
    with torch.no_grad():  # norms away from their zero init, so they matter
        for name, p in model.named_parameters():
            if "norm" in name and "vision" not in name:
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("vlm") / f"{kind}-vlm"
    model.save_pretrained(path)
    for f in tiny_models(kind).iterdir():  # its tokenizer
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def hf_tokens(model, engine: Engine) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def greedy(model_dir: Path, adapter: Path | None = None):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_pages=64))
    if adapter is not None:
        engine.add_adapter("a", adapter)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1),
                           adapters=["a" if adapter else None] * len(PROMPTS))
    return [o.token_ids for o in outs], [o.logprobs for o in outs], engine


def hf_model(vlm: Path):
    arch = json.loads((vlm / "config.json").read_text())["architectures"][0]
    cls = _model_class("gemma3" if arch.startswith("Gemma3") else "mistral")
    return cls.from_pretrained(vlm, dtype=torch.float32, attn_implementation="eager").eval()


def test_config_is_the_text_models(vlm):
    cfg = ModelConfig.from_dir(vlm)
    assert cfg.multimodal and cfg.architecture in ("Gemma3ForCausalLM", "MistralForCausalLM")
    c = json.loads((vlm / "config.json").read_text())
    text = c["text_config"]
    assert (cfg.hidden_size, cfg.num_layers) == (text["hidden_size"], text["num_hidden_layers"])
    # the outer config's stop ids beside the text model's (Gemma 3's <end_of_turn>)
    outer = ModelConfig.from_dict({**c, "eos_token_id": [7, 9],
                                   "text_config": {**text, "eos_token_id": 1}})
    assert outer.eos_token_ids == (1, 7, 9)


def test_text_model_equals_transformers(vlm):
    toks, _, engine = greedy(vlm)
    assert toks == hf_tokens(hf_model(vlm), engine)


def test_the_other_naming_loads_alike(vlm, tmp_path):
    """Checkpoints saved by other transformers versions name the language model
    model.language_model.X (and lm_head at the top): the same model."""
    other = tmp_path / "other"
    shutil.copytree(vlm, other)
    state = load_file(vlm / "model.safetensors")
    renamed = {("model.language_model." + k[len("language_model.model."):]
                if k.startswith("language_model.model.") else
                "model." + k if k.startswith(("vision_tower.", "multi_modal_projector."))
                else k): t for k, t in state.items()}
    assert renamed.keys() != state.keys()
    save_file(renamed, other / "model.safetensors")
    assert greedy(other)[:2] == greedy(vlm)[:2]


def test_adapter_on_the_whole_model_serves_as_peft_runs_it(vlm, tmp_path):
    """PEFT's q_proj / v_proj match the vision tower's attention as well as the language
    model's: slora serves the language model's rows, and text never reaches the others."""
    import peft

    torch.manual_seed(1)
    model = peft.get_peft_model(hf_model(vlm), peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "adapter")
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    assert any("vision" in k for k in keys) and any("language_model" in k for k in keys)
    toks, _, engine = greedy(vlm, tmp_path / "adapter")
    assert toks == hf_tokens(model.eval(), engine)
    assert toks != greedy(vlm)[0]  # the adapter changes the text model's output
