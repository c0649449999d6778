"""The simulator on its own: it imports no torch, its adapter pages are the engine's, every
request finishes or fails with a reason and pages balance after every step, sweeps rescale the
rate and find the capacity, `slora simulate` and `slora plot` end to end, a warning when the
simulation's order of events is not its profile's, and the speed of 10,000 requests over 2,000
adapters."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slora.sim.profile
from slora import Engine, EngineConfig
from slora.cli import main
from slora.config import ConfigError, ModelConfig
from slora.sim import CostModel, Profile, simulate
from slora.sim.simulator import (ProfileOrderWarning, adapter_pages, best_point,
                                 pages_for_memory, parse_sweep, rescale_rate, simulate_point)
from slora.workload import Trace, TraceRequest, synthesize, write_trace

LLAMA_7B = Path(__file__).resolve().parents[2] / "experiments" / "models" / "llama-2-7b"


def test_sim_imports_no_torch():
    code = ("import sys\nimport slora.sim, slora.sim.simulator, slora.sim.cost\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adapter_pages_match_what_the_engine_registers(tiny_model_dir):
    """The simulator and the engine share AdapterLayout; check the page counts end to end."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=64))
    for rank in (1, 3, 8, 64):
        for targets in (("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj", "o_proj")):
            name = f"r{rank}-{len(targets)}"
            engine.add_synthetic_adapter(name, rank, targets)
            want = engine.adapters.get(name).num_pages
            assert adapter_pages(cfg, rank, engine.config.block_size, targets) == want


def _profile_7b(**cost) -> Profile:
    """A hand-made profile of the Llama-2-7B shape on an H200-class GPU (round numbers of the
    right magnitude; the shipped, measured one is experiments/profiles/h200-llama2-7b.json)."""
    coeffs = dict(const=8e-3, prefill_tokens=2.2e-5, prefill_attn=1e-9, decode_seqs=2e-5,
                  decode_ctx=1.3e-7, adapters=1e-4, lora_prefill=3e-8, lora_decode=2e-6)
    model_config = json.loads((LLAMA_7B / "config.json").read_text())
    return Profile(model="llama-2-7b", gpu="hand-made H200-class", model_config=model_config,
                   cost=CostModel(coeffs=coeffs, h2d_gbps=25, disk_gbps=10, prefetch_overlap=0.5,
                                  **cost),
                   gpu_memory_gb=141, num_pages=13000)


def _check_conservation(trace, run):
    recs = run.records
    assert len(recs) == len(trace)
    for r in recs:
        if r.failed:
            assert r.error, "a failed request carries its reason"
        else:
            assert r.first_token_time is not None and r.finish_time >= r.first_token_time
    done = sorted((r.arrival_time, r.output_tokens) for r in recs if not r.failed)
    want = sorted((q.arrival_time, q.output_len) for q in trace.requests)
    assert set(done) <= set(want)
    sched = run.engine.scheduler
    assert not sched.has_unfinished() and sched.allocator.used["kv"] == 0
    assert not any(a.refcount for a in run.engine.adapters.adapters.values())
    sched.allocator.check()


@pytest.mark.parametrize("policy,num_pages", [("fcfs", 400), ("cluster", 300), ("fair", 400),
                                              ("abort", 300)])
def test_every_request_finishes_or_fails_with_a_reason(policy, num_pages):
    # 7B: a rank-64 adapter takes 16 pages, a 1,000-token request 63; a pool of a few hundred
    # pages forces evictions and preemptions, and a 5,000-token prompt can never fit
    trace = synthesize(num_adapters=50, rate=20, cv=3, alpha=0.5, duration=20,
                       input_len=(8, 1000), output_len=(8, 500), ranks=(8, 16, 32, 64), seed=1)
    big = TraceRequest(1.0, "lora-0", 10, prompt_len=5000)
    too_long = TraceRequest(2.0, None, 10, prompt_len=4096)  # the model's limit
    trace = Trace(trace.requests + [big, too_long], trace.adapters, trace.params)
    run = simulate(trace, _profile_7b(), engine_options=dict(policy=policy, slo_ttft_s=2.0),
                   num_pages=num_pages, check=True)
    _check_conservation(trace, run)
    stats = run.result["stats"]
    assert stats["adapter_evictions"] > 0
    errors = [r.error for r in run.records if r.failed]
    assert any("whole pool" in e or "does not fit" in e for e in errors)
    assert run.result["num_failed"] == len(errors) >= 2
    if policy == "abort":
        assert stats["slo_aborted"] > 0


