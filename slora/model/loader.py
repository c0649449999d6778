"""Loading from local Hugging Face directories: base models and PEFT LoRA adapters.

Base model: config.json, model.safetensors or shards listed in model.safetensors.index.json.
A checkpoint whose config.json carries an FP8 `quantization_config` (vLLM's `fp8` format or the
`compressed-tensors` float8 format) loads as is: its linear layers become `Fp8Weight`s (see
`Fp8Checkpoint`); any other quantization is refused with a ConfigError naming it.
Adapter: adapter_config.json + adapter_model.safetensors (or adapter_model.bin, read with
torch.load(weights_only=True)). An adapter is validated against the base model when it is
registered (config, every tensor present with the right shape, sizes against the
safetensors header) and its weights read only when it is loaded into the host tier, where
they are checked again (the file unchanged or of the same layout, every value finite).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from slora.config import (FUSED_MODULES, LORA_ALIGN, LORA_MODULES, VOCAB_MODULES, ConfigError,
                           ModelConfig, is_int, round_up)
from slora.core.adapters import AdapterLayout
from slora.model.llama import Experts, LayerWeights, Weights
from slora.model.quant import FP8_DTYPE, Fp8Weight, cat, quantize_fp8


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message names adapter, file and reason.
    `adapter`: the adapter's name."""

    def __init__(self, message: str, adapter: str | None = None) -> None:
        super().__init__(message)
        self.adapter = adapter


# ----------------------------------------------------------------------------- base model

def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: shard(s) {missing} are missing from {path}")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {path}: no *.safetensors weights found "
                                "(PyTorch .bin checkpoints are not supported; convert with "
                                "safetensors first)")
    return files


# A vision-language checkpoint's names for its language model (two transformers versions'),
# and the parts that read images (ModelConfig.multimodal)
_LANGUAGE = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


def text_tensors(named: dict, prefix: str = "") -> dict:
    """A vision-language checkpoint's (or adapter's: `prefix` "base_model.model.") entries
    under the text model's names: the language model's renamed (model.language_model.X and
    language_model.model.X to model.X), the vision tower's and projector's left out (text never
    reaches them, so LoRA on them changes no output)."""
    out = {}
    for key, value in named.items():
        head = prefix if key.startswith(prefix) else ""
        body = key[len(head):]
        if body.startswith(_VISION):
            continue
        for old, new in _LANGUAGE:
            if body.startswith(old):
                body = new + body[len(old):]
                break
        out[head + body] = value
    return out


def _read_tensors(path: Path, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The directory's tensors by name; `multimodal`: its text model's alone, under the text
    model's names (`text_tensors`; the vision tower's are not read)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        with safe_open(str(f), framework="pt") as fh:
            names = {key: key for key in fh.keys()}  # name -> the file's key
            for name, key in (text_tensors(names) if multimodal else names).items():
                tensors[name] = fh.get_tensor(key)
    return tensors


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> Weights:
    """The model's weights on `device`: norms, embeddings, lm_head and biases in `dtype`; each
    linear layer (q|k|v and gate|up fused) in `dtype`, or an `Fp8Weight` where the checkpoint
    is a supported FP8 one (`Fp8Checkpoint`) and holds it in FP8. The FP8 parts keep the
    checkpoint's own values and scales (a block-wise one's quantized again per row); a
    mixture of experts' FP8 checkpoint loads dequantized (`_fp8_values`), one tensor at a
    time, every weight in `dtype`. A fused
    layer whose other parts the checkpoint leaves
    unquantized (its `ignore` list) is FP8 whole, those parts quantized per output channel
    (`quantize_fp8`, as EngineConfig.quantization="fp8" does); an unquantized layer on its own
    stays in `dtype`."""
    path = Path(path)
    if cfg.mlp_bias:
        raise ValueError(f"{path}: mlp_bias=True is not supported")
    scheme = _quant_scheme(path)
    tensors = _read_tensors(path, cfg.multimodal)
    _check_quantized_modules(tensors, cfg, path, fp8=scheme is not None)
    block = scheme[3] if scheme is not None else None
    # a mixture of experts is served in the model dtype, experts and all
    dequantize = scheme is not None and bool(cfg.num_experts)

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise KeyError(f"model directory {path}: weight {name!r} not found")
        if dequantize and t.dtype in _FP8_DTYPES:  # (a linear weight: checked above)
            return _fp8_values(tensors, _module_of(name), path, block).to(device=device,
                                                                          dtype=dtype)
        if not t.is_floating_point() or t.dtype in _FP8_DTYPES:
            raise ValueError(f"model directory {path}: weight {name!r} is {t.dtype}; slora keeps "
                             "embeddings, lm_head, norms and biases in the model dtype (a "
                             "checkpoint may hold them in float32, float16 or bfloat16)")
        return t.to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    def raw(name: str) -> torch.Tensor | None:
        return tensors[name].to(device) if name in tensors else None

    def norm(name: str) -> torch.Tensor:
        """An RMSNorm's weight. Gemma's scale by (1 + w): the 1 is folded in here, as float32
        w + 1 of w in the model dtype, the value HF computes at every call (1.0 + w.float()),
        so the fold is exact; the weight stays float32 (in a 16-bit dtype 1 + w would lose
        w's low bits) and the norm's output takes its input's dtype."""
        if not cfg.norm_plus_one:
            return get(name)
        return get(name).float() + 1.0

    def linear(module: str) -> Fp8Weight | torch.Tensor:
        w = tensors.get(module + ".weight")
        if w is None or w.dtype not in _FP8_DTYPES or dequantize:
            return get(module + ".weight")
        return _fp8_linear(tensors, module, path, block).to(device)

    def residual(w):
        """A residual branch's output weight (o_proj, down_proj; o's bias) times Granite's
        residual_multiplier (an FP8 weight's scale): HF multiplies the branch's output."""
        m = cfg.residual_multiplier
        if m == 1.0 or w is None:
            return w
        if isinstance(w, Fp8Weight):
            return Fp8Weight(w.weight, w.scale * m)
        return (w.float() * m).to(dtype)

    qkv_served = served_qk(cfg, cfg.num_heads + cfg.num_kv_heads, cfg.kv_size)
    head = torch.tensor(cfg.rotary_permutation() or range(cfg.head_dim))

    def served_qkv(w):
        """q|k|v rows (or a bias) as served: each q and k head's rows permuted and scaled for
        a partial rotary (`served_qk`)."""
        if qkv_served is None or w is None:
            return w
        rows, scale = (t.to(w.device) for t in qkv_served)
        if isinstance(w, Fp8Weight):
            return Fp8Weight(w.weight[rows], w.scale[rows] * scale)
        return (w[rows].float() * (scale[:, None] if w.dim() == 2 else scale)).to(w.dtype)

    def served_norm(name: str) -> torch.Tensor | None:
        """A q or k norm's weight (ModelConfig.qk_norm; None without), each head's elements
        in the served order (`rotary_permutation`): one head's [head_dim], or every head's
        ("heads", "all")."""
        if not cfg.qk_norm:
            return None
        w = norm(name)
        return w.view(-1, cfg.head_dim)[:, head.to(device)].flatten()

    def fused(modules: list[str]) -> Fp8Weight | torch.Tensor:
        parts = [linear(m) for m in modules]
        if len(parts) == 1:
            return parts[0]
        if not any(isinstance(p, Fp8Weight) for p in parts):
            return torch.cat(parts)
        return cat([p if isinstance(p, Fp8Weight) else quantize_fp8(p) for p in parts])

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([get(a + f"{m}_proj.bias") for m in "qkv"])
        # Phi-3 stores q|k|v and gate|up already fused, GLM gate|up, in the rows' order slora
        # uses (ModelConfig.fused_modules).
        qkv = [a + "qkv_proj"] if "qkv_proj" in cfg.fused_modules \
            else [a + f"{m}_proj" for m in "qkv"]
        mlp = p + cfg.mlp_path(i) + "."
        gate_up = [mlp + "gate_up_proj"] if "gate_up_proj" in cfg.fused_modules \
            else [mlp + "gate_proj", mlp + "up_proj"]
        dense = cfg.dense_mlp(i)
        experts = None if not cfg.experts_in(i) else (
            _gpt_oss_experts(get, raw, p + "mlp.") if cfg.architecture == "GptOssForCausalLM"
            else _load_experts(get, p, cfg, residual))
        ln1, ln2, post_attn, post_mlp = (
            None if n is None else norm(f"{p}{n}.weight") for n in _norm_names(cfg))
        layers.append(LayerWeights(
            ln1=ln1,
            qkv=served_qkv(fused(qkv)),
            qkv_bias=served_qkv(qkv_bias),
            o=residual(fused([a + "o_proj"])),
            o_bias=residual(maybe(a + "o_proj.bias") if cfg.o_bias else None),
            ln2=ln2,
            gate_up=fused(gate_up) if dense else None,
            down=residual(fused([mlp + "down_proj"])) if dense else None,
            experts=experts,
            shared_gate=(get(p + "mlp.shared_expert_gate.weight")
                         if experts is not None and dense else None),
            q_norm=served_norm(a + "q_norm.weight"),
            k_norm=served_norm(a + "k_norm.weight"),
            post_attn=post_attn,
            post_mlp=post_mlp,
            sinks=get(a + "sinks").float() if cfg.attention_sinks else None,
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in tensors \
        else get("lm_head.weight")
    return Weights(embed=embed, layers=layers, norm=norm("model.norm.weight"), lm_head=lm_head)


# ----------------------------------------------------------------------------- FP8 checkpoints

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz)
SUPPORTED_QUANTIZATION = (
    "slora loads FP8 E4M3 checkpoints in vLLM's 'fp8' format (quant_method 'fp8', per-tensor "
    "weight_scale or block-wise weight_scale_inv with weight_block_size, activation_scheme "
    "'dynamic' or 'static') and the compressed-tensors float8 format (quant_method "
    "'compressed-tensors', format 'float-quantized' or 'naive-quantized', weights num_bits 8 "
    "type 'float' strategy 'tensor', 'channel' or 'block', input_activations null, dynamic per "
    "'token', 'tensor' or 'group', or static per 'tensor'), FP8 on the q/k/v/o/gate/up/down "
    "projections (and a mixture's experts) only; a float32/float16/bfloat16 checkpoint is "
    "quantized at load with EngineConfig(quantization='fp8')")
# the module path of a linear layer FP8 may quantize, e.g. model.layers.3.mlp.down_proj
LINEAR_PATH = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(?:"
                         + "|".join((*LORA_MODULES, *FUSED_MODULES)) + r")$")
# and in a mixture of experts an expert's, e.g. model.layers.3.mlp.experts.7.down_proj
EXPERT_PATH = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts\.\d+|"
                         r"shared_expert)\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)$")
