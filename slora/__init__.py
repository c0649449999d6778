"""slora: serve thousands of LoRA adapters of one base LLM from one GPU.

One paged pool holds KV-cache pages and rank-granular adapter pages; MBGMV/MBGMM kernels
compute LoRA from those pages; the scheduler coordinates admission, adapter loading,
eviction and preemption.
"""

from slora.config import EngineConfig
from slora.request import RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "MergeSpec"]
__version__ = "0.1.0"


def __getattr__(name):
    # Engine pulls in torch; import it lazily so `import slora` (and the CLI's --help) stay fast.
    if name == "Engine":
        from slora.engine import Engine

        return Engine
    if name == "MergeSpec":
        from slora.model.merge import MergeSpec

        return MergeSpec
    raise AttributeError(f"module 'slora' has no attribute {name!r}")
