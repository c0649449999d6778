"""Loading from local Hugging Face directories: base models and PEFT LoRA adapters.

Base model: config.json, model.safetensors or shards listed in model.safetensors.index.json.
Adapter: adapter_config.json + adapter_model.safetensors (or adapter_model.bin, read with
torch.load(weights_only=True)). An adapter is validated against the base model when it is
registered (config, every tensor present with the right shape, sizes against the
safetensors header) and read again only when it is loaded into the host tier.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from slora.config import LORA_ALIGN, LORA_MODULES, ModelConfig, round_up
from slora.core.adapters import AdapterLayout
from slora.model.llama import LayerWeights, Weights


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message names adapter, file and reason."""


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


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> Weights:
    path = Path(path)
    if cfg.mlp_bias:
        raise ValueError(f"{path}: mlp_bias=True is not supported")
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                tensors[key] = fh.get_tensor(key)

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise KeyError(f"model directory {path}: weight {name!r} not found")
        return t.to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([get(a + f"{m}_proj.bias") for m in "qkv"])
        layers.append(LayerWeights(
            ln1=get(p + "input_layernorm.weight"),
            qkv=torch.cat([get(a + f"{m}_proj.weight") for m in "qkv"]),
            qkv_bias=qkv_bias,
            o=get(a + "o_proj.weight"),
            o_bias=maybe(a + "o_proj.bias") if cfg.o_bias else None,
            ln2=get(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            down=get(p + "mlp.down_proj.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in tensors \
        else get("lm_head.weight")
    return Weights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                   seed: int = 0) -> Weights:
    """Random weights of the right shapes (benchmarks on model shapes with no download)."""
    # Drawn on the target device: a 7B's 6.7e9 normals take ~45 s on one CPU thread.
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype=dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    ones = torch.ones(h, device=device, dtype=dtype)
    layers = [LayerWeights(ln1=ones, qkv=rnd(cfg.q_size + 2 * cfg.kv_size, h),
                           qkv_bias=rnd(cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else None,
                           o=rnd(h, cfg.q_size), o_bias=None, ln2=ones, gate_up=rnd(2 * i, h),
                           down=rnd(h, i)) for _ in range(cfg.num_layers)]
    embed = rnd(cfg.vocab_size, h)
    return Weights(embed=embed, layers=layers, norm=ones,
                   lm_head=embed if cfg.tie_word_embeddings else rnd(cfg.vocab_size, h))


# ----------------------------------------------------------------------------- adapters

def strides(cfg: ModelConfig, module: str) -> tuple[int, int]:
    d_in, d_out = cfg.module_dims(module)
    return round_up(d_in, LORA_ALIGN), round_up(d_out, LORA_ALIGN)


def pack_adapter(cfg: ModelConfig, layout: AdapterLayout, page_size: int, dtype: torch.dtype,
                 get_ab) -> torch.Tensor:
    """The host copy of an adapter: [num_layers, num_pages * page_size], rows as laid out.

    `get_ab(layer, module)` returns (A [r, d_in], B [d_out, r] already scaled) or None.
    """
    flat = torch.zeros(cfg.num_layers, layout.num_pages(page_size) * page_size, dtype=dtype)
    for layer in range(cfg.num_layers):
        for m, name in enumerate(LORA_MODULES):
            r = layout.ranks[layer][m]
            if r == 0:
                continue
            A, B = get_ab(layer, name)
            s_in, s_out = strides(cfg, name)
            d_in, d_out = cfg.module_dims(name)
            off_a, off_b = layout.offsets[m]
            flat[layer, off_a:off_a + r * s_in].view(r, s_in)[:, :d_in] = A
            flat[layer, off_b:off_b + r * s_out].view(r, s_out)[:, :d_out] = B.T
    return flat


_UNSUPPORTED = {
    "use_dora": (True,),
    "fan_in_fan_out": (True,),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


def _pattern(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern: first key that matches the end of the path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


class PeftAdapter:
    """A validated PEFT LoRA directory: its layout and how to read its weights."""

    def __init__(self, name: str, path: str | Path, cfg: ModelConfig) -> None:
        self.name, self.path, self.cfg = name, Path(path), cfg
        conf_file = self.path / "adapter_config.json"
        if not conf_file.is_file():
            self._fail(conf_file, "no adapter_config.json (expected a PEFT LoRA directory)")
        try:
            conf = json.loads(conf_file.read_text())
        except json.JSONDecodeError as e:
            self._fail(conf_file, f"not valid JSON ({e})")
        self._check_config(conf, conf_file)
        self.weights_file, shapes = self._read_header()
        self.scaling: dict[tuple[int, str], float] = {}
        ranks = [[0] * len(LORA_MODULES) for _ in range(cfg.num_layers)]
        self.keys: dict[tuple[int, str], tuple[str, str]] = {}
        prefixes = {}
        for key in shapes:
            m = _KEY.match(key)
            if m is None:
                self._fail(self.weights_file, f"tensor {key!r} is not a LoRA A/B weight of a "
                           "q/k/v/o/gate/up/down projection (embedding, lm_head, bias or "
                           "modules_to_save weights are not supported)")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= cfg.num_layers:
                self._fail(self.weights_file, f"tensor {key!r}: layer {layer} but the base "
                           f"model has {cfg.num_layers} layers")
            prefixes.setdefault((layer, module), {})[ab] = key
        for (layer, module), ab in sorted(prefixes.items()):
            if set(ab) != {"A", "B"}:
                self._fail(self.weights_file, f"layer {layer} {module}: lora_A or lora_B missing")
            path_ = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
            r_a, d_in = shapes[ab["A"]]
            d_out, r_b = shapes[ab["B"]]
            want_in, want_out = cfg.module_dims(module)
            r = _pattern(self.rank_pattern, path_, self.r)
            if (d_in, d_out) != (want_in, want_out) or r_a != r_b or r_a != r:
                self._fail(self.weights_file, f"layer {layer} {module}: lora_A {shapes[ab['A']]} "
                           f"and lora_B {shapes[ab['B']]} do not fit the base model "
                           f"(expected A [{r}, {want_in}], B [{want_out}, {r}])")
            alpha = _pattern(self.alpha_pattern, path_, self.alpha)
            self.scaling[(layer, module)] = alpha / (math.sqrt(r) if self.rslora else r)
            ranks[layer][LORA_MODULES.index(module)] = r
            self.keys[(layer, module)] = (ab["A"], ab["B"])
        if not self.keys:
            self._fail(self.weights_file, "holds no LoRA weights")
        self.layout = AdapterLayout.build(cfg, ranks)

    def _fail(self, file: Path, why: str):
        raise AdapterError(f"adapter {self.name!r}: {file}: {why}")

    def _check_config(self, c: dict, f: Path) -> None:
        if c.get("peft_type", "LORA") != "LORA":
            self._fail(f, f"peft_type {c.get('peft_type')!r} is not supported (only LORA)")
        for key, bad in _UNSUPPORTED.items():
            if c.get(key) in bad:
                self._fail(f, f"{key}={c.get(key)!r} is not supported")
        if c.get("bias", "none") != "none":
            self._fail(f, f"bias={c.get('bias')!r} is not supported (only 'none')")
        if c.get("modules_to_save"):
            self._fail(f, f"modules_to_save={c['modules_to_save']!r} is not supported "
                       "(only LoRA weights are served)")
        r = c.get("r")
        if not isinstance(r, int) or r < 1:
            self._fail(f, f"rank r={r!r} must be an integer >= 1")
        self.r = r
        self.alpha = c.get("lora_alpha", r)
        self.rslora = bool(c.get("use_rslora", False))
        self.rank_pattern = c.get("rank_pattern") or {}
        self.alpha_pattern = c.get("alpha_pattern") or {}
        if any(not isinstance(v, int) or v < 1 for v in self.rank_pattern.values()):
            self._fail(f, f"rank_pattern {self.rank_pattern} must map to integers >= 1")
        targets = c.get("target_modules")
        if targets is None:
            self._fail(f, "target_modules is missing")
        bad = [t for t in ([targets] if isinstance(targets, str) else targets)
               if t in ("embed_tokens", "lm_head")]
        if bad:
            self._fail(f, f"target_modules {bad} is not supported (LoRA on linear layers only)")
        if isinstance(targets, list):
            unknown = [t for t in targets if t.split(".")[-1] not in LORA_MODULES]
            if unknown:
                self._fail(f, f"target_modules {unknown} are not linear modules of a Llama-family "
                           f"model ({', '.join(LORA_MODULES)})")

    def _read_header(self) -> tuple[Path, dict[str, tuple[int, ...]]]:
        st = self.path / "adapter_model.safetensors"
        if st.is_file():
            size = st.stat().st_size
            try:
                with st.open("rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    if n <= 0 or 8 + n > size:
                        raise ValueError("header length beyond the file")
                    header = json.loads(fh.read(n))
            except ValueError as e:
                self._fail(st, f"not a valid safetensors file ({e})")
            header.pop("__metadata__", None)
            end = max((v["data_offsets"][1] for v in header.values()), default=0)
            if 8 + n + end != size:
                self._fail(st, f"file is {size} bytes but its header describes {8 + n + end} "
                           "(truncated or corrupt)")
            return st, {k: tuple(v["shape"]) for k, v in header.items()}
        binf = self.path / "adapter_model.bin"
        if binf.is_file():
            try:
                self._bin = torch.load(binf, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
                self._fail(binf, f"cannot be read with torch.load(weights_only=True): {e}")
            return binf, {k: tuple(v.shape) for k, v in self._bin.items()}
        self._fail(self.path, "no adapter_model.safetensors or adapter_model.bin")

    def pack(self, page_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Read the weights and lay them out for the pool (the host-tier copy)."""
        if self.weights_file.suffix == ".bin":
            tensors = self._bin
        else:
            with safe_open(str(self.weights_file), framework="pt") as fh:
                tensors = {k: fh.get_tensor(k) for pair in self.keys.values() for k in pair}

        def get_ab(layer, module):
            ka, kb = self.keys[(layer, module)]
            A = tensors[ka].float()
            B = tensors[kb].float() * self.scaling[(layer, module)]
            return A, B

        return pack_adapter(self.cfg, self.layout, page_size, dtype, get_ab)


def synthetic_pack(cfg: ModelConfig, layout: AdapterLayout, page_size: int, dtype: torch.dtype,
                   seed: int) -> torch.Tensor:
    """Random A and B (small, so outputs stay sane) laid out like a real adapter."""
    g = torch.Generator().manual_seed(seed)

    def get_ab(layer, module):
        r = layout.ranks[layer][LORA_MODULES.index(module)]
        d_in, d_out = cfg.module_dims(module)
        return (torch.randn(r, d_in, generator=g) / math.sqrt(d_in),
                torch.randn(d_out, r, generator=g) * 0.01)

    return pack_adapter(cfg, layout, page_size, dtype, get_ab)
