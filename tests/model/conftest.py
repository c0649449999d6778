"""Fixtures of the adapter tests: PEFT adapter directories written directly (any tensors, any
config, either weights format), without peft or a base model in memory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


def lora_tensors(cfg, r=4, modules=("q_proj", "v_proj"), seed=0, fill=None):
    """A PEFT state dict for `cfg`: lora_A [r, d_in] and lora_B [d_out, r] of each module in
    every layer, random (or all `fill`)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            d_in, d_out = cfg.module_dims(m)
            part = "self_attn" if m[0] in "qkvo" else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{m}"
            for ab, shape in (("A", (r, d_in)), ("B", (d_out, r))):
                t = torch.randn(*shape, generator=g) * 0.1
                out[f"{p}.lora_{ab}.weight"] = t.fill_(fill) if fill is not None else t
    return out


def write_adapter(d: Path, tensors: dict, config=None, fmt="safetensors"):
    """A PEFT directory at `d` (replacing what was there): `config` (default r=4 on q/v) and
    `tensors` as adapter_model.safetensors or adapter_model.bin."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    for f in ("adapter_model.safetensors", "adapter_model.bin"):
        (d / f).unlink(missing_ok=True)
    conf = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    (d / "adapter_config.json").write_text(json.dumps(conf if config is None else config))
    if fmt == "safetensors":
        save_file(tensors, d / "adapter_model.safetensors")
    else:
        torch.save(tensors, d / "adapter_model.bin")
    return d


@pytest.fixture(scope="session")


def peft_files():
    """`tensors(cfg, r, modules, seed, fill)`: a PEFT state dict; `write(dir, tensors, config,
    fmt)`: a PEFT directory holding it."""
    return SimpleNamespace(tensors=lora_tensors, write=write_adapter)
