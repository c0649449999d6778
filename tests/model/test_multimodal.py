"""The text model of a vision-language checkpoint (`config.MULTIMODAL`: Gemma 3 4B and up ship
as Gemma3ForConditionalGeneration): slora serves its language model, and an adapter trained on
the whole model (its LoRA on the vision tower too) serves as PEFT runs it on text. The
reference is HF transformers' and PEFT's Gemma3ForConditionalGeneration, fed text alone."""

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


@pytest.fixture(scope="module")
def vlm(tiny_models, tmp_path_factory) -> Path:
    """A tiny Gemma3ForConditionalGeneration: the tiny Gemma 3 text model's shape beside a
    one-layer SigLIP vision tower, random weights, saved as transformers saves it."""
    import transformers

    text = json.loads((tiny_models("gemma3") / "config.json").read_text())
    text = {k: v for k, v in text.items()
            if k not in ("architectures", "model_type", "transformers_version")}
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    vocab = text["vocab_size"]
    cfg = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text),
                                    vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=vocab - 1, boi_token_index=vocab - 2,
                                    eoi_token_index=vocab - 3)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms away from their zero init, so they matter
        for name, p in model.named_parameters():
            if "norm" in name and "vision" not in name:
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("vlm") / "gemma3-vlm"
    model.save_pretrained(path)
    for f in tiny_models("gemma3").iterdir():  # its tokenizer
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


def test_config_is_the_text_models(vlm):
    cfg = ModelConfig.from_dir(vlm)
    assert cfg.multimodal and cfg.architecture == "Gemma3ForCausalLM"
    c = json.loads((vlm / "config.json").read_text())
    text = c["text_config"]
    assert (cfg.hidden_size, cfg.num_layers) == (text["hidden_size"], text["num_hidden_layers"])
    # the outer config's stop ids beside the text model's (Gemma 3's <end_of_turn>)
    outer = ModelConfig.from_dict({**c, "eos_token_id": [7, 9],
                                   "text_config": {**text, "eos_token_id": 1}})
    assert outer.eos_token_ids == (1, 7, 9)


def test_text_model_equals_transformers(vlm):
    import transformers

    toks, _, engine = greedy(vlm)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        vlm, dtype=torch.float32, attn_implementation="eager").eval()
    assert toks == hf_tokens(hf, engine)


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
    import transformers

    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        vlm, dtype=torch.float32, attn_implementation="eager").eval()
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
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
