"""FP8 base weights in calibration, replay and simulation (`--quantization fp8`): a profile records
the format its engine's weights had; a replay runs an FP8 engine; the simulator sizes its pool for
FP8 weight bytes (one byte a linear weight plus its scales, so more pages fit), follows the
profile's format by default and warns when told to simulate another."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from slora import Engine, EngineConfig
from slora.cli import main
from slora.config import ModelConfig
from slora.sim import CostModel, Profile
from slora.sim.profile import Grid, profile_engine
from slora.sim.simulator import (ProfileWeightsWarning, engine_config, page_bytes,
                                 pages_for_memory)
from slora.workload import synthesize, write_trace

LLAMA_7B = Path(__file__).resolve().parents[2] / "experiments" / "models" / "llama-2-7b"
SMALL_GRID = dict(batches=(1, 4), prompt_lens=(4, 16), mixes=("base", "distinct"), ranks=(4, 8),
                  decode_steps=2, max_case_tokens=2048, max_adapters=4, transfer_repeats=1,
                  overlap_repeats=1, serve_s=0.0)


def profile_7b(quantization=None) -> Profile:
    """A hand-made bf16 (or FP8) profile of the Llama-2-7B shape on a 141 GiB GPU."""
    coeffs = dict(const=8e-3, prefill_tokens=2.2e-5, decode_seqs=2e-5, decode_ctx=1.3e-7,
                  adapters=1e-4, lora_decode=2e-6)
    return Profile(model="llama-2-7b", gpu="hand-made", quantization=quantization,
                   model_config=json.loads((LLAMA_7B / "config.json").read_text()),
                   cost=CostModel(coeffs=coeffs, h2d_gbps=25), gpu_memory_gb=141, num_pages=13000)


def test_fp8_weights_leave_more_pool_pages():
    """pages_for_memory and the profiled pool: FP8's weight bytes (about half of bf16's for a
    7B) leave the runner's share (0.85) of the difference to the pool."""
    model = ModelConfig.from_dir(LLAMA_7B)
    bf16, fp8 = model.weight_bytes(2), model.weight_bytes(2, "fp8")
    assert 0.5 < fp8 / bf16 < 0.55  # the embeddings and lm_head stay bf16
    page = page_bytes(model, 16, "bfloat16")
    more = pages_for_memory(model, 16, "bfloat16", 80, quantization="fp8") - \
        pages_for_memory(model, 16, "bfloat16", 80)
    assert abs(more - 0.85 * (bf16 - fp8) / page) <= 1
    with pytest.warns(ProfileWeightsWarning, match="slora profile --quantization fp8"):
        config, _ = engine_config(profile_7b(), {"quantization": "fp8"})
    assert config.quantization == "fp8"
    assert abs(config.num_pages - 13000 - 0.85 * (bf16 - fp8) / page) <= 1
    # an FP8 profile: its format and its pool by default, no warning; the bf16 pool from it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileWeightsWarning)
        config, _ = engine_config(profile_7b("fp8"))
    assert config.quantization == "fp8" and config.num_pages == 13000


def test_cli_simulate_follows_and_sizes_for_fp8(tmp_path, capsys):
    """`slora simulate --quantization fp8` over a bf16 profile: the result records FP8 weights
    and a pool larger by the saved weight bytes, with the warning that the step times are the
    bf16 profile's; over an FP8 profile the FP8 pool is the default."""
    trace = tmp_path / "t.jsonl"
    write_trace(synthesize(num_adapters=4, rate=2, cv=1, alpha=1, duration=2,
                           input_len=(8, 16), output_len=(4, 8), ranks=(8,), seed=0), trace)
    pages = {}
    for name, profile, flags in (("bf16", profile_7b(), []),
                                 ("fp8", profile_7b(), ["--quantization", "fp8"]),
                                 ("fp8-profile", profile_7b("fp8"), [])):
        path = profile.save(tmp_path / f"{name}.json")
        out = tmp_path / f"{name}-sim.json"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["simulate", str(trace), "--profile", str(path), "--no-progress",
                         "-o", str(out), *flags]) == 0
        warned = [w for w in caught if issubclass(w.category, ProfileWeightsWarning)]
        assert bool(warned) == (name == "fp8"), name
        result = json.loads(out.read_text())
        assert result["config"]["engine"]["quantization"] == (None if name == "bf16" else "fp8")
        assert result["num_completed"] == result["num_requests"]
        pages[name] = result["stats"]["pages_total"]
    assert pages["fp8"] > pages["bf16"] == pages["fp8-profile"] == 13000


def test_profile_records_fp8_weights(tiny_model_dir, tmp_path):
    """An FP8 engine's profile says so, through its file; CLI profile and replay pass the flag
    to the engine."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=256, quantization="fp8"))
    p = profile_engine(engine, Grid(**SMALL_GRID), "tiny", log=lambda _: None)
    assert p.quantization == "fp8"
    assert Profile.load(p.save(tmp_path / "p.json")).quantization == "fp8"
    old = {k: v for k, v in p.to_dict().items() if k != "quantization"}  # none recorded: bf16
    assert Profile.from_dict(old).quantization is None


def test_cli_profile_and_replay_take_quantization(tiny_model_dir, tmp_path, monkeypatch):
    import slora.sim.profile

    seen = {}
    monkeypatch.setattr(slora.sim.profile, "run_profile",
                        lambda model, output, engine_options, **kw: seen.update(engine_options))
    assert main(["profile", "--model", str(tiny_model_dir), "--quantization", "fp8",
                 "-o", str(tmp_path / "p.json")]) == 0
    assert seen["quantization"] == "fp8"
    trace = tmp_path / "t.jsonl"
    write_trace(synthesize(num_adapters=2, rate=20, cv=1, alpha=1, duration=0.3,
                           input_len=(4, 8), output_len=(2, 4), ranks=(4,), seed=0), trace)
    out = tmp_path / "replay.json"
    assert main(["replay", str(trace), "--model", str(tiny_model_dir), "--synthetic-adapters",
                 "--device", "cpu", "--num-pages", "128", "--quantization", "fp8", "--no-warmup",
                 "--no-progress", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["engine"]["quantization"] == "fp8"
    assert result["num_completed"] == result["num_requests"] > 0