# tensors beside a quantized weight: its scale, a static activation scale, a zero point
_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point",
                   ".input_zero_point")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A pre-quantized FP8 checkpoint as slora serves it, from its config.json's
    `quantization_config` and its scale tensors.

    method: "fp8" (vLLM's Fp8Config) or "compressed-tensors" (its float8 schemes).
    activations: the checkpoint's activation scheme: "dynamic", "static" (per-tensor scales
        calibrated offline, `input_scales`) or "none" (weight-only); "static" if any of its
        config groups is static. slora quantizes activations dynamically, per token, whatever
        this says: a static scale is recorded, not applied.
    ignore: the modules the checkpoint leaves unquantized (`ignored_layers` / `ignore`).
    block: (rows, columns) of a block-wise checkpoint's scale blocks (`weight_block_size`,
        compressed-tensors' `block_structure`: DeepSeek-V3's and Qwen3-FP8's [128, 128]);
        None for one scale per tensor or channel.
    input_scales: module path (model.layers.N.self_attn.q_proj) -> its static activation scale.

    The weights: each linear weight stored as float8_e4m3fn comes with a `weight_scale` of one
    element (per tensor, repeated over the rows) or one per output row ([N] or [N, 1], per
    channel), in any float dtype, finite and > 0; W = weight * scale. In a block-wise
    checkpoint it comes with a `weight_scale_inv` instead (compressed-tensors' block strategy:
    a `weight_scale`), one per block ([ceil(N / rows), ceil(K / columns)]): W = weight * the
    scale of its block. slora's FP8 kernels take
    one scale per output row, so such a weight is dequantized and quantized again per row
    (`quant.quantize_fp8`): its values move by at most half an E4M3 step of the row's scale.
    """

    method: str
    activations: str
    ignore: tuple[str, ...] = ()
    block: tuple[int, int] | None = None
    input_scales: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Fp8Checkpoint | None":
        """The FP8 quantization of the model directory at `path`; None for an unquantized one.
        ConfigError for a quantization slora does not serve."""
        path = Path(path)
        scheme = _quant_scheme(path)
        if scheme is None:
            return None
        scales = {}
        for f in _safetensor_files(path):
            with safe_open(str(f), framework="pt") as fh:
                scales.update({k: fh.get_tensor(k) for k in fh.keys()
                               if k.endswith(".input_scale")})
        return cls(*scheme, input_scales=_input_scales(scales, path))


def _quant_scheme(path: Path) -> tuple[str, str, tuple[str, ...], tuple[int, int] | None] | None:
    """(method, activations, ignore, block) of the directory's quantization_config; None
    without one."""
    file = path / "config.json"
    if not file.is_file():
        return None
    c = json.loads(file.read_text())
    qc = c.get("quantization_config")
    if qc is None or _mxfp4_experts(c):
        return None
    return parse_quantization_config(qc, str(file))


def _mxfp4_experts(c: dict) -> bool:
    """Whether a config.json is gpt-oss's with its experts in MXFP4 (quant_method "mxfp4"),
    which the loader dequantizes to the model dtype (`_mxfp4`); the other weights are not
    quantized."""
    qc = c.get("quantization_config")
    return (isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"
            and "GptOssForCausalLM" in (c.get("architectures") or ()))


def parse_quantization_config(qc, source: str = "config"
                              ) -> tuple[str, str, tuple[str, ...], tuple[int, int] | None]:
    """(method, activations, ignore, block) of a config.json's `quantization_config` (see
    `Fp8Checkpoint`). ConfigError naming the format, and what slora supports, for anything
    else: GPTQ, AWQ, bitsandbytes, int8/int4, FP4, group-wise, asymmetric or sparse."""
    def fail(why: str):
        raise ConfigError(f"{source}: quantization_config {why}; {SUPPORTED_QUANTIZATION}")

    if not isinstance(qc, dict):
        fail(f"is a JSON {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        scheme = qc.get("activation_scheme")
        if scheme not in ("dynamic", "static"):
            fail(f"activation_scheme {scheme!r} is not 'dynamic' or 'static'")
        return ("fp8", scheme, _names(qc.get("ignored_layers"), "ignored_layers", fail),
                _block(qc.get("weight_block_size"), "weight_block_size", fail))
    if method != "compressed-tensors":
        fail(f"quant_method {method!r} is not supported")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        fail(f"sparsity_config format {sparsity.get('format')!r}: sparse weights are not "
             "supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        fail(f"config_groups {groups!r} is not a non-empty object")
    schemes, blocks = [], set()
    for name, g in groups.items():
        if not isinstance(g, dict):
            fail(f"config_groups[{name!r}] is not an object")
        fmt = g.get("format") or qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            fail(f"format {fmt!r} (config group {name!r}) is not supported")
        activations, block = _ct_group(name, g, fail)
        schemes.append(activations)
        blocks.add(block)
    if len(blocks - {None}) > 1:
        fail(f"config groups of different block_structure {sorted(blocks - {None})}")
    activations = next((s for s in ("static", "dynamic") if s in schemes), "none")
    return ("compressed-tensors", activations, _names(qc.get("ignore"), "ignore", fail),
            next(iter(blocks - {None}), None))


def _block(v, key: str, fail) -> tuple[int, int] | None:
    """A block-wise checkpoint's (rows, columns) of a scale's block; None when `v` is."""
    if v is not None and not (isinstance(v, list) and len(v) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v)):
        fail(f"{key} {v!r} is not [rows, columns] of two integers > 0")
    return None if v is None else tuple(v)


def _ct_group(name: str, g: dict, fail) -> tuple[str, tuple[int, int] | None]:
    """A compressed-tensors config group's (activation scheme, block), once its weights are
    checked to be symmetric float8 per tensor, per channel or per block (`block_structure`;
    block None otherwise)."""
    w = g.get("weights")
    if not isinstance(w, dict):
        fail(f"config group {name!r} has no weights scheme")
    kind, bits = w.get("type", "int"), w.get("num_bits")
    if kind != "float" or bits != 8:
        fail(f"config group {name!r}: weights of type {kind!r} with num_bits {bits!r} "
             f"({'int' + str(bits) if kind == 'int' else 'fp' + str(bits)}) are not supported")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block") \
            or (strategy == "block") != (w.get("block_structure") is not None):
        fail(f"config group {name!r}: weights strategy {strategy!r} with block_structure "
             f"{w.get('block_structure')!r} is not supported (group-wise scales)")
    block = _block(w.get("block_structure"), f"config group {name!r}: block_structure", fail)
    if w.get("dynamic") or not w.get("symmetric", True):
        fail(f"config group {name!r}: dynamic or asymmetric weight scales are not supported")
    if g.get("output_activations"):
        fail(f"config group {name!r}: output_activations quantization is not supported")
    a = g.get("input_activations")
    if a is None:
        return "none", block
    if not isinstance(a, dict) or a.get("type", "int") != "float" or a.get("num_bits") != 8:
        fail(f"config group {name!r}: input_activations {a!r} are not float8")
    if not a.get("symmetric", True):
        fail(f"config group {name!r}: asymmetric input_activations are not supported")
    dynamic, strategy = a.get("dynamic"), a.get("strategy")
    if dynamic is True and strategy in ("token", "tensor", "group"):
        return "dynamic", block
    if dynamic is False and strategy == "tensor":
        return "static", block
    fail(f"config group {name!r}: input_activations dynamic={dynamic!r} strategy={strategy!r} "
         "are not supported")


def _names(v, key: str, fail) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        fail(f"{key} {v!r} is not a list of module names")
    return tuple(v)


def _module_of(key: str) -> str:
    """The module path a checkpoint tensor belongs to (its name without the last part)."""
    return key.rsplit(".", 1)[0]


def _check_quantized_modules(tensors: dict[str, torch.Tensor], cfg: ModelConfig, path: Path,
                             fp8: bool) -> None:
    """ValueError naming the first tensor that makes the checkpoint one slora does not serve
    as FP8: a float8 tensor in a checkpoint without quantization_config, a quantized module
    other than the linear projections and a mixture's experts (embeddings, lm_head, norms, the
    router), an FP8 E5M2 weight."""
    for key, t in tensors.items():
        if key.endswith(_QUANT_SUFFIXES) or t.dtype in _FP8_DTYPES:
            module = _module_of(key)
            if not fp8:
                raise ConfigError(f"model directory {path}: tensor {key!r} ({t.dtype}) is a "
                                  "quantized weight but config.json has no quantization_config; "
                                  f"{SUPPORTED_QUANTIZATION}")
            if not (LINEAR_PATH.match(module) or cfg.num_experts and EXPERT_PATH.match(module)):
                raise ValueError(f"model directory {path}: tensor {key!r}: module {module!r} is "
                                 "quantized, but only the linear projections (q/k/v/o/gate/up/"
                                 "down_proj, and a mixture's experts) may be FP8; embeddings, "
                                 "lm_head, norms and routers stay in the model dtype. "
                                 f"{SUPPORTED_QUANTIZATION}")
            if t.dtype in _FP8_DTYPES and t.dtype != FP8_DTYPE:
                raise ValueError(f"model directory {path}: tensor {key!r} is {t.dtype}; only "
                                 f"float8_e4m3fn weights are supported. {SUPPORTED_QUANTIZATION}")
    _input_scales(tensors, path)


def _fp8_linear(tensors: dict[str, torch.Tensor], module: str, path: Path,
                block: tuple[int, int] | None = None) -> Fp8Weight:
    """A linear module's FP8 weight with its scale as one per output row: a per-tensor scale
    repeated, a per-channel one ([N] or [N, 1]) as is, block-wise scales (blocks of `block`,
    `_blockwise`) dequantized and quantized again per row (`_block_dequantized`)."""
    w = tensors[module + ".weight"]
    where = f"model directory {path}: {module}"
    if _blockwise(tensors, module, block):
        return quantize_fp8(_block_values(tensors, module, path, block))
    zero = tensors.get(module + ".weight_zero_point")
    if zero is not None and bool((zero != 0).any()):
        raise ValueError(f"{where}: a non-zero weight_zero_point (asymmetric FP8) is not "
                         f"supported. {SUPPORTED_QUANTIZATION}")
    s = tensors.get(module + ".weight_scale")
    if s is None:
        raise ValueError(f"{where}: float8 weight without a weight_scale")
    n = w.shape[0]
    if w.dim() != 2 or not s.is_floating_point() or s.dtype in _FP8_DTYPES \
            or s.numel() not in (1, n) or (s.numel() == n and s.dim() > 1 and s.shape[1:] != (1,)):
        raise ValueError(f"{where}: weight {list(w.shape)} with weight_scale {list(s.shape)} "
                         f"({s.dtype}); expected one scale per tensor ([] or [1]) or per output "
                         f"row ([{n}] or [{n}, 1]) in a float dtype (group-wise scales are not "
                         "supported; block-wise ones need quantization_config's "
                         "weight_block_size or block_structure)")
    scale = s.float().reshape(-1).expand(n).contiguous()
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{where}: weight_scale holds values that are not finite numbers > 0")
    return Fp8Weight(w, scale)


def _fp8_values(tensors: dict[str, torch.Tensor], module: str, path: Path,
               block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 linear module's weight as float32 values: weight times its scale, or its
    block's."""
    if _blockwise(tensors, module, block):
        return _block_values(tensors, module, path, block)
    return _fp8_linear(tensors, module, path).dequantize(torch.float32)


