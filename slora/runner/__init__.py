"""The model runner and its parts, one module per responsibility:

    model_runner.py   ModelRunner: owns the pool and the weights; launches and collects steps
    batch.py          BatchBuilder: a step's flat batch and LoRA metadata, built on the host
    host_tier.py      HostAdapterTier: the host copies of adapters and their copies into the pool
    sampling.py       Sampler: tokens and logprobs from a step's logits
    device.py         the device and dtype a config names
"""

from slora.runner.device import resolve_device
from slora.runner.model_runner import ModelRunner

__all__ = ["ModelRunner", "resolve_device"]
