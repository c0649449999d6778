"""Pre-quantized FP8 checkpoints load as is: vLLM's `fp8` format and the compressed-tensors
float8 format, per-tensor or per-channel weight scales, dynamic or static activation scales;
block-wise FP8 (`weight_block_size`, DeepSeek-V3's and Qwen3-FP8's) quantized again per row.

The checkpoints are written here from tiny fp32 models. A per-channel checkpoint is written
with `quant.quantize_fp8` itself, so it must equal on-the-fly quantization bit for bit (and the
FP8 engine on it must give the tokens of `EngineConfig(quantization="fp8")` on the source). A
per-tensor checkpoint has other scales than on-the-fly quantization: it must equal the model
whose linear weights are the checkpoint's own dequantized values, which HF transformers runs as
the reference. A block-wise checkpoint must equal the model whose linear weights are its
values (weight times its block's scale) quantized again per row (`quant.quantize_fp8`), which
HF transformers runs. A mixture of experts' checkpoint, experts quantized too, must equal its
values in fp32. Formats slora does not serve fail with an error naming the format.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora import Engine, EngineConfig, SamplingParams
from slora.config import LORA_MODULES, ConfigError, ModelConfig
from slora.model import quant
from slora.model.loader import Fp8Checkpoint, load_weights

CPU = torch.device("cpu")
FP8 = quant.FP8_DTYPE
PROMPTS = ["The quick brown fox", "Serving many LoRA adapters from one GPU needs"]
NEW = 16
# The FP8 engine: EngineConfig.quantization and a model that runs Fp8Weight layers.
HAS_FP8_ENGINE = "quantization" in {f.name for f in dataclasses.fields(EngineConfig)}
needs_fp8_engine = pytest.mark.skipif(not HAS_FP8_ENGINE,
                                      reason="EngineConfig.quantization is not available")


def quantized_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The modules an FP8 checkpoint quantizes: every linear projection of the layers, a
    mixture's experts' and shared expert's included (not its router)."""
    return [k[:-len(".weight")] for k in state
            if re.search(r"\.(?:[qkvo]|gate|up|down)_proj\.weight$|\.w[123]\.weight$", k)]


def linear_modules(cfg: ModelConfig) -> list[str]:
    """Every linear module path of the model, e.g. model.layers.0.self_attn.q_proj."""
    return [f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}"
            for i in range(cfg.num_layers) for m in LORA_MODULES]


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (largest magnitude -> 448), as per-tensor checkpoints."""
    scale = w.float().abs().max() / quant.FP8_MAX
    return (w.float() / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(FP8), scale


def ct_config(weights: str, activations: dict | None, ignore=("lm_head",), block=None) -> dict:
    """A compressed-tensors float8 quantization_config of one config group over Linear."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False,
                            "symmetric": True, "group_size": None, "block_structure": block},
                "input_activations": activations, "output_activations": None}}}


CT_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
              "symmetric": True}
CT_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}
# blocks of the block-wise format: the tiny models' 64- and 128-wide weights in whole and
# partial blocks
BLOCK = [24, 40]
# name -> (quantization_config, weight scales per "tensor", "channel" or "block", static input
# scales)
FORMATS = {
    "fp8_dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor", False),
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": BLOCK}, "block", False),
    # llm-compressor's FP8_BLOCK: the block scales named weight_scale, activations per group
    "ct_block": (ct_config("block", dict(CT_DYNAMIC, strategy="group", group_size=128),
                           block=BLOCK), "block", False),
    "fp8_static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", True),
    "ct_channel_dynamic": (ct_config("channel", CT_DYNAMIC), "channel", False),
    "ct_channel_weight_only": (ct_config("channel", None), "channel", False),
    "ct_tensor_static": (ct_config("tensor", CT_STATIC), "tensor", True),
    "ct_tensor_dynamic": (ct_config("tensor", dict(CT_DYNAMIC, strategy="tensor")), "tensor",
                          False),
}