def _blockwise(tensors: dict[str, torch.Tensor], module: str,
               block: tuple[int, int] | None) -> bool:
    """Whether the module's scales are per block: a `weight_scale_inv` (vLLM's and HF's
    block-wise `fp8`), or in a block-wise checkpoint a 2-D `weight_scale` other than one per
    row ([N, 1]; compressed-tensors' block strategy)."""
    if module + ".weight_scale_inv" in tensors:
        return True
    s, w = tensors.get(module + ".weight_scale"), tensors[module + ".weight"]
    return (block is not None and s is not None and s.dim() == 2 and w.dim() == 2
            and tuple(s.shape) != (w.shape[0], 1))


def _block_values(tensors: dict[str, torch.Tensor], module: str, path: Path,
                  block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 values of a block-wise FP8 module (`_block_dequantized`): its weight and
    its `weight_scale_inv`, or its block-shaped `weight_scale`."""
    where = f"model directory {path}: {module}"
    if block is None:
        raise ValueError(f"{where}: weight_scale_inv (block-wise FP8) in a checkpoint whose "
                         f"quantization_config has no weight_block_size. {SUPPORTED_QUANTIZATION}")
    s = tensors.get(module + ".weight_scale_inv", tensors.get(module + ".weight_scale"))
    return _block_dequantized(tensors[module + ".weight"], s, block, where)


def _block_dequantized(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                       where: str) -> torch.Tensor:
    """W in float32 of an E4M3 weight w [N, K] and its scales s [ceil(N / rows), ceil(K /
    columns)] (`weight_scale_inv`, in any float dtype, finite and > 0): each element times
    its block's scale in float32, as HF transformers dequantizes it (exact for 16-bit
    scales: an E4M3 value has 4 significant bits)."""
    rows, cols = block
    if w.dim() != 2:
        raise ValueError(f"{where}: weight of shape {list(w.shape)} is not a matrix")
    n, k = w.shape
    grid = (-(-n // rows), -(-k // cols))
    if not s.is_floating_point() or s.dtype in _FP8_DTYPES or tuple(s.shape) != grid:
        raise ValueError(f"{where}: weight {[n, k]} with weight_scale_inv {list(s.shape)} "
                         f"({s.dtype}); weight_block_size {list(block)} needs {list(grid)} "
                         "scales in a float dtype")
    s = s.float()
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"{where}: weight_scale_inv holds values that are not finite numbers > 0")
    full = s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return w.float() * full


def _input_scales(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, float]:
    """module path -> its static activation scale (`.input_scale`): one finite number > 0."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".input_scale"):
            v = t.float().reshape(-1) if t.is_floating_point() else t.new_empty(0)
            if v.numel() != 1 or not (math.isfinite(v.item()) and v.item() > 0):
                raise ValueError(f"model directory {path}: {key} ({t.dtype}, shape "
                                 f"{list(t.shape)}) is not one finite number > 0")
            out[_module_of(key)] = v.item()
    return out


def _load_experts(get, p: str, cfg: ModelConfig, residual) -> Experts:
    """Layer prefix `p`'s experts, each expert's gate and up stacked as [gate | up], the downs
    through `residual` (Granite's multiplier): Mixtral's block_sparse_moe (w1 gate, w3 up, w2
    down, the router `gate`), Granite MoE's (already stacked: input_linear [gate | up],
    output_linear, the router `router.layer`), Qwen's and OLMoE's mlp (experts.K's gate_proj,
    up_proj and down_proj, the router `gate`)."""
    if cfg.architecture == "GraniteMoeForCausalLM":
        moe = p + "block_sparse_moe."
        return Experts(router=get(moe + "router.layer.weight"),
                       gate_up=get(moe + "input_linear.weight"),
                       down=residual(get(moe + "output_linear.weight")))
    if cfg.architecture == "MixtralForCausalLM":
        moe, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    e = [f"{moe}experts.{k}." for k in range(cfg.num_experts)]
    g, u, d = (f"{n}.weight" for n in names)
    return Experts(router=get(moe + "gate.weight"),
                   gate_up=torch.stack([torch.cat((get(x + g), get(x + u))) for x in e]),
                   down=residual(torch.stack([get(x + d) for x in e])))


