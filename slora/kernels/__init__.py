"""The kernels and the backends that run them.

`backend.py` dispatches a model's operations to a backend ("torch": the twins in
`reference.py`; "triton": the Triton kernels; "cuda": the csrc MBGMV, `cuda.py`). The Triton
kernels: `mbgmv.py` (decode LoRA), `mbgmm.py` (prefill LoRA), `vocab.py` (the embedding LoRA's
gather; its expand and lm_head's LoRA are MBGMV/MBGMM), `adapter_pages.py` (how both read an
adapter's rows from the pool pages), `dora.py` (DoRA's per-row rescale), `attention.py`,
`gemm.py` (a decode step's few-rows base GEMMs), `fused.py` (elementwise chains), `pdl.py`
(programmatic dependent launch), `tiles.py` (the prefill kernels' work lists), `segments.py`
(the decode rows grouped by adapter, and the per-step choice between that path and MBGMV),
and `tuning.py` with `configs/<gpu>.json` (tile choices per GPU as data).
"""

from slora.kernels.backend import (DecodeSegments, GroupMeta, LoraMeta, TorchBackend,
                                   TritonBackend, make_backend)

__all__ = ["DecodeSegments", "GroupMeta", "LoraMeta", "TorchBackend", "TritonBackend",
           "make_backend"]