def test_max_model_len_is_bounded_as_the_engine_bounds_it():
    trace = Trace([TraceRequest(0.0, None, 4, prompt_len=100)], {}, {})
    # 7B: a window of 4,096 positions; 300 pages of 16 tokens hold 4,800
    assert simulate(trace, _profile_7b(), num_pages=300).engine.max_model_len == 4096
    assert simulate(trace, _profile_7b(), num_pages=200).engine.max_model_len == 3200
    with pytest.raises(ConfigError, match=r"max_model_len=5000: past the model's context window"):
        simulate(trace, _profile_7b(), engine_options=dict(max_model_len=5000), num_pages=400)
    with pytest.raises(ConfigError, match=r"max_model_len=4000: the pool holds 3200 tokens"):
        simulate(trace, _profile_7b(), engine_options=dict(max_model_len=4000), num_pages=200)
    # a linear rope_scaling widens the window by its factor, and the default with it
    model = simulate(trace, _profile_7b(), num_pages=300).engine.model
    linear = dataclasses.replace(model, rope_scaling={"rope_type": "linear", "factor": 2.0})
    run = simulate(trace, _profile_7b(), engine_options=dict(max_model_len=8000),
                   num_pages=600, model=linear)
    assert run.engine.max_model_len == 8000
    assert simulate(trace, _profile_7b(), num_pages=600, model=linear).engine.max_model_len == 8192
    with pytest.raises(ConfigError, match=r"\(8192: max_position_embeddings 4096 x the linear"):
        simulate(trace, _profile_7b(), engine_options=dict(max_model_len=8193), num_pages=600,
                 model=linear)


def test_sweep_rescales_rate_and_finds_capacity(tmp_path):
    trace = synthesize(num_adapters=20, rate=2, cv=1, alpha=1, duration=100, ranks=(8, 64), seed=0)
    fast = rescale_rate(trace, 8)
    assert fast.duration == pytest.approx(trace.duration / 4)
    assert fast.params["rate"] == 8 and [r.output_len for r in fast.requests] == \
        [r.output_len for r in trace.requests]
    points = parse_sweep(["rate=2,64", "policy=fcfs,cluster"])
    assert points == [{"rate": 2.0, "policy": "fcfs"}, {"rate": 2.0, "policy": "cluster"},
                      {"rate": 64.0, "policy": "fcfs"}, {"rate": 64.0, "policy": "cluster"}]
    with pytest.raises(ValueError, match="KEY=V1"):
        parse_sweep(["speed=1"])
    profile = _profile_7b()
    results = [(p, simulate_point(trace, profile, p, num_pages=3000).result) for p in points[::2]]
    low, high = (r for _, r in results)
    assert low["config"]["workload"]["rate"] == 2 and high["config"]["workload"]["rate"] == 64
    assert high["throughput_req_s"] > low["throughput_req_s"]
    assert high["ttft_p90_s"] > low["ttft_p90_s"]
    best = best_point(results, slo_target=0.99)
    assert best is not None and best[0]["rate"] == 2.0
    # the cost model's what-if prompt_overlap, swept: recorded in the result, never slower
    points = parse_sweep(["rate=64", "prompt_overlap=0,1"])
    assert points == [{"rate": 64.0, "prompt_overlap": 0.0}, {"rate": 64.0, "prompt_overlap": 1.0}]
    plain, hidden = (simulate_point(trace, profile, p, num_pages=3000).result for p in points)
    assert [r["config"]["profile"]["cost"]["prompt_overlap"] for r in (plain, hidden)] == [0, 1]
    assert plain["throughput_tok_s"] == high["throughput_tok_s"]
    assert hidden["throughput_tok_s"] > plain["throughput_tok_s"]
    assert profile.cost.prompt_overlap == 0.0  # (the point's cost model is a copy)
    assert pages_for_memory(ModelConfig.from_dir(LLAMA_7B), 16, "bfloat16", 80) < \
        pages_for_memory(ModelConfig.from_dir(LLAMA_7B), 16, "bfloat16", 141)


