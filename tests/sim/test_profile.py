"""Calibration on CPU: `slora.sim.profile` measures the tiny model's engine and fits a profile
that round-trips through its file; with async scheduling it times the same cases; `slora
profile --refit` refits a stored profile's steps, with a replay's step log or without."""

from __future__ import annotations

import json

from slora import Engine, EngineConfig
from slora.cli import main
from slora.sim import Profile
from slora.sim.cost import FEATURES
from slora.sim.profile import Grid, profile_engine


def test_profile_round_trips_and_fits_the_cpu(cpu_profile, tmp_path):
    p = cpu_profile
    assert p.gpu.startswith("cpu") and p.num_pages and p.dtype == "float32"
    assert all(v >= 0 for v in p.cost.coeffs.values())
    # every profiled step takes time in the fit (on a busy machine the fit may give the time to
    # other features than the constant, even leave the constant 0)
    assert all(p.cost.forward_time(tuple(s["features"][k] for k in FEATURES)) > 0
               for s in p.samples)
    assert {s["case"]["step"] for s in p.samples} == {"prefill", "mixed", "decode", "long",
                                                      "cached", "serve"}
    # a cached prefix's batch computes its new tokens alone, over the prefix's context too
    cached = [s for s in p.samples if s["case"]["step"] == "cached"]
    assert {(s["case"]["batch"], s["case"]["mix"]) for s in cached} == {
        (n, mix) for n in (1, 4) for mix in ("base", "one")}
    for s in cached:
        f, n = s["features"], s["case"]["batch"]
        if f["prefill_tokens"]:
            assert f["prefill_tokens"] == 8 * n and f["prefill_attn"] == n * 8 * (32 + 8)
    assert any(s["features"]["prefill_tokens"] == 96 for s in p.samples
               if s["case"]["step"] == "long")
    serve = [s for s in p.samples if s["case"]["step"] == "serve"]
    # a served trace's steps: every one with prompts, the decode ones capped (CPU_GRID's 200)
    decode = [s for s in serve if not s["features"]["prefill_tokens"]]
    assert 0 < len(decode) <= 200 and len(serve) > len(decode)
    assert any(s["features"]["decode_seqs"] and s["features"]["prefill_tokens"] for s in serve)
    again = Profile.load(p.save(tmp_path / "p.json"))
    assert again.to_dict() == p.to_dict()
    keys = json.loads((tmp_path / "p.json").read_text())
    assert {"model", "gpu", "coeffs", "h2d_gbps", "disk_gbps", "samples"} <= set(keys)


# A grid of few cases (both mixes with adapters, both late-arrival shapes), no long-context cases
# and no serving steps:
# the async-order tests profile an engine in a second or two.
SMALL_GRID = dict(batches=(1, 4), prompt_lens=(4, 16), mixes=("base", "distinct"), ranks=(4, 8),
                  decode_steps=3, max_case_tokens=2048, max_adapters=4, transfer_repeats=1,
                  overlap_repeats=1, serve_s=0.0, long_prompts=(), cached_prefixes=())


def _cases(samples):
    """The grid's samples by case: {(batch, prompt_len, mix): [(step kind, features), ...]}."""
    out = {}
    for s in samples:
        c = s["case"]
        out.setdefault((c["batch"], c["prompt_len"], c["mix"]), []).append((c["step"], s["features"]))
    return out


def test_async_profile_times_the_same_cases_in_collect_order(tiny_model_dir, tmp_path):
    """With async scheduling the profiler times steps between collections, yet its grid holds
    the sync profile's samples: the same cases, kinds and features, in launch order."""
    profiles = {}
    for on in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                     num_pages=256, async_scheduling=on))
        profiles[on] = profile_engine(engine, Grid(**SMALL_GRID), "tiny", log=lambda _: None)
    sync, async_ = (_cases(profiles[on].samples) for on in (False, True))
    assert sync == async_ and len(sync) == 8
    assert {k for steps in sync.values() for k, _ in steps} == {"prefill", "mixed", "decode"}
    assert all(s["seconds"] > 0 for s in profiles[True].samples)
    p = profiles[True]
    assert p.async_scheduling and not profiles[False].async_scheduling
    again = Profile.load(p.save(tmp_path / "async.json"))
    assert again.async_scheduling and again.to_dict() == p.to_dict()
    old = {k: v for k, v in p.to_dict().items() if k != "async_scheduling"}  # none recorded
    assert Profile.from_dict(old).async_scheduling is False


def test_profiling_shows_a_labelled_bar_for_each_measurement(tiny_model_dir, capsys):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=256))
    grid = Grid(**{**SMALL_GRID, "serve_s": 0.2, "serve_rate": 20.0, "serve_adapters": 2,
                   "serve_lengths": (4, 8), "long_prompts": (24,)})
    lines = []
    profile_engine(engine, grid, "tiny", log=lines.append, progress=True)
    err = capsys.readouterr().err
    for label in ("warm-up", "profile: batch shapes", "profile: long context",
                  "profile: serving trace",
                  "profile: adapter copies", "profile: prefetch overlap"):
        assert f"{label}: 100%" in err, label
    # the bars stand for the per-case lines; the results are still logged
    assert not any("case " in line for line in lines)
    assert any(line.startswith("  rank ") for line in lines) and lines[-1].startswith("fit over")


def test_cli_profile_refit(tmp_path, cpu_profile, capsys):
    """`slora profile --refit` refits a stored profile's steps without a device or a model."""
    old = cpu_profile.to_dict()
    for s in old["samples"]:  # as a profile whose samples lack these features
        for k in ("lora", "eager_adapters"):
            s["features"].pop(k, None)
    old["coeffs"] = {k: v for k, v in old["coeffs"].items() if k not in ("lora", "eager_adapters")}
    src, dst = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps(old))
    assert main(["profile", "--refit", str(src), "-o", str(dst)]) == 0
    new = json.loads(dst.read_text())
    assert set(new["coeffs"]) == set(FEATURES) and new["fit"]["refit"] is True
    assert len(new["samples"]) == len(old["samples"])
    assert "mean relative error" in capsys.readouterr().out
    assert main(["profile", "-o", str(dst)]) == 1  # neither --model nor --refit: a clear error
    assert "--model DIR is required" in capsys.readouterr().err
    # a replay's step log joins the fit; steps that copied adapters stay out
    log = tmp_path / "steps.jsonl"
    steps = [{**s, "copies": i % 2 == 1} for i, s in enumerate(old["samples"][:10])]
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert main(["profile", "--refit", str(src), "--add-steps", str(log), "-o", str(dst)]) == 0
    assert len(json.loads(dst.read_text())["samples"]) == len(old["samples"]) + 5
    log.write_text('{"seconds": 1}\n')
    assert main(["profile", "--refit", str(src), "--add-steps", str(log), "-o", str(dst)]) == 1
    assert "line 1: not a step" in capsys.readouterr().err