def quantize_per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scale per BLOCK of w (largest magnitude -> 448), as DeepSeek-V3's checkpoints: the E4M3
    weight and its weight_scale_inv (W = weight * weight_scale_inv of the element's block)."""
    r, c = BLOCK
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8)
    s = torch.empty(-(-n // r), -(-k // c))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * r:(i + 1) * r, j * c:(j + 1) * c].float()
            s[i, j] = blk.abs().max() / quant.FP8_MAX if blk.abs().max() > 0 else 1.0
            q[i * r:(i + 1) * r, j * c:(j + 1) * c] = (blk / s[i, j]).to(FP8)
    return q, s


SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale")  # tensors beside FP8 weights


def block_scale(state: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The block scales of FP8 weight `key` (either format's name), None for other scales."""
    s = state.get(key + "_scale_inv", state.get(key + "_scale"))
    return s if s is not None and s.dim() == 2 and s.shape != (state[key].shape[0], 1) else None


def block_values(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fp32 values of a block-wise weight, block by block: each times its block's scale."""
    r, c = BLOCK
    w = q.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * r:(i + 1) * r, j * c:(j + 1) * c] *= s[i, j].float()
    return w


def input_scale(module: str) -> torch.Tensor:
    """A distinct static activation scale per module (any finite number > 0)."""
    return torch.tensor([0.01 + 0.001 * (hash(module) % 97)], dtype=torch.float32)


def write_checkpoint(src: Path, dst: Path, fmt: str, skip=(), tensors=None, config=None) -> Path:
    """`src` (a tiny fp32 model) as a pre-quantized checkpoint of format `fmt` at `dst`: every
    linear module but those in `skip` in FP8 with its scales; `tensors` / `config` edit the
    result (name -> tensor or None to drop; quantization_config keys) to make bad ones."""
    qc, strategy, static = FORMATS[fmt]
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    state = load_file(src / "model.safetensors")
    for module in quantized_modules(state):
        if module in skip:
            continue
        w = state[module + ".weight"]
        if strategy == "channel":
            q = quant.quantize_fp8(w)
            state[module + ".weight"], state[module + ".weight_scale"] = q.weight, q.scale[:, None]
        elif strategy == "block":  # fp8's scales are weight_scale_inv, compressed-tensors'
            suffix = ".weight_scale_inv" if qc["quant_method"] == "fp8" else ".weight_scale"
            state[module + ".weight"], state[module + suffix] = quantize_per_block(w)
        else:
            state[module + ".weight"], scale = quantize_per_tensor(w)
            # vLLM's fp8 format stores a 0-d scale; compressed-tensors one of shape [1]
            state[module + ".weight_scale"] = scale if qc["quant_method"] == "fp8" else scale[None]
        if static:
            state[module + ".input_scale"] = input_scale(module)
    for k, t in (tensors or {}).items():
        if t is None:
            state.pop(k)
        else:
            state[k] = t
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors")
    c = json.loads((src / "config.json").read_text())
    c["quantization_config"] = dict(qc, **(config or {}))
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def dequantized_copy(ckpt: Path, dst: Path) -> Path:
    """The checkpoint with every FP8 weight replaced by its exact value weight * scale (or its
    block's) in fp32 and no quantization_config: the unquantized model the checkpoint stands
    for."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    state = load_file(ckpt / "model.safetensors")
    out = {}
    for k, t in state.items():
        if k.endswith(SCALES):
            continue
        if t.dtype == FP8 and block_scale(state, k) is not None:
            t = block_values(t, block_scale(state, k))
        elif t.dtype == FP8:
            s = state[k + "_scale"].float().reshape(-1)
            t = t.float() * (s[:, None] if s.numel() > 1 else s)
        out[k] = t
    save_file(out, dst / "model.safetensors")
    c = json.loads((ckpt / "config.json").read_text())
    del c["quantization_config"]
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def same_fp8(a: quant.Fp8Weight, b: quant.Fp8Weight) -> bool:
    return (torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            and torch.equal(a.scale, b.scale))


def load(path: Path):
    cfg = ModelConfig.from_dir(path)
    return cfg, load_weights(path, cfg, torch.float32, CPU)


def fused_source(src: Path) -> list[dict[str, torch.Tensor]]:
    """The source model's fused linear weights per layer (q|k|v, o, gate|up, down), fp32."""
    _, w = load(src)
    return [dict(qkv=lw.qkv, o=lw.o, gate_up=lw.gate_up, down=lw.down) for lw in w.layers]


SPLITS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def split_rows(cfg: ModelConfig, group: str, t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split([cfg.module_dims(m)[1] for m in SPLITS[group]]))


# ----------------------------------------------------------------------------- load_weights

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_per_channel_checkpoint_equals_on_the_fly_quantization(tiny_models, tmp_path, kind):
    src = tiny_models(kind)
    ckpt = write_checkpoint(src, tmp_path / "ckpt", "ct_channel_dynamic")
    cfg, w = load(ckpt)
    _, ref = load(src)
    for lw, rw in zip(w.layers, ref.layers):
        for group in SPLITS:
            got = getattr(lw, group)
            assert isinstance(got, quant.Fp8Weight) and got.weight.dtype == FP8
            parts = [quant.quantize_fp8(p) for p in split_rows(cfg, group, getattr(rw, group))]
            assert same_fp8(got, quant.cat(parts)), group
            # per-channel scales are row-wise: quantizing the fused weight gives the same
            assert same_fp8(got, quant.quantize_fp8(getattr(rw, group))), group
        for name in ("ln1", "ln2", "qkv_bias", "o_bias"):
            a, b = getattr(lw, name), getattr(rw, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    for name in ("embed", "norm", "lm_head"):
        t = getattr(w, name)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        assert torch.equal(t, getattr(ref, name)), name
    assert Fp8Checkpoint.from_dir(ckpt) == Fp8Checkpoint("compressed-tensors", "dynamic",
                                                         ("lm_head",), input_scales={})


@pytest.mark.parametrize("fmt", ["fp8_dynamic", "fp8_static", "ct_tensor_static",
                                 "ct_tensor_dynamic"])
def test_per_tensor_checkpoint_keeps_its_scales(tiny_models, tmp_path, fmt):
    """Each module's one scale is repeated over its rows (fused q|k|v keep three scales), and
    the weights dequantize to the checkpoint's own values."""
    src = tiny_models("llama")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", fmt)
    cfg, w = load(ckpt)
    ref = fused_source(src)
    for lw, rw in zip(w.layers, ref):
        for group in SPLITS:
            got = getattr(lw, group)
            assert isinstance(got, quant.Fp8Weight)
            weights = split_rows(cfg, group, got.weight)
            scales = split_rows(cfg, group, got.scale)
            for part, s, src_w in zip(weights, scales, split_rows(cfg, group, rw[group])):
                q, scale = quantize_per_tensor(src_w)
                assert torch.equal(s, scale.expand(len(s)))
                assert torch.equal(part.view(torch.uint8), q.view(torch.uint8))
            exact = got.weight.float() * got.scale[:, None]
            assert torch.equal(got.dequantize(torch.float32), exact)
            # the round trip stays close to the source: the checkpoint is the model's weights
            torch.testing.assert_close(got.dequantize(torch.float32), rw[group], rtol=0.07,
                                       atol=float(rw[group].abs().max()) / 64)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_activation_scheme_and_static_scales_are_recorded(tiny_models, tmp_path, fmt):
    src = tiny_models("llama")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", fmt)
    qc, _, static = FORMATS[fmt]
    info = Fp8Checkpoint.from_dir(ckpt)
    assert info.method == qc["quant_method"]
    want = "static" if static else ("none" if fmt.endswith("weight_only") else "dynamic")
    assert info.activations == want
    modules = linear_modules(ModelConfig.from_dir(src))
    expected = {m: pytest.approx(input_scale(m).item()) for m in modules} if static else {}
    assert info.input_scales == expected
    assert Fp8Checkpoint.from_dir(src) is None


def test_static_and_dynamic_checkpoints_hold_the_same_weights(tiny_models, tmp_path):
    """A static activation scale changes nothing slora computes: the weights are the same."""
    src = tiny_models("llama")
    _, a = load(write_checkpoint(src, tmp_path / "static", "fp8_static"))
    _, b = load(write_checkpoint(src, tmp_path / "dynamic", "fp8_dynamic"))
    for la, lb in zip(a.layers, b.layers):
        for group in SPLITS:
            assert same_fp8(getattr(la, group), getattr(lb, group))


def test_unquantized_modules_load_beside_fp8_ones(tiny_models, tmp_path):
    """The checkpoint's FP8 parts keep their values: a fused layer with a part the checkpoint
    leaves unquantized is FP8 whole, that part quantized per channel (as on the fly); an
    unquantized layer on its own loads in the model dtype."""
    src = tiny_models("llama")
    skip = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", "fp8_dynamic", skip=skip,
                            config={"ignored_layers": ["lm_head", *skip]})
    state = load_file(ckpt / "model.safetensors")
    cfg, w = load(ckpt)
    ref = fused_source(src)

    def stored(module):
        return quant.Fp8Weight(state[module + ".weight"],
                               state[module + ".weight_scale"].reshape(1).expand(
                                   state[module + ".weight"].shape[0]).contiguous())

    _, k, _ = split_rows(cfg, "qkv", ref[0]["qkv"])
    a = "model.layers.0.self_attn."
    want = quant.cat([stored(a + "q_proj"), quant.quantize_fp8(k), stored(a + "v_proj")])
    assert same_fp8(w.layers[0].qkv, want)
    down = w.layers[1].down
    assert isinstance(down, torch.Tensor) and down.dtype == torch.float32
    assert torch.equal(down, ref[1]["down"])
    assert same_fp8(w.layers[0].down, stored("model.layers.0.mlp.down_proj"))
    assert Fp8Checkpoint.from_dir(ckpt).ignore == ("lm_head", *skip)


def test_scales_in_bf16_and_sharded_files_load(tiny_models, tmp_path):
    """compressed-tensors may store scales in the model dtype; shards load like one file."""
    src = tiny_models("llama")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", "ct_channel_dynamic")
    state = load_file(ckpt / "model.safetensors")
    for k in list(state):
        if k.endswith(".weight_scale"):
            state[k] = state[k].to(torch.bfloat16)
    keys = sorted(state)
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    (ckpt / "model.safetensors").unlink()
    for name, ks in halves.items():
        save_file({k: state[k] for k in ks}, ckpt / name)
    index = {"weight_map": {k: name for name, ks in halves.items() for k in ks}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg, w = load(ckpt)
    for i, lw in enumerate(w.layers):
        for group, modules in SPLITS.items():
            paths = [m for m in linear_modules(cfg) if m.startswith(f"model.layers.{i}.")
                     and m.endswith(modules)]
            want = quant.cat([quant.Fp8Weight(state[m + ".weight"],
                                              state[m + ".weight_scale"].float().reshape(-1))
                              for m in paths])
            assert same_fp8(getattr(lw, group), want), (i, group)


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_block"])
def test_block_checkpoint_loads_as_its_values_quantized_per_row(tiny_models, tmp_path, fmt):
    """Each block-wise weight loads as its values (weight times its block's scale)
    quantized again with one scale per output row, bit for bit."""
    src = tiny_models("llama")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", fmt)
    state = load_file(ckpt / "model.safetensors")
    cfg, w = load(ckpt)
    for i, lw in enumerate(w.layers):
        for group, modules in SPLITS.items():
            paths = [m for m in linear_modules(cfg) if m.startswith(f"model.layers.{i}.")
                     and m.endswith(modules)]
            want = quant.cat([quant.quantize_fp8(block_values(
                state[m + ".weight"], block_scale(state, m + ".weight"))) for m in paths])
            assert same_fp8(getattr(lw, group), want), (i, group)
    assert Fp8Checkpoint.from_dir(ckpt).block == tuple(BLOCK)


def requantized_copy(ckpt: Path, dst: Path) -> Path:
    """A block-wise checkpoint as the unquantized model slora serves for it: every weight's
    values quantized per row, dequantized to fp32; no quantization_config."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    state = load_file(ckpt / "model.safetensors")
    out = {k: t for k, t in state.items() if t.dtype != FP8 and not k.endswith(SCALES)}
    for k, t in state.items():
        if t.dtype == FP8:
            out[k] = quant.quantize_fp8(block_values(t, block_scale(state, k))).dequantize(
                torch.float32)
    save_file(out, dst / "model.safetensors")
    c = json.loads((ckpt / "config.json").read_text())
    del c["quantization_config"]
    (dst / "config.json").write_text(json.dumps(c))
    return dst


# ----------------------------------------------------------------------------- the engine

def greedy(model_dir: Path, **config):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_pages=64, **config))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1))
    return ([o.token_ids for o in outs],
            [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs], engine)


@needs_fp8_engine
@pytest.mark.parametrize("kind,skip", [
    ("llama", ()), ("qwen2", ()),
    # modules the checkpoint leaves unquantized are quantized per channel at load
    ("llama", ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"))])
def test_per_channel_checkpoint_serves_on_the_fly_tokens(tiny_models, tmp_path, kind, skip):
    src = tiny_models(kind)
    ckpt = write_checkpoint(src, tmp_path / "ckpt", "ct_channel_dynamic", skip=skip,
                            config={"ignore": ["lm_head", *skip]})
    toks, lps, _ = greedy(ckpt)
    want_toks, want_lps, _ = greedy(src, quantization="fp8")
    assert toks == want_toks
    assert lps == want_lps


def assert_hf_tokens(plain: Path, engine, toks) -> None:
    """HF transformers' greedy tokens on the unquantized model `plain` are `toks`."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, toks):
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == got, prompt


@needs_fp8_engine
@pytest.mark.parametrize("kind,fmt", [("llama", "fp8_static"), ("llama", "ct_tensor_dynamic"),
                                      ("llama", "fp8_block"), ("qwen2", "fp8_block"),
                                      ("llama", "ct_block")])
def test_checkpoint_serves_the_model_it_stands_for(tiny_models, tmp_path, kind, fmt):
    """The FP8 engine on a per-tensor checkpoint equals HF transformers on the checkpoint's
    dequantized weights, on a block-wise one HF on its weights quantized again per row (and
    slora on that unquantized copy, log-prob for log-prob)."""
    ckpt = write_checkpoint(tiny_models(kind), tmp_path / "ckpt", fmt)
    copy = requantized_copy if FORMATS[fmt][1] == "block" else dequantized_copy
    plain = copy(ckpt, tmp_path / "plain")
    toks, lps, engine = greedy(ckpt)
    plain_toks, plain_lps, _ = greedy(plain)
    assert toks == plain_toks
    for got, want in zip(lps, plain_lps):
        assert got == pytest.approx(want, abs=1e-5)
    assert_hf_tokens(plain, engine, toks)


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "fp8_block"), ("mixtral", "fp8_block"),
                                      ("qwen2_moe", "ct_channel_dynamic")])
def test_mixture_of_experts_checkpoint_serves_its_values(tiny_models, tmp_path, kind, fmt):
    """A mixture of experts' FP8 checkpoint, experts (and Qwen2-MoE's shared expert) quantized
    too, loads dequantized: the engine's tokens and log-probs are those of its values in
    fp32, which HF transformers' tokens equal too."""
    ckpt = write_checkpoint(tiny_models(kind), tmp_path / "ckpt", fmt)
    assert any(".experts." in m for m in quantized_modules(load_file(ckpt / "model.safetensors")))
    plain = dequantized_copy(ckpt, tmp_path / "plain")
    toks, lps, engine = greedy(ckpt)
    assert (toks, lps) == greedy(plain)[:2]
    assert_hf_tokens(plain, engine, toks)


def test_quantized_router_is_refused(tiny_models, tmp_path):
    q, s = quantize_per_tensor(torch.randn(4, 64))
    ckpt = write_checkpoint(tiny_models("qwen3_moe"), tmp_path / "ckpt", "fp8_dynamic",
                            tensors={"model.layers.0.mlp.gate.weight": q,
                                     "model.layers.0.mlp.gate.weight_scale": s})
    with pytest.raises(ValueError, match=r"module 'model.layers.0.mlp.gate' is quantized"):
        load(ckpt)


# ----------------------------------------------------------------------------- refused formats

BAD_CONFIGS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method 'gptq'"),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm"}, r"quant_method 'awq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     r"quant_method 'bitsandbytes'"),
    "fp8_block_size": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                        "weight_block_size": [128]},
                       r"weight_block_size \[128\] is not \[rows, columns\]"),
    "fp8_no_scheme": ({"quant_method": "fp8"}, r"activation_scheme None"),
    "ct_int8": (dict(ct_config("channel", CT_DYNAMIC), format="int-quantized"),
                r"format 'int-quantized'"),
    "ct_int8_weights": ({**ct_config("channel", CT_DYNAMIC), "format": "naive-quantized",
                         "config_groups": {"g": {"targets": ["Linear"], "weights": {
                             "num_bits": 8, "type": "int", "strategy": "channel",
                             "dynamic": False, "symmetric": True}}}},
                        r"type 'int' with num_bits 8 \(int8\)"),
    "ct_w4a16": (dict(ct_config("channel", None), format="pack-quantized"),
                 r"format 'pack-quantized'"),
    "ct_group": ({**ct_config("channel", None), "config_groups": {"g": {
                     "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                        "strategy": "group", "group_size": 128,
                                                        "dynamic": False}}}},
                 r"strategy 'group'"),
    "ct_block_no_structure": ({**ct_config("channel", None), "config_groups": {"g": {
                                  "targets": ["Linear"], "weights": {
                                      "num_bits": 8, "type": "float", "strategy": "block",
                                      "dynamic": False}}}},
                              r"strategy 'block' with block_structure None"),
    "ct_block_structure": (ct_config("block", None, block=[128, 0]),
                           r"block_structure \[128, 0\] is not \[rows, columns\]"),
    "ct_nvfp4": (dict(ct_config("channel", None), format="nvfp4-pack-quantized"),
                 r"format 'nvfp4-pack-quantized'"),
    "ct_asymmetric": ({**ct_config("channel", None), "config_groups": {"g": {
                          "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                             "strategy": "channel",
                                                             "dynamic": False,
                                                             "symmetric": False}}}},
                      r"asymmetric"),
    "ct_static_per_token": (ct_config("channel", dict(CT_STATIC, strategy="token")),
                            r"dynamic=False strategy='token'"),
    "ct_sparse": (dict(ct_config("channel", CT_DYNAMIC),
                       sparsity_config={"format": "sparse-24-bitmask"}), r"sparse"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_unsupported_quantization_config_is_refused(tiny_models, tmp_path, name):
    qc, match = BAD_CONFIGS[name]
    src = tiny_models("llama")
    ckpt = write_checkpoint(src, tmp_path / "ckpt", "ct_channel_dynamic")
    c = json.loads((ckpt / "config.json").read_text())
    c["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(c))
    for attempt in (lambda: load(ckpt), lambda: Fp8Checkpoint.from_dir(ckpt),
                    lambda: Engine(EngineConfig(model=str(ckpt), device="cpu", num_pages=8))):
        with pytest.raises(ConfigError, match=match) as e:
            attempt()
        assert "slora loads FP8 E4M3 checkpoints" in str(e.value)  # and says what it supports


E5M2 = torch.zeros(8, 64).to(torch.float8_e5m2)
BAD_TENSORS = {
    # name -> (format, tensors (None drops one), what the error says)
    "block_scale_inv": ("fp8_dynamic",
                        {"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)},
                        r"q_proj: weight_scale_inv \(block-wise FP8\) in a checkpoint whose "
                        r"quantization_config has no weight_block_size"),
    "block_scale_shape": ("fp8_block",
                          {"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(3, 3)},
                          r"o_proj: weight \[64, 64\] with weight_scale_inv \[3, 3\] "
                          r"\(torch.float32\); weight_block_size \[24, 40\] needs \[3, 2\]"),
    "block_scale_zero": ("fp8_block",
                         {"model.layers.1.mlp.up_proj.weight_scale_inv": torch.zeros(6, 2)},
                         r"up_proj: weight_scale_inv holds values that are not finite numbers"),
    "e5m2_weight": ("fp8_dynamic",
                    {"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64).to(
                        torch.float8_e5m2)}, r"float8_e5m2; only float8_e4m3fn"),
    "lm_head_fp8": ("ct_channel_dynamic",
                    {"lm_head.weight_scale": torch.ones(1)}, r"module 'lm_head' is quantized"),
    "embed_fp8": ("ct_channel_dynamic",
                  {"model.embed_tokens.weight": torch.zeros(8, 64).to(FP8)},
                  r"module 'model.embed_tokens' is quantized"),
    "no_scale": ("fp8_dynamic", {"model.layers.1.self_attn.o_proj.weight_scale": None},
                 r"o_proj: float8 weight without a weight_scale"),
    "group_scale": ("ct_channel_dynamic",
                    {"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(64, 2)},
                    r"weight_scale \[64, 2\]"),
    "zero_scale": ("fp8_dynamic",
                   {"model.layers.0.mlp.down_proj.weight_scale": torch.tensor(0.0)},
                   r"down_proj: weight_scale holds values that are not finite numbers > 0"),
    "nan_input_scale": ("fp8_static",
                        {"model.layers.0.mlp.down_proj.input_scale": torch.tensor([float("nan")])},
                        r"down_proj.input_scale .* is not one finite number > 0"),
    "zero_point": ("ct_channel_dynamic",
                   {"model.layers.0.mlp.gate_proj.weight_zero_point": torch.ones(128, 1)},
                   r"non-zero weight_zero_point \(asymmetric FP8\)"),
}


@pytest.mark.parametrize("name", sorted(BAD_TENSORS))
def test_unsupported_tensors_are_refused(tiny_models, tmp_path, name):
    fmt, tensors, match = BAD_TENSORS[name]
    ckpt = write_checkpoint(tiny_models("llama"), tmp_path / "ckpt", fmt, tensors=tensors)
    with pytest.raises(ValueError, match=match):
        load(ckpt)


def test_float8_weights_without_quantization_config_are_refused(tiny_models, tmp_path):
    ckpt = dequantized_copy(write_checkpoint(tiny_models("llama"), tmp_path / "q",
                                             "fp8_dynamic"), tmp_path / "plain")
    state = load_file(ckpt / "model.safetensors")
    q, s = quantize_per_tensor(state["model.layers.0.self_attn.q_proj.weight"])
    state["model.layers.0.self_attn.q_proj.weight"] = q
    state["model.layers.0.self_attn.q_proj.weight_scale"] = s
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(ConfigError, match=r"q_proj.weight' \(torch.float8_e4m3fn\) is a quantized "
                       r"weight but config.json has no quantization_config"):
        load(ckpt)