def test_cli_simulate_and_plot(tmp_path, cpu_profile, capsys):
    trace_path = tmp_path / "t.jsonl"
    write_trace(synthesize(num_adapters=8, rate=50, cv=1, alpha=1, duration=1, input_len=(4, 30),
                           output_len=(2, 20), ranks=(4, 8), seed=0), trace_path)
    prof = cpu_profile.save(tmp_path / "cpu.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", str(trace_path), "--profile", str(prof), "--num-pages", "64",
                 "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("throughput_req_s", "throughput_tok_s", "avg_latency_s", "ttft_p50_s", "ttft_p90_s",
                "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "slo_attainment",
                "num_requests", "num_completed"):
        assert key in result
    assert 0 < result["itl_p50_s"] <= result["itl_p99_s"] <= result["itl_max_s"]
    assert result["source"] == "simulate" and result["num_completed"] == 50
    assert result["config"]["profile"]["cost"]["prompt_overlap"] == 0
    # the what-if --prompt-overlap: recorded in the result; a share past 1 is refused by name
    assert main(["simulate", str(trace_path), "--profile", str(prof), "--num-pages", "64",
                 "--prompt-overlap", "0.5", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["profile"]["cost"]["prompt_overlap"] == 0.5
    capsys.readouterr()
    assert main(["simulate", str(trace_path), "--profile", str(prof), "--prompt-overlap", "2",
                 "-o", str(out)]) == 1
    assert "prompt_overlap=2.0 must be in [0, 1]" in capsys.readouterr().err
    # mixed-step graphs: with an eager step far dearer than a graph's, first tokens come sooner
    dear = Profile.from_dict({**cpu_profile.to_dict(),
                              "coeffs": {**cpu_profile.cost.coeffs, "eager": 0.05}})
    assert result["config"]["engine"]["mixed_graph_tokens"] == 0  # the profile's setting
    ttft = {}
    for tokens in ("0", "4096"):
        assert main(["simulate", str(trace_path), "--profile", str(dear.save(tmp_path / "d.json")),
                     "--num-pages", "64", "--mixed-graph-tokens", tokens, "-o", str(out)]) == 0
        ttft[tokens] = json.loads(out.read_text())["ttft_p50_s"]
    assert ttft["4096"] < ttft["0"]
    # a profile made with mixed graphs on simulates with them by default
    graphed = Profile.from_dict({**dear.to_dict(), "mixed_graph_tokens": 4096})
    assert main(["simulate", str(trace_path), "--profile", str(graphed.save(tmp_path / "g.json")),
                 "--num-pages", "64", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["ttft_p50_s"] == ttft["4096"]
    sweep_dir = tmp_path / "sweep"
    assert main(["simulate", str(trace_path), "--profile", str(prof), "--num-pages", "64",
                 "--sweep", "rate=25,100,400", "--slo-target", "0.9", "-o", str(sweep_dir)]) == 0
    files = sorted(sweep_dir.glob("*.json"))
    assert len(files) == 3
    # the sweep's points side by side, one row each after the header, in the sweep's order
    table = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("point "))
    assert "ITL p99" in table[start]
    rows = table[start + 1:start + 4]
    assert [row.split()[0] for row in rows] == ["rate=25", "rate=100", "rate=400"]
    for row, f in zip(rows, sorted(files, key=lambda f: float(f.stem.split("=")[1]))):
        assert f"{json.loads(f.read_text())['throughput_tok_s']:.1f}" in row.split()
    assert main(["plot", *map(str, files), "-o", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_the_progress_bar_says_simulate(cpu_profile, capsys):
    trace = synthesize(num_adapters=2, rate=50, cv=1, alpha=1, duration=0.2, input_len=(4, 8),
                       output_len=(2, 4), ranks=(4,), seed=0)
    simulate(trace, cpu_profile, num_pages=64, progress=True)
    err = capsys.readouterr().err
    assert "simulate: 100%" in err and "replay" not in err


def test_simulating_in_another_order_than_the_profile_warns(tmp_path, cpu_profile, capsys,
                                                            monkeypatch):
    """A sync profile simulated with async scheduling (or the reverse) draws one warning line
    that says to re-profile; the simulation still runs. Without the flag a simulation takes
    the profile's order. `slora profile --async-scheduling` profiles an engine with it."""
    got = {}
    monkeypatch.setattr(slora.sim.profile, "run_profile",
                        lambda model, output, engine_options, **kw: got.update(engine_options))
    assert main(["profile", "--model", "m", "--async-scheduling", "-o", "p.json"]) == 0
    assert got == {"async_scheduling": True}

    trace = synthesize(num_adapters=2, rate=50, cv=1, alpha=1, duration=0.2, input_len=(4, 8),
                       output_len=(2, 4), ranks=(4,), seed=0)
    with pytest.warns(ProfileOrderWarning, match="--async-scheduling"):
        simulate(trace, cpu_profile, engine_options=dict(async_scheduling=True), num_pages=64)
    trace_path, out = tmp_path / "t.jsonl", tmp_path / "sim.json"
    write_trace(trace, trace_path)
    prof = cpu_profile.save(tmp_path / "cpu.json")
    args = ["simulate", str(trace_path), "--profile", str(prof), "--num-pages", "64", "-o", str(out)]
    sweep = args[:-1] + [str(tmp_path / "sweep"), "--async-scheduling", "--sweep", "rate=25,50"]
    assert main(sweep) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "re-profile with `slora profile --async-scheduling`" in err
    assert main(args) == 0 and "warning" not in capsys.readouterr().err
    async_prof = dataclasses.replace(cpu_profile, async_scheduling=True).save(tmp_path / "a.json")
    args[3] = str(async_prof)
    # without the flag the simulation runs in the profile's order; asking for the other warns
    assert main(args) == 0 and "warning" not in capsys.readouterr().err
    assert json.loads(out.read_text())["config"]["engine"]["async_scheduling"] is True
    assert main(args + ["--no-async-scheduling"]) == 0
    assert "re-profile without --async-scheduling" in capsys.readouterr().err
    assert main(args + ["--async-scheduling"]) == 0 and "warning" not in capsys.readouterr().err


def test_10000_requests_over_2000_adapters_is_fast():
    # S-LoRA's S2 shape (ranks 64/32/16/8, lengths [8, 511]) at 8 req/s on a 141 GB device
    trace = synthesize(num_adapters=2000, rate=8, cv=1, alpha=1, duration=1250,
                       ranks=(64, 32, 16, 8), seed=42)
    assert len(trace) == 10_000
    t = time.perf_counter()
    run = simulate(trace, _profile_7b(), gpu_memory_gb=141)
    wall = time.perf_counter() - t
    s = run.result["stats"]
    print(f"\n10,000 requests over 2,000 adapters: {wall:.1f} s wall for {s['sim_steps']} steps "
          f"({1e3 * wall / s['sim_steps']:.3f} ms/step) simulating {run.result['duration_s']:.0f} s; "
          f"{run.result['throughput_req_s']:.2f} req/s, {s['adapter_loads']} adapter loads")
    assert run.result["num_completed"] == 10_000
    assert len(trace.adapter_names()) > 1900
    assert wall < 60, "the simulator should take well under 30 s here on an idle 2-core CPU"


def test_the_simulator_runs_prompts_in_chunks():
    """The simulator drives the same scheduler, so it sees chunks: with max_prefill_chunk
    each step computes at most that many prompt tokens (every prompt token once, none lost),
    a prompt longer than max_batch_tokens completes, the longest step is shorter, and the
    decode rows' worst wait with it (inter-token latency) falls."""
    trace = synthesize(num_adapters=8, rate=20, cv=1, alpha=1, duration=2,
                       input_len=(200, 3000), output_len=(8, 64), ranks=(8, 16), seed=2)
    runs = {}
    for chunk in (0, 256):
        steps = []
        run = simulate(trace, _profile_7b(), num_pages=3000, check=True,
                       engine_options=dict(max_batch_tokens=2048, max_prefill_chunk=chunk),
                       on_step=lambda plan, start, dt: steps.append(
                           (sum(plan.chunks.values()), len(plan.decode), len(plan.partial), dt)))
        _check_conservation(trace, run)
        assert run.result["num_failed"] == 0
        runs[chunk] = steps
    whole, chunked = runs[0], runs[256]
    total = sum(r.prompt_len for r in trace.requests)
    assert sum(s[0] for s in whole) == sum(s[0] for s in chunked) == total
    assert max(r.prompt_len for r in trace.requests) > 2048  # longer than a step's budget
    assert all(s[0] <= 256 for s in chunked) and sum(s[2] for s in chunked) > 0
    assert not any(s[2] for s in whole)
    worst = lambda steps: max(dt for p, d, _, dt in steps if p and d)  # noqa: E731
    assert worst(chunked) < worst(whole) / 2
