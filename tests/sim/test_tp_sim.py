"""A profile per tensor-parallel degree: the profile records the degree its engine ran with,
and the simulator takes one rank's shapes from it (half the page, about half the weights and
a rank's adapter pages on two devices), so `slora simulate` can weigh one model on two GPUs
against two replicas."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slora.config import ModelConfig
from slora.sim import CostModel, Profile
from slora.sim.simulator import adapter_pages, engine_config, pages_for_memory, rank_shapes

LLAMA_7B = Path(__file__).resolve().parents[2] / "experiments" / "models" / "llama-2-7b"


def profile_7b(tp: int = 1) -> Profile:
    """A hand-made profile of the Llama-2-7B shape on 141 GiB GPUs, `tp` of them."""
    coeffs = dict(const=8e-3, prefill_tokens=2.2e-5, decode_seqs=2e-5, decode_ctx=1.3e-7)
    return Profile(model="llama-2-7b", gpu="hand-made", tensor_parallel_size=tp,
                   model_config=json.loads((LLAMA_7B / "config.json").read_text()),
                   cost=CostModel(coeffs=coeffs, h2d_gbps=25), gpu_memory_gb=141)


def test_a_rank_holds_half_of_the_model_on_two_devices():
    model = ModelConfig.from_dir(LLAMA_7B)
    half = rank_shapes(model, 2)
    assert half.page_size(16) * 2 == model.page_size(16)
    # the embedding, lm_head and the linear layers split, the norms do not
    assert 0.5 < half.weight_bytes(2) / model.weight_bytes(2) < 0.501
    # A rank-16 q/k/v/o adapter: q/k/v's A whole on each rank, their B and o halved
    one, two = adapter_pages(model, 16, 16), adapter_pages(half, 16, 16)
    assert one == 4 and 4 <= two <= 6
    # the per-rank pool on the same GPU: more than twice the pages (half the page, more room)
    assert pages_for_memory(half, 16, "bfloat16", 141) > 2 * pages_for_memory(model, 16,
                                                                               "bfloat16", 141)


def test_the_simulator_follows_the_profiles_degree():
    profile = profile_7b(2)
    back = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert back.tensor_parallel_size == 2 and Profile.from_dict(
        {k: v for k, v in profile.to_dict().items() if k != "tensor_parallel_size"}
    ).tensor_parallel_size == 1  # a profile from before the field: one device
    config, model = engine_config(profile, gpu_memory_gb=141)
    assert config.tensor_parallel_size == 2 and model.num_heads == 16
    one, _ = engine_config(profile_7b(), gpu_memory_gb=141)
    assert config.num_pages > 2 * one.num_pages
    with pytest.raises(ValueError, match="profile of that degree"):
        engine_config(dataclasses.replace(profile, tensor_parallel_size=1),
                      {"tensor_parallel_size": 2}, gpu_memory_gb=141)
