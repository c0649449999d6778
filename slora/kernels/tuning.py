"""Kernel tile choices per GPU, as data: `configs/<kind>.json`.

A table maps each kernel's name to an ordered list of rules:

    "mbgmv_expand": [
        {"when": {"rows": [0, 128]}, "cfg": {"BLOCK_R": 4, "CHN": 4, "num_warps": 4}},
        {"cfg": {"BLOCK_R": 2, "CHN": 8, "num_warps": 4}}
    ]

The first rule whose every condition holds gives the kernel's choice (`cfg`: its launch's
constexprs and options, or the parameters its config function reads). A condition
`"q": [lo, hi]` holds for lo <= q < hi, null leaving that side open; a rule without `when`
always holds, and every list ends with one. The quantities a kernel's rules may test are the
ones its config function passes (its docstring names them): shape buckets such as `rows` or
`rank`, and quantities of the rule's own tile such as `programs`, the grid that tile gives,
evaluated after the config function has fitted the tile to the data.

Kinds: a table per tuned GPU (`h200`), `generic` for any other CUDA GPU (the H200's choices,
except where another GPU measured better: decode attention's tile and MBGMV's expand at under
16 rows, timed on an H100), and `interpreter` for CPU tensors under TRITON_INTERPRET (small
tiles: its cost grows with a tile's elements and a loop's trips). A device's kind is resolved
once, from its name (`torch.cuda.get_device_name`: "NVIDIA H200" -> h200).
"""

from __future__ import annotations

import functools
import importlib.resources
import json

import torch

# (substring of the device name, table): the first match names a CUDA device's table
GPU_TABLES = (("H200", "h200"),)
GENERIC = "generic"
INTERPRETER = "interpreter"


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def kind(device: torch.device) -> str:
    """The table that holds `device`'s choices: `interpreter` off CUDA, else by name."""
    if device.type != "cuda":
        return INTERPRETER
    return _gpu_kind(_index(device))


@functools.lru_cache(maxsize=None)
def _gpu_kind(index: int) -> str:
    name = torch.cuda.get_device_name(index)
    return next((table for part, table in GPU_TABLES if part in name), GENERIC)


def sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 off CUDA: the interpreter runs one program at
    a time)."""
    if device.type != "cuda":
        return 1
    return _sms(_index(device))


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def table(name: str) -> dict:
    """configs/<name>.json, read once."""
    path = importlib.resources.files("slora.kernels") / "configs" / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8"))


def _holds(value, bounds) -> bool:
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value < hi)


def choose(table_name: str, kernel: str, fit=None, **quantities) -> dict:
    """The cfg of the first rule of `kernel` in table `table_name` whose conditions hold, as a
    new dict passed through `fit` (the config function's rule fitting a tile to the data)
    before any condition is tested. A quantity is a number or a function of the fitted cfg."""
    for rule in table(table_name)[kernel]:
        cfg = dict(rule["cfg"])
        if fit is not None:
            cfg = fit(cfg)
        when = rule.get("when", {})
        unknown = set(when) - set(quantities)
        if unknown:
            raise KeyError(f"configs/{table_name}.json: {kernel} tests {sorted(unknown)}, which "
                           f"its config function does not give (it gives {sorted(quantities)})")
        if all(_holds(q(cfg) if callable(q) else q, when[name])
               for name, q in quantities.items() if name in when):
            return cfg
    raise LookupError(f"configs/{table_name}.json: no rule of {kernel} holds for {quantities}")