# MXFP4's E2M1 values by their 4-bit code (sign, two exponent bits, one mantissa bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 weight dequantized: blocks uint8 [..., rows, G, 16] (two E2M1 codes a byte, the
    low nibble first), scales uint8 [..., rows, G] (E8M0: 2^(s - 127), one per 32 elements
    of a row) -> [..., rows, 32 G] in `dtype`. Exact in bfloat16 and float32 (an E2M1 value
    times a power of two)."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype,
                      device=blocks.device)
    # a matrix (an expert) at a time: the temporaries, 12 bytes an element, stay one expert's
    for o, b, s in zip(out.view(-1, *out.shape[-2:]), blocks.reshape(-1, *blocks.shape[-3:]),
                       scales.reshape(-1, *scales.shape[-2:])):
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).long()  # [rows, G, 16, 2]
        values = lut[codes].flatten(-2)  # [rows, G, 32]
        o.copy_(torch.ldexp(values, (s.long() - 127)[..., None].float()).flatten(-2))
    return out


def _gpt_oss_experts(get, raw, moe: str) -> Experts:
    """gpt-oss's experts under `moe` (model.layers.N.mlp.): the router (`router.weight`,
    `.bias`); gate_up_proj [E, hidden, 2I] with gate and up interleaved in its columns (gate
    the even ones), or, in an MXFP4 checkpoint, gate_up_proj_blocks / _scales of its transpose
    [E, 2I, hidden]; down_proj [E, I, hidden] (or blocks of [E, hidden, I]); their biases
    [E, 2I] (interleaved alike) and [E, hidden]. Served as `Experts` stacks: gate|up [E, 2I,
    hidden] with the gate rows first, down [E, hidden, I], in the model dtype. `get(name)`: a
    tensor in the model dtype on the device; `raw(name)`: one as stored there, or None."""
    router = get(moe + "router.weight")

    def weight(name: str) -> torch.Tensor:  # [E, out, in]
        blocks = raw(moe + f"experts.{name}_blocks")
        if blocks is None:
            return get(moe + f"experts.{name}").transpose(1, 2)
        return _mxfp4(blocks, raw(moe + f"experts.{name}_scales"), router.dtype)

    def halves(t: torch.Tensor) -> torch.Tensor:  # gate|up, interleaved on dim 1 -> stacked
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()

    return Experts(router=router, router_bias=get(moe + "router.bias"),
                   gate_up=halves(weight("gate_up_proj")),
                   down=weight("down_proj").contiguous(),
                   gate_up_bias=halves(get(moe + "experts.gate_up_proj_bias")),
                   down_bias=get(moe + "experts.down_proj_bias").contiguous())


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                   seed: int = 0) -> Weights:
    """Random weights of the right shapes (benchmarks on model shapes with no download)."""
    # Drawn on the target device: a 7B's 6.7e9 normals take ~45 s on one CPU thread.
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype=dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    ones = torch.ones(h, device=device, dtype=dtype)
    width = ((cfg.head_dim,) * 2 if cfg.qk_norm == "head" else (cfg.q_size, cfg.kv_size)
             if cfg.qk_norm else None)
    q_norm, k_norm = (None, None) if width is None else (
        torch.ones(n, device=device, dtype=dtype) for n in width)
    ln1, ln2, post_attn, post_mlp = (None if n is None else ones for n in _norm_names(cfg))
    e, ei = cfg.num_experts, cfg.expert_intermediate_size

    def experts() -> Experts:
        ex = Experts(rnd(e, h), rnd(e, 2 * ei, h), rnd(e, h, ei))
        if cfg.experts_bias:
            ex.router_bias, ex.gate_up_bias, ex.down_bias = rnd(e), rnd(e, 2 * ei), rnd(e, h)
        return ex
    layers = []
    for layer in range(cfg.num_layers):
        dense, moe = cfg.dense_mlp(layer), cfg.experts_in(layer)
        layers.append(LayerWeights(
            ln1=ln1, qkv=rnd(cfg.q_size + 2 * cfg.kv_size, h),
            qkv_bias=rnd(cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else None,
            o=rnd(h, cfg.q_size), o_bias=None, ln2=ln2,
            gate_up=rnd(2 * i, h) if dense else None, down=rnd(h, i) if dense else None,
            q_norm=q_norm, k_norm=k_norm, post_attn=post_attn, post_mlp=post_mlp,
            experts=experts() if moe else None,
            shared_gate=rnd(1, h) if moe and dense else None,
            sinks=rnd(cfg.num_heads, std=1.0).float() if cfg.attention_sinks else None))
    embed = rnd(cfg.vocab_size, h)
    return Weights(embed=embed, layers=layers, norm=ones,
                   lm_head=embed if cfg.tie_word_embeddings else rnd(cfg.vocab_size, h))


# ----------------------------------------------------------------------------- adapters

def strides(cfg: ModelConfig, module: str) -> tuple[int, int]:
    d_in, d_out = cfg.module_dims(module)
    return round_up(d_in, LORA_ALIGN), round_up(d_out, LORA_ALIGN)


def pack_adapter(cfg: ModelConfig, layout: AdapterLayout, page_size: int, dtype: torch.dtype,
                 get_ab, get_dora=None,
                 added: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The host copy of an adapter: [num_layers, num_pages * page_size], rows as laid out.

    `get_ab(layer, module)` returns (A [r, d_in], B [d_out, r] already scaled) or None; the
    VOCAB_MODULES are asked for at the layer whose slot holds them (`layout.vocab_layers`).
    `get_dora(layer, module)`, for the modules with a DoRA row (`layout.dora`), its d_out
    values magnitude / norm - 1 (the row stays 0 in layers where the module has rank 0).
    `added`: the added tokens' (embedding rows, lm_head rows), each [added_tokens, hidden].
    """
    flat = torch.zeros(cfg.num_layers, layout.num_pages(page_size) * page_size, dtype=dtype)
    rows = [(layer, m, name, layout.ranks[layer][m], layout.offsets[m])
            for layer in range(cfg.num_layers) for m, name in enumerate(LORA_MODULES)]
    rows += [(layer, None, name, r, offsets) for layer, name, r, offsets in
             zip(layout.vocab_layers, VOCAB_MODULES, layout.vocab_ranks, layout.vocab_offsets)]
    for layer, m, name, r, (off_a, off_b) in rows:
        if r == 0:
            continue
        A, B = get_ab(layer, name)
        s_in, s_out = strides(cfg, name)
        d_in, d_out = cfg.module_dims(name)
        flat[layer, off_a:off_a + r * s_in].view(r, s_in)[:, :d_in] = A
        flat[layer, off_b:off_b + r * s_out].view(r, s_out)[:, :d_out] = B.T
        if m is not None and layout.dora and layout.dora[m] >= 0:
            flat[layer, layout.dora[m]:layout.dora[m] + d_out] = get_dora(layer, name)
    n, h = layout.added_tokens, cfg.hidden_size
    stride = round_up(h, LORA_ALIGN)
    for layer, off, part in zip(layout.vocab_layers, layout.added_offsets, added or ()):
        flat[layer, off:off + n * stride].view(n, stride)[:, :h] = part
    return flat


def unpack_adapter(cfg: ModelConfig, layout: AdapterLayout,
                   flat: torch.Tensor) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of `pack_adapter` for LoRA rows: {(layer, module): (A [r, d_in], B [d_out,
    r] scaled)} of every module with a rank there, the VOCAB_MODULES at the layer whose slot
    holds them, in float32 (DoRA rows and added tokens are not read)."""
    rows = [(layer, name, layout.ranks[layer][m], layout.offsets[m])
            for layer in range(cfg.num_layers) for m, name in enumerate(LORA_MODULES)]
    rows += list(zip(layout.vocab_layers, VOCAB_MODULES, layout.vocab_ranks,
                     layout.vocab_offsets))
    out = {}
    for layer, name, r, (off_a, off_b) in rows:
        if r:
            s_in, s_out = strides(cfg, name)
            d_in, d_out = cfg.module_dims(name)
            A = flat[layer, off_a:off_a + r * s_in].view(r, s_in)[:, :d_in]
            B = flat[layer, off_b:off_b + r * s_out].view(r, s_out)[:, :d_out].T
            out[(layer, name)] = (A.float(), B.float())
    return out


RESIDUAL_MODULES = ("o_proj", "down_proj")  # the residual branches' output layers


def _norm_names(cfg: ModelConfig) -> tuple[str | None, ...]:
    """A layer's RMSNorms' checkpoint names (None: the layer has none there): its attention's
    input, its MLP's input, its attention's output, its MLP's output. With sandwich norms
    (Gemma 2/3, GLM-4) all four; without pre-norms (OLMo, EXAONE 4) the outputs' alone; in a
    parallel block (Cohere) the attention's input alone; else the inputs'."""
    if cfg.architecture == "Glm4ForCausalLM":
        return ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                "post_mlp_layernorm")
    if cfg.sandwich_norms:
        return ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                "post_feedforward_layernorm")
    if not cfg.pre_norms:
        return (None, None, "post_attention_layernorm", "post_feedforward_layernorm")
    if cfg.parallel_block:  # (Cohere: the MLP reads the attention's input)
        return ("input_layernorm", None, None, None)
    return ("input_layernorm", "post_attention_layernorm", None, None)


