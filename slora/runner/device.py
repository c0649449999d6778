"""The device and dtype an `EngineConfig` names, with "auto" resolved; torch's intra-op
CPU threads for a block of host work."""

from __future__ import annotations

from contextlib import contextmanager

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """"auto": the GPU when there is one, else the CPU. A named CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device={name!r}: CUDA is not available on this machine; "
                         "use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on a GPU, float32 on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


_torch_threads: list[int] = []  # torch's intra-op threads before an engine first set them


def set_host_threads(n: int) -> int:
    """Set torch's intra-op threads to `n` (0: as they are) for a GPU engine's host work
    (`EngineConfig.host_threads`); returns the count torch had before any engine set them, for
    the host work that threads do speed up (adapter reads), the same for every engine of the
    process."""
    if not _torch_threads:
        _torch_threads.append(torch.get_num_threads())
    if n:
        torch.set_num_threads(n)
    return _torch_threads[0]


@contextmanager
def intra_op_threads(n: int):
    """torch's intra-op CPU threads set to `n` within the block, as they were after it (0, or
    the count already set: unchanged). Setting them costs well under a microsecond."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
