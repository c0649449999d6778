"""The csrc/ CUDA C++ MBGMV (decode LoRA), compiled at run time through cupy (NVRTC).

No build step: the first call compiles mbgmv.cu for the current GPU and caches the module.
The source ships inside the package (`slora._csrc`, which packaging maps csrc/ to) and is read
through importlib.resources; slora run from a checkout reads csrc/ beside it. `mbgmv_shrink` /
`mbgmv_expand` have the signatures and semantics of the Triton kernels and of their twins in
reference.py. `backend="cuda"` selects `slora.kernels.backend.CudaBackend`: decode rows through these kernels,
everything else as the Triton backend does it.

cupy is an optional dependency (`pip install slora[cuda]`); it is imported on first use.
Kernels launch on torch's current stream, so they are captured into CUDA graphs like the rest.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path

import numpy as np
import torch



def source_file():
    """mbgmv.cu (a Traversable): the installed package's copy in `slora._csrc`, or, where no
    `slora._csrc` is importable (slora imported from a checkout, or an editable install that
    maps only slora/), the checkout's csrc/mbgmv.cu."""
    try:
        return importlib.resources.files("slora._csrc") / "mbgmv.cu"
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "csrc" / "mbgmv.cu"


SOURCE = source_file()

_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_THREADS = 128  # 4 warps: shrink gives each warp one rank row; expand one 16-byte vector a thread


@functools.lru_cache(maxsize=None)
def _module():
    try:
        import cupy
    except ImportError as e:
        raise ImportError("backend='cuda' needs cupy (pip install cupy-cuda12x or cupy-cuda13x "
                          "to match your CUDA); or use backend='triton'") from e
    cuda_home = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    options = ("-std=c++17", f"-I{cuda_home}/include")
    return cupy, cupy.RawModule(code=SOURCE.read_text(encoding="utf-8"), options=options)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _launch(name: str, dtype: torch.dtype, grid, args, shared_mem: int = 0) -> None:
    cupy, module = _module()
    kernel = module.get_function(f"{name}_{_SUFFIX[dtype]}")
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        kernel(grid, (_THREADS,), args, shared_mem=shared_mem)


def _vec(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def mbgmv_shrink(x, pool_l, pages, offsets_a, ranks, token_slot, stride: int,
                 max_rank: int) -> torch.Tensor:
    """xa [T, G, max_rank] fp32 (twin: reference.lora_shrink)."""
    T, d_in = x.shape
    G = offsets_a.shape[1]
    xa = torch.empty(T, G, max_rank, dtype=torch.float32, device=x.device)
    if T == 0 or max_rank == 0:
        return xa.zero_()
    assert x.stride(1) == 1 and x.stride(0) % _vec(x.dtype) == 0 and x.data_ptr() % 16 == 0
    assert pool_l.is_contiguous() and pages.stride(1) == 1
    offsets_a, ranks = offsets_a.contiguous(), ranks.contiguous()  # no-ops in the engine
    warps = _THREADS // 32
    grid = (T, G, -(-max_rank // warps))
    _launch("mbgmv_shrink", x.dtype, grid, (
        _ptr(x), _ptr(pool_l), _ptr(pages), _ptr(offsets_a), _ptr(ranks), _ptr(token_slot),
        _ptr(xa), np.int32(G), np.int32(max_rank), np.int32(d_in), np.int64(stride),
        np.int64(pool_l.shape[1]), np.int32(pages.stride(0)), np.int32(x.stride(0))))
    return xa


@functools.lru_cache(maxsize=64)
def _expand_meta(out_dims: tuple[int, ...], strides: tuple[int, ...], device: torch.device):
    cols = [0]
    for d in out_dims[:-1]:
        cols.append(cols[-1] + d)
    return (torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(out_dims, dtype=torch.int32, device=device),
            torch.tensor(strides, dtype=torch.int64, device=device))


def mbgmv_expand(xa, out, pool_l, pages, offsets_b, ranks, token_slot, out_dims, strides) -> None:
    """out[t, cols_g] += xa[t, g] @ B_g^T in place (twin: reference.lora_expand)."""
    T, G, max_rank = xa.shape
    if T == 0 or max_rank == 0:
        return
    assert out.stride(1) == 1 and pool_l.is_contiguous() and pages.stride(1) == 1
    offsets_b, ranks = offsets_b.contiguous(), ranks.contiguous()  # no-ops in the engine
    col_start, dims, strides_t = _expand_meta(tuple(out_dims), tuple(strides), out.device)
    per_block = _THREADS * _vec(out.dtype)
    grid = (T, G, -(-max(out_dims) // per_block))
    _launch("mbgmv_expand", out.dtype, grid, (
        _ptr(xa), _ptr(out), _ptr(pool_l), _ptr(pages), _ptr(offsets_b), _ptr(ranks),
        _ptr(token_slot), _ptr(col_start), _ptr(dims), _ptr(strides_t), np.int32(G),
        np.int32(max_rank), np.int64(pool_l.shape[1]), np.int32(pages.stride(0)),
        np.int32(out.stride(0))), shared_mem=4 * max_rank)