def served_qk(cfg: ModelConfig, heads: int, tail: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, scale): the served order of the rows of `heads` q or k heads (then `tail` rows
    as they are), each head's elements in `ModelConfig.rotary_permutation`'s order, and each
    served row's factor: 1, or 1 / the rope's attention factor for an element rotary leaves
    alone (HF scales the rotated elements' cos and sin by it, slora the scores by its
    square: so q.k of the unrotated elements keeps its scale). None with a whole rotary."""
    perm = cfg.rotary_permutation()
    if perm is None:
        return None
    d, r = cfg.head_dim, cfg.rotary
    rows = [h * d + i for h in range(heads) for i in perm] + list(range(heads * d,
                                                                        heads * d + tail))
    m = cfg.rope_attention_factor
    scale = [1.0 if i < r else 1.0 / m for _ in range(heads) for i in perm] + [1.0] * tail
    return torch.tensor(rows), torch.tensor(scale)

PEFT_PREFIX = "base_model.model."  # what PEFT puts before a module's path in its files
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}  # the weight dtypes an adapter file may hold
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header's JSON
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d{1,9})\.(self_attn|mlp|"
                  r"mlp\.shared_expert|mlp\.experts\.\d{1,9}|block_sparse_moe\.experts\.\d{1,9})\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|"
                  r"gate_up_proj)\.(?:lora_([AB])(?:\.default)?\.weight|"
                  r"lora_magnitude_vector(?:\.default)?(?:\.weight)?)$")
# LoRA on the vocabulary modules: embed_tokens' lora_embedding_A [r, vocab] / _B [hidden, r]
# (no `.weight` in PEFT's files), lm_head's lora_A [r, hidden] / lora_B [vocab, r]
_VOCAB_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.(embed_tokens)\.lora_embedding_([AB])"
                        r"(?:\.default)?(?:\.weight)?|(lm_head)\.lora_([AB])(?:\.default)?"
                        r"\.weight)$")
# A full copy of the embedding or the head (PEFT's save_embedding_layers, on by default when
# an adapter targets them): served when its rows equal the base model's
_VOCAB_COPY = re.compile(r"^(?:base_model\.model\.)?(?:model\.(embed_tokens)|(lm_head))"
                         r"(?:\.token_adapter)?(?:\.base_layer)?\.weight$")
# PEFT's trainable tokens: the new values of the embedding rows `trainable_token_indices` names
_DELTA = re.compile(r"^(?:base_model\.model\.)?model\.embed_tokens\.token_adapter\."
                    r"trainable_tokens_delta(?:\.default)?$")

SUPPORTED_VOCAB = ("slora serves LoRA on embed_tokens and lm_head (lora_embedding_A/B, lora_A/B), "
                   "and tokens an adapter adds past the base vocabulary (their embedding and "
                   "lm_head rows from save_embedding_layers copies, trainable_token_indices "
                   "deltas on those rows), beside copies whose base-vocabulary rows are the "
                   "base model's own")

Stamp = tuple[int, int, int, int]  # a file's (device, inode, size, mtime_ns)


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _positive(v) -> float | None:
    """`v` as a finite float > 0, or None (a bool, a string, NaN, inf, <= 0, an int past
    float's range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def _pattern(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern: first key that matches the end of the path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def _read_whole(file: Path, tries: int = 3) -> tuple[bytearray, os.stat_result]:
    """The file's bytes and its stat from one snapshot: the open file's size and mtime are the
    same before and after the read, so a file rewritten meanwhile is read again (`tries` reads
    at most, then OSError), never returned half old, half new. A file replaced by a rename
    while it is read is read whole from the inode that was opened."""
    for _ in range(tries):
        with open(file, "rb") as fh:
            before = os.fstat(fh.fileno())
            buf, got = bytearray(before.st_size), 0
            with memoryview(buf) as view:
                while got < len(buf):
                    n = fh.readinto(view[got:])
                    if not n:
                        break
                    got += n
            more = fh.read(1)
            after = os.fstat(fh.fileno())
        if got == len(buf) and not more and _stamp(before) == _stamp(after):
            return buf, after
    raise OSError(f"{file} kept changing while it was read ({tries} tries)")


# PEFT's init_lora_weights values that change the base weights at the start of training
# (PiSSA, CorDA, Astra and their variants, OLoRA, LoftQ, LoRA-GA): such an adapter fits the
# changed base until it is converted to a standard one, whose config says true
_BASE_CHANGING_INITS = ("pissa", "corda", "astra", "olora", "loftq", "lora_ga")


def _safetensors_entries(text: bytes) -> tuple[dict[str, tuple[str, tuple[int, ...], int]], int]:
    """A safetensors header's tensors, name -> (dtype, shape, offset of its data), and the
    bytes of data it describes. ValueError names what is wrong: not a JSON object, an entry
    without a supported dtype, a shape of integers >= 0 or two data offsets, offsets whose span
    is not dtype x shape, data that overlaps or leaves gaps."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    out, spans = {}, []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(v, dict):
            raise ValueError(f"header entry {key!r} is a JSON {type(v).__name__}, not an object")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"tensor {key!r}: dtype {dtype!r} is not supported "
                             f"({', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {key!r}: shape {shape!r} is not a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(is_int(o) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {key!r}: data_offsets {offsets!r} are not two integers "
                             "0 <= begin <= end")
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"tensor {key!r}: dtype {dtype} and shape {shape} take {nbytes} "
                             f"bytes but its data_offsets {offsets} span "
                             f"{offsets[1] - offsets[0]}")
        out[key] = (dtype, tuple(shape), offsets[0])
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise ValueError(f"tensor {key!r}: its data starts at byte {begin} of the data, not "
                             f"{end} (tensors overlap or leave a gap)")
        end = stop
    return out, end


class PeftAdapter:
    """A validated PEFT LoRA directory: its layout and how to read its weights.

    Registration (the constructor) reads the config and the weights' header: every tensor a
    LoRA A/B weight of a linear module, of a supported dtype, shaped for the base model. A
    `.bin` file is read whole then, its tensors checked for non-finite values and dropped.
    It records the weights file's stamp (device, inode, size, mtime_ns) and `digest`, the
    SHA-256 of its config and weights bytes (the adapter's identity: the prefix cache keys KV
    by it, so a name registered again with other weights never reuses the old KV); it keeps no
    weights:
    `pack` reads them at each host-tier miss, so `host_cache_gb` bounds every adapter's host
    memory. Every failure, at registration or in `pack`, raises `AdapterError` naming the
    adapter, the file and the reason."""

    def __init__(self, name: str, path: str | Path, cfg: ModelConfig,
                 base_vocab: dict[str, torch.Tensor] | None = None, max_added: int = 0) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"adapter {name!r}: path must be a str or os.PathLike, not "
                            f"{type(path).__name__} ({path!r})")
        self.name, self.path, self.cfg = name, Path(path), cfg
        self.config_file = conf_file = self.path / "adapter_config.json"
        if not conf_file.is_file():
            self._fail(conf_file, "no adapter_config.json (expected a PEFT LoRA directory)")
        try:
            text = conf_file.read_bytes()
        except OSError as e:
            self._fail(conf_file, f"cannot be read ({e})")
        try:
            conf = json.loads(text)
        except (ValueError, RecursionError) as e:
            self._fail(conf_file, f"not valid JSON ({e})")
        self._check_config(conf, conf_file)
        self.weights_file = self._find_weights()
        try:
            if self.weights_file.suffix == ".bin":
                buf, st = _read_whole(self.weights_file)
                weights = hashlib.sha256(buf).digest()
                tensors = self._bin_tensors(buf)
                shapes = {k: tuple(t.shape) for k, t in tensors.items()}
            else:
                with self.weights_file.open("rb") as fh:
                    st = os.fstat(fh.fileno())
                    head = fh.read(8)
                    n = int.from_bytes(head, "little")
                    if len(head) == 8 and 0 < n <= _MAX_HEADER:
                        head += fh.read(n)
                    fh.seek(0)
                    weights = hashlib.file_digest(fh, "sha256").digest()
                entries, _ = self._safetensors(head, st.st_size)
                shapes = {k: shape for k, (_, shape, _) in entries.items()}
        except OSError as e:
            self._fail(self.weights_file, f"cannot be read ({e})")
        if cfg.multimodal:  # (the text model's names; the vision tower's LoRA left out)
            shapes = text_tensors(shapes, PEFT_PREFIX)
        self._shapes = shapes  # every tensor of the file: what `pack` finds there again
        self._stamp = _stamp(st)
        self.digest = hashlib.sha256(text + b"\0" + weights).hexdigest()
        self._match(shapes)
        if self.weights_file.suffix == ".bin":
            self._check_finite(text_tensors(tensors, PEFT_PREFIX) if cfg.multimodal else tensors)
        self._check_vocab(base_vocab, max_added)

    def _fail(self, file: Path, why: str):
        raise AdapterError(f"adapter {self.name!r}: {file}: {why}", adapter=self.name)

    def _experts_fail(self, file: Path, key: str):
        """Refuse tensor `key`, a LoRA on a mixture of experts' experts (per expert, or on
        their stacked weights as PEFT wraps them)."""
        self._fail(file, f"tensor {key!r}: LoRA on a mixture of experts' experts is not "
                   "supported (served: LoRA on the attention"
                   + (" and the shared expert" if self.cfg.shared_expert else "")
                   + (" and the dense layers' MLP" if self.cfg.dense_layers else "") + ")")

    def _check_config(self, c, f: Path) -> None:
        if not isinstance(c, dict):
            self._fail(f, f"holds a JSON {type(c).__name__}, not an object")

        def flag(key: str) -> bool:
            v = c.get(key)
            if v is not None and not isinstance(v, bool):
                self._fail(f, f"{key}={v!r} must be true or false")
            return bool(v)

        if c.get("peft_type", "LORA") != "LORA":
            self._fail(f, f"peft_type {c.get('peft_type')!r} is not supported (only LORA)")
        if flag("fan_in_fan_out"):
            self._fail(f, "fan_in_fan_out=True is not supported")
        self.dora = flag("use_dora")
        if c.get("bias") not in (None, "none"):
            self._fail(f, f"bias={c.get('bias')!r} is not supported (only 'none')")
        if c.get("modules_to_save"):
            self._fail(f, f"modules_to_save={c['modules_to_save']!r} is not supported "
                       "(only LoRA weights are served)")
        init = c.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
            self._fail(f, f"init_lora_weights={init!r}: this initialisation changes the base "
                       "model's weights (W - B A at the start of training), so the adapter "
                       "needs that changed base, not this one: convert it to a standard LoRA "
                       "adapter first (PEFT: model.save_pretrained(out, "
                       "path_initial_model_for_weight_conversion=<the adapter as initialised>); "
                       "LoftQ: serve the base model LoftQ saved)")
        if c.get("target_parameters"):
            self._fail(f, f"target_parameters={c['target_parameters']!r} is not supported "
                       "(LoRA on parameters, such as a mixture of experts' stacked experts; "
                       f"served: target_modules among {', '.join(self.cfg.checkpoint_modules)})")
        r = c.get("r")
        if not is_int(r) or r < 1:
            self._fail(f, f"rank r={r!r} must be an integer >= 1")
        self.r = r
        self.token_indices = self._token_indices(c.get("trainable_token_indices"), f)
        self.alpha = _positive(c.get("lora_alpha", r))
        if self.alpha is None:
            self._fail(f, f"lora_alpha={c.get('lora_alpha')!r} must be a finite number > 0")
        self.rslora = flag("use_rslora")
        self.rank_pattern = self._patterns(c, "rank_pattern", f)
        if any(not is_int(v) or v < 1 for v in self.rank_pattern.values()):
            self._fail(f, f"rank_pattern {self.rank_pattern} must map to integers >= 1")
        self.alpha_pattern = self._patterns(c, "alpha_pattern", f)
        if any(_positive(v) is None for v in self.alpha_pattern.values()):
            self._fail(f, f"alpha_pattern {self.alpha_pattern} must map to finite numbers > 0")
        targets = c.get("target_modules")
        if targets is None:
            self._fail(f, "target_modules is missing")
        if isinstance(targets, str):
            targets = [targets]
        if (not isinstance(targets, list) or not targets
                or not all(isinstance(t, str) for t in targets)):
            self._fail(f, f"target_modules={c['target_modules']!r} must be a module name or a "
                       "non-empty list of them")
        if isinstance(c["target_modules"], list):  # names; a lone string is a regex
            names = self.cfg.checkpoint_modules + VOCAB_MODULES
            unknown = [t for t in targets if t.split(".")[-1] not in names]
            if unknown:
                self._fail(f, f"target_modules {unknown} are not linear modules of this "
                           f"{self.cfg.architecture} model ({', '.join(names)})")

    def _token_indices(self, v, f: Path) -> list[int]:
        """trainable_token_indices: absent, a list of token ids, or {"embed_tokens": ids}."""
        if isinstance(v, dict):
            if set(v) - {"embed_tokens"}:
                self._fail(f, f"trainable_token_indices {v!r}: only embed_tokens' are supported")
            v = v.get("embed_tokens")
        if v is None:
            return []
        if not isinstance(v, list) or not all(is_int(i) for i in v):
            self._fail(f, f"trainable_token_indices {v!r} must be a list of token ids")
        return [int(i) for i in v]

    def _patterns(self, c: dict, key: str, f: Path) -> dict:
        """rank_pattern / alpha_pattern: absent, null or a JSON object whose keys are regular
        expressions over module paths."""
        patterns = c.get(key)
        if patterns is None:
            return {}
        if not isinstance(patterns, dict):
            self._fail(f, f"{key}={patterns!r} must be a JSON object")
        for k in patterns:
            try:
                re.compile(rf"(.*\.)?{k}$")
            except (re.error, RecursionError, OverflowError) as e:
                self._fail(f, f"{key} key {k!r} is not a valid regular expression ({e})")
        return patterns

    def _find_weights(self) -> Path:
        for file in ("adapter_model.safetensors", "adapter_model.bin"):
            if (self.path / file).is_file():
                return self.path / file
        self._fail(self.path, "no adapter_model.safetensors or adapter_model.bin")

    def _safetensors(self, head, size: int) -> tuple[dict[str, tuple[str, tuple[int, ...], int]],
                                                     int]:
        """The tensors of a safetensors file of `size` bytes whose first bytes are `head` (at
        least its 8-byte length and header), and where its data starts."""
        file = self.weights_file
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if size < 8 or n == 0 or n > _MAX_HEADER or 8 + n > size:
            self._fail(file, f"not a valid safetensors file (header length {n} in a file of "
                       f"{size} bytes)")
        try:
            entries, data = _safetensors_entries(bytes(head[8:8 + n]))
        except ValueError as e:
            self._fail(file, f"not a valid safetensors file: {e}")
        if 8 + n + data != size:
            self._fail(file, f"file is {size} bytes but its header describes {8 + n + data} "
                       "(truncated or corrupt)")
        return entries, 8 + n

    def _bin_tensors(self, buf: bytearray) -> dict[str, torch.Tensor]:
        """The state dict a `.bin` file holds: str -> a dense tensor of a supported dtype."""
        file = self.weights_file
        try:
            state = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            self._fail(file, f"cannot be read with torch.load(weights_only=True): "
                       f"{type(e).__name__}: {e}")
        if not isinstance(state, dict):
            self._fail(file, f"holds a {type(state).__name__}, not a state dict of tensors")
        for key, t in state.items():
            if not isinstance(key, str):
                self._fail(file, f"key {key!r} is a {type(key).__name__}, not a tensor name")
            if not isinstance(t, torch.Tensor):
                self._fail(file, f"entry {key!r} is a {type(t).__name__}, not a tensor")
            if t.dtype not in _DTYPES.values() or t.layout != torch.strided:
                self._fail(file, f"tensor {key!r}: {t.dtype} ({t.layout}) is not supported "
                           "(dense float64, float32, float16 or bfloat16)")
        return state

    def _match(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Map the file's tensors to (layer, module) A/B pairs shaped for the base model, with
        their ranks and scalings: `keys`, `scaling`, `layout`."""
        cfg, file = self.cfg, self.weights_file
        prefixes: dict[tuple[int, str], dict[str, str]] = {}
        for key, shape in shapes.items():
            v = _VOCAB_KEY.match(key)
            if v is not None:  # (stored at the layer whose slot holds it: AdapterLayout)
                module, ab = v.group(1) or v.group(3), v.group(2) or v.group(4)
                layer = 0 if module == "embed_tokens" else cfg.num_layers - 1
                m = None
            elif _VOCAB_COPY.match(key) or _DELTA.match(key):
                continue  # checked against the base model's rows (_check_vocab)
            else:
                m = _KEY.match(key)
                if m is None and ".experts." in key:  # (PEFT's LoRA on stacked experts' weights)
                    self._experts_fail(file, key)
                if m is None:
                    self._fail(file, f"tensor {key!r} is not a LoRA A/B weight or DoRA "
                               "magnitude of a q/k/v/o/gate/up/down projection, or a LoRA A/B "
                               "weight of embed_tokens or lm_head (bias or modules_to_save "
                               "weights are not supported)")
                layer, parent, module, ab = (int(m.group(1)), m.group(2), m.group(3),
                                             m.group(4) or "M")
                if ".experts." in parent:
                    self._experts_fail(file, key)
            if m is not None and module not in cfg.checkpoint_modules:
                self._fail(file, f"tensor {key!r}: this {cfg.architecture} model has no "
                           f"{module} (its linear modules: {', '.join(cfg.checkpoint_modules)})")
            if layer >= cfg.num_layers:
                self._fail(file, f"tensor {key!r}: layer {layer} but the base model has "
                           f"{cfg.num_layers} layers")
            if m is not None and parent != "self_attn" and parent != cfg.mlp_path(layer):
                self._fail(file, f"tensor {key!r}: layer {layer}'s "
                           + (f"dense MLP is model.layers.{layer}.{cfg.mlp_path(layer)}"
                              if cfg.dense_mlp(layer) else
                              "MLP is a mixture of experts, which takes no LoRA"))
            if ab == "M" and not self.dora:
                self._fail(file, f"tensor {key!r} is a DoRA magnitude but adapter_config.json "
                           "does not set use_dora=true")
            if len(shape) != (1 if ab == "M" else 2):
                self._fail(file, f"tensor {key!r}: shape {list(shape)} is not a "
                           f"{'vector' if ab == 'M' else 'matrix'}")
            pair = prefixes.setdefault((layer, module), {})
            if ab in pair:
                self._fail(file, f"tensors {pair[ab]!r} and {key!r} are both layer {layer} "
                           f"{module}'s {'lora_' + ab if ab != 'M' else 'lora_magnitude_vector'}")
            pair[ab] = key
        self.scaling: dict[tuple[int, str], float] = {}
        self.keys: dict[tuple[int, str], tuple[str, str]] = {}
        # (layer, module) -> B's rows [start, end) that are this module's, where the file's
        # LoRA is on a FUSED_MODULES module: its parts share A and take B's rows in order.
        self.rows: dict[tuple[int, str], tuple[int, int]] = {}
        # DoRA: (layer, module) -> the key of its checkpoint module's magnitude vector (its
        # `rows` slice where the module is a part of a fused one)
        self.magnitudes: dict[tuple[int, str], str] = {}
        ranks = [[0] * len(LORA_MODULES) for _ in range(cfg.num_layers)]
        vocab_ranks = [0] * len(VOCAB_MODULES)
        for (layer, module), ab in sorted(prefixes.items()):
            if set(ab) - {"M"} != {"A", "B"}:
                self._fail(file, f"layer {layer} {module}: lora_A or lora_B missing")
            if self.dora and "M" not in ab:
                self._fail(file, f"layer {layer} {module}: lora_magnitude_vector missing "
                           "(use_dora=true: every LoRA module has one; DoRA on embed_tokens "
                           "or lm_head is not supported)")
            if self.dora and shapes[ab["M"]] != (cfg.module_dims(module)[1],):
                self._fail(file, f"tensor {ab['M']!r}: shape {list(shapes[ab['M']])} does not "
                           f"fit the base model (expected [{cfg.module_dims(module)[1]}], one "
                           "value per output channel)")
            path_ = (f"model.layers.{layer}."
                     f"{'self_attn' if module[0] in 'qkvo' else cfg.mlp_path(layer)}.{module}")
            if module in VOCAB_MODULES:
                path_ = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
            r_a, d_in = shapes[ab["A"]]
            d_out, r_b = shapes[ab["B"]]
            want_in, want_out = cfg.module_dims(module)
            r = _pattern(self.rank_pattern, path_, self.r)
            if (d_in, d_out) != (want_in, want_out) or r_a != r_b or r_a != r:
                self._fail(file, f"layer {layer} {module}: lora_A {list(shapes[ab['A']])} "
                           f"and lora_B {list(shapes[ab['B']])} do not fit the base model "
                           f"(expected A [{r}, {want_in}], B [{want_out}, {r}])")
            alpha = float(_pattern(self.alpha_pattern, path_, self.alpha))
            scaling = alpha / (math.sqrt(r) if self.rslora else r)
            # (Granite: a residual branch's output, its LoRA's too, times residual_multiplier;
            # the base weight holds it already, load_weights)
            scaling *= cfg.residual_multiplier if module in RESIDUAL_MODULES else 1.0
            if not (math.isfinite(scaling) and scaling > 0):
                self._fail(self.config_file, f"layer {layer} {module}: scaling {scaling!r} "
                           f"(lora_alpha {alpha!r}, rank {r}) is not a finite number > 0")
            start = 0
            for part in FUSED_MODULES.get(module, (module,)):
                end = start + cfg.module_dims(part)[1]
                if module in FUSED_MODULES:
                    self.rows[(layer, part)] = (start, end)
                self.scaling[(layer, part)] = scaling
                if part in VOCAB_MODULES:
                    vocab_ranks[VOCAB_MODULES.index(part)] = r
                else:
                    ranks[layer][LORA_MODULES.index(part)] = r
                self.keys[(layer, part)] = (ab["A"], ab["B"])
                if self.dora:
                    self.magnitudes[(layer, part)] = ab["M"]
                start = end
        if not self.keys:
            self._fail(file, "holds no LoRA weights")
        self.layout = AdapterLayout.build(cfg, ranks, {m for _, m in self.magnitudes},
                                          tuple(vocab_ranks))

    def _check_vocab(self, base_vocab: dict[str, torch.Tensor] | None, max_added: int) -> None:
        """The file's full copies of embed_tokens and lm_head (PEFT's save_embedding_layers,
        on when an adapter targets them or resizes the vocabulary; `token_adapter.base_layer`
        beside trainable tokens) are served when their first `vocab` rows are the base
        model's own (`base_vocab`: module -> its weight [vocab, hidden], compared in its
        dtype; not compared without it). Rows past them are tokens the adapter adds: at most
        `max_added` (EngineConfig.max_added_tokens), with an embedding copy and, unless the
        embeddings are tied, a head copy of as many rows; `trainable_token_indices` deltas
        replace embedding rows of those added tokens only. Anything else is an AdapterError
        naming what slora serves. Sets `added_tokens`, `copies` (module -> key) and the
        layout with the added rows."""
        file, cfg, vocab = self.weights_file, self.cfg, self.cfg.vocab_size
        self.copies = {m.group(1) or m.group(2): k for k in sorted(self._shapes)
                       if (m := _VOCAB_COPY.match(k)) is not None}
        self.delta_key = next((k for k in self._shapes if _DELTA.match(k)), None)
        self.added_tokens = 0
        if not self.copies and self.delta_key is None:
            return
        for module, key in self.copies.items():
            if len(self._shapes[key]) != 2 or self._shapes[key][1] != cfg.hidden_size:
                self._fail(file, f"tensor {key!r}: a {module} copy of shape "
                           f"{list(self._shapes[key])}, not [rows, {cfg.hidden_size}]")
        rows = {self._shapes[k][0] for k in self.copies.values()}
        n = max(rows, default=vocab) - vocab
        if len(rows) > 1 or n < 0:
            self._fail(file, f"its embed_tokens / lm_head copies hold {sorted(rows)} rows, for "
                       f"a base vocabulary of {vocab}; {SUPPORTED_VOCAB}")
        indices = self.token_indices
        if self.delta_key is not None:
            bad = [i for i in indices if not vocab <= i < vocab + n]
            if bad or self._shapes[self.delta_key] != (len(indices), cfg.hidden_size):
                self._fail(file, f"trainable_token_indices {bad or indices} (delta "
                           f"{list(self._shapes[self.delta_key])}): only rows of tokens the "
                           f"adapter adds (ids {vocab} to {vocab + n - 1}) may be trained, not "
                           f"the base vocabulary's; {SUPPORTED_VOCAB}")
        if n:
            if any(self.layout.vocab_ranks):
                self._fail(file, f"adds {n} tokens and has LoRA on embed_tokens / lm_head: "
                           f"not supported together; {SUPPORTED_VOCAB}")
            missing = [m for m in VOCAB_MODULES
                       if m not in self.copies and not (m == "lm_head" and cfg.tie_word_embeddings)]
            if missing:
                self._fail(file, f"adds {n} tokens but holds no {' or '.join(missing)} rows for "
                           "them (save the adapter with save_embedding_layers=True)")
            if n > max_added:
                self._fail(file, f"adds {n} tokens (ids {vocab} to {vocab + n - 1}) but "
                           f"EngineConfig.max_added_tokens is {max_added}; raise it to {n} or "
                           "more to serve them")
        if base_vocab is not None:
            tensors, _ = self._read()
            for module, key in self.copies.items():
                base, saved = base_vocab[module], tensors[key][:vocab]
                if not torch.equal(saved.to(device=base.device, dtype=base.dtype), base):
                    self._fail(file, f"tensor {key!r}: its saved {module} differs from the base "
                               "model's in the base vocabulary's rows (a trained full copy, as "
                               f"modules_to_save makes); {SUPPORTED_VOCAB}")
        self.added_tokens = n
        self.layout = AdapterLayout.build(cfg, [list(r) for r in self.layout.ranks],
                                          self.layout.dora_modules, self.layout.vocab_ranks, n)

    def added_rows(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The added tokens' (embedding rows, lm_head rows), each [added_tokens, hidden] in
        float32: the copies' rows past the base vocabulary, the trainable-token deltas in
        place; a tied model's head rows are its embedding rows."""
        vocab = self.cfg.vocab_size
        embed = tensors[self.copies["embed_tokens"]][vocab:].float().clone()
        if self.delta_key is not None:
            embed[torch.tensor(self.token_indices) - vocab] = tensors[self.delta_key].float()
        if self.cfg.tie_word_embeddings:
            return embed, embed
        return embed, tensors[self.copies["lm_head"]][vocab:].float()

    def _check_finite(self, tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> None:
        """AdapterError naming the first LoRA tensor that holds NaN or inf, or (with `dtype`)
        that does once scaled and cast to `dtype`."""
        for (layer, module), (ka, kb) in self.keys.items():
            for key in (ka, kb, self.magnitudes.get((layer, module), ka)):
                if not bool(torch.isfinite(tensors[key]).all()):
                    self._fail(self.weights_file, f"tensor {key!r} holds non-finite values "
                               "(NaN or inf)")
        if dtype is None:
            return
        for (layer, module), (ka, kb) in self.keys.items():
            s = self.scaling[(layer, module)]
            for key, t in ((ka, tensors[ka].float()), (kb, tensors[kb].float() * s)):
                if not bool(torch.isfinite(t.to(dtype)).all()):
                    self._fail(self.weights_file, f"tensor {key!r} overflows {dtype} once "
                               f"scaled by {s:g} (non-finite values)")

    def _read(self) -> tuple[dict[str, torch.Tensor], Stamp]:
        """The weights file's tensors, read whole from one snapshot, and its stamp. A file
        changed since registration is validated again and must hold the same tensors of the
        same shapes; otherwise AdapterError: it changed, re-add the adapter."""
        file = self.weights_file
        try:
            buf, st = _read_whole(file)
        except OSError as e:
            self._fail(file, f"cannot be read ({e})")
        if file.suffix == ".bin":
            tensors = self._bin_tensors(buf)
        else:
            entries, start = self._safetensors(buf, st.st_size)
            tensors = {k: torch.frombuffer(buf, dtype=_DTYPES[dtype], count=math.prod(shape),
                                           offset=start + offset).view(shape)
                       if math.prod(shape) else torch.empty(shape, dtype=_DTYPES[dtype])
                       for k, (dtype, shape, offset) in entries.items()}
        if self.cfg.multimodal:
            tensors = text_tensors(tensors, PEFT_PREFIX)
        shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        if shapes != self._shapes:
            key = sorted(set(shapes.items()) ^ set(self._shapes.items()))[0][0]
            what = ("changed since add_adapter and no longer matches" if _stamp(st) != self._stamp
                    else "no longer matches")
            self._fail(file, f"{what} the layout registered (tensor {key!r}: "
                       f"{self._shapes.get(key)} registered, {shapes.get(key)} now); "
                       "remove_adapter and add_adapter it again")
        return tensors, _stamp(st)

    def pack(self, page_size: int, dtype: torch.dtype, weight_norms=None) -> torch.Tensor:
        """Read the weights file whole and lay the adapter out for the pool: the host tier's
        copy, [num_layers, num_pages * page_size] of `dtype`. Called at each host-tier miss,
        possibly long after registration: a file changed since then is validated again (see
        `_read`) and its new weights served if its layout is the same. Any failure (a file
        gone, unreadable, rewritten to another layout, weights that are NaN or inf or overflow
        `dtype`) raises AdapterError with `adapter` = this adapter's name; nothing changes on
        failure.

        DoRA: `weight_norms(items)` (the runner's, where the base weights are) takes a list
        of (layer, module, A, B scaled) and returns each module's ||W + B A|| per output row
        (float32, on the host); the DoRA rows get magnitude / norm - 1."""
        try:
            tensors, stamp = self._read()

            def get_ab(layer, module):
                ka, kb = self.keys[(layer, module)]
                start, end = self.rows.get((layer, module), (0, None))
                B = self._served_rows(module, tensors[kb][start:end].float())
                return tensors[ka].float(), B * self.scaling[(layer, module)]

            deltas = self._dora_deltas(tensors, get_ab, weight_norms) if self.dora else {}
            flat = pack_adapter(self.cfg, self.layout, page_size, dtype, get_ab,
                                lambda layer, module: deltas[(layer, module)],
                                self.added_rows(tensors) if self.added_tokens else None)
            if not bool(torch.isfinite(flat).all()):
                self._check_finite(tensors, dtype)
                self._fail(self.weights_file, "its packed weights hold non-finite values")
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed read fails this adapter alone
            raise AdapterError(f"adapter {self.name!r}: {self.weights_file}: cannot be read "
                               f"({type(e).__name__}: {e})", adapter=self.name) from e
        self._stamp = stamp
        return flat

    def _served_rows(self, module: str, t: torch.Tensor) -> torch.Tensor:
        """A q_proj or k_proj output's rows (B's, a DoRA magnitude) as served (`served_qk`),
        as the base weight's are; other modules' as they are."""
        heads = {"q_proj": self.cfg.num_heads, "k_proj": self.cfg.num_kv_heads}.get(module)
        served = served_qk(self.cfg, heads) if heads else None
        if served is None:
            return t
        rows, scale = served
        return t[rows] * (scale[:, None] if t.dim() == 2 else scale)

    def _dora_deltas(self, tensors, get_ab, weight_norms) -> dict[tuple[int, str], torch.Tensor]:
        """(layer, module) -> magnitude / ||W + s B A||_row - 1, the norms from
        `weight_norms` (see `pack`)."""
        if weight_norms is None:
            raise ValueError("a DoRA adapter's norms need the base weights: pack(..., "
                             "weight_norms=ModelRunner.weight_norms)")
        items = list(self.magnitudes)
        norms = weight_norms([(layer, module, *get_ab(layer, module))
                              for layer, module in items])
        deltas = {}
        for (layer, module), norm in zip(items, norms):
            start, end = self.rows.get((layer, module), (0, None))
            mag = self._served_rows(module, tensors[self.magnitudes[(layer, module)]][start:end]
                                    .float())
            if module in RESIDUAL_MODULES:  # (W and B hold residual_multiplier: the norm too)
                mag = mag * self.cfg.residual_multiplier
            delta = mag / norm.float() - 1
            if not bool(torch.isfinite(delta).all()):
                self._fail(self.weights_file, f"layer {layer} {module}: DoRA's magnitude / "
                           "||W + s B A|| is not finite (a row of W + s B A has norm 0)")
            deltas[(layer, module)] = delta
        return deltas


def synthetic_pack(cfg: ModelConfig, layout: AdapterLayout, page_size: int, dtype: torch.dtype,
                   seed: int) -> torch.Tensor:
    """Random A and B (small, so outputs stay sane) laid out like a real adapter, and random
    DoRA rows where the layout has them."""
    g = torch.Generator().manual_seed(seed)

    def get_ab(layer, module):
        r = (layout.vocab_ranks[VOCAB_MODULES.index(module)] if module in VOCAB_MODULES
             else layout.ranks[layer][LORA_MODULES.index(module)])
        d_in, d_out = cfg.module_dims(module)
        return (torch.randn(r, d_in, generator=g) / math.sqrt(d_in),
                torch.randn(d_out, r, generator=g) * 0.01)

    def get_dora(layer, module):  # a DoRA rescale within a few percent of 1
        return torch.randn(cfg.module_dims(module)[1], generator=g) * 0.01

    return pack_adapter(cfg, layout, page_size, dtype, get_ab, get_dora)
