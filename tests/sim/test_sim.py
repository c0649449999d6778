"""The simulator drives the real scheduler on a virtual clock.

- Calibration on CPU: `slora.sim.profile` measures the tiny model's engine and fits a profile.
- Same decisions: the engine (the tiny model, really computing) and the simulator replay one
  trace with their step times taken from that profile; every step's admissions, adapter loads,
  prefetches, evictions and preemptions agree, and so do the metrics.
- Conservation: every request finishes or fails with a reason; pages balance after every step.
- Speed: 10,000 requests over 2,000 adapters, its duration printed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import slora.engine
from slora import Engine, EngineConfig
from slora.config import ModelConfig
from slora.metrics import summarize
from slora.replay import register_adapters, replay
from slora.sim import CostModel, Profile, SimRunner, VirtualClock, fit, simulate
from slora.sim.cost import FEATURES, fit_bandwidth, padding
from slora.sim.simulator import (adapter_pages, best_point, pages_for_memory, parse_sweep,
                                 rescale_rate, simulate_point)
from slora.workload import Trace, TraceRequest, synthesize, write_trace

LLAMA_7B = Path(__file__).resolve().parents[2] / "experiments" / "models" / "llama-2-7b"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engine's steps here are tiny: on a busy 2-core machine one intra-op thread is ~10x
    faster than two contending for the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cpu_profile(tiny_model_dir, tmp_path_factory):
    from slora.sim.profile import run_profile

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    t = time.perf_counter()
    run_profile(str(tiny_model_dir), path, engine_options=dict(device="cpu", dtype="float32"),
                log=lambda _: None)
    profile = Profile.load(path)
    print(f"\nCPU profile of the tiny model: {time.perf_counter() - t:.1f} s, "
          f"{profile.fit_stats['samples']} steps, mean relative error "
          f"{profile.fit_stats['mean_rel_err']:.0%}")
    return profile


def test_sim_imports_no_torch():
    code = ("import sys\nimport slora.sim, slora.sim.simulator, slora.sim.cost\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adapter_pages_match_what_the_engine_registers(tiny_model_dir):
    """The simulator and the engine share AdapterLayout; check the page counts end to end."""
    from slora import Engine, EngineConfig

    cfg = ModelConfig.from_dir(tiny_model_dir)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=64))
    for rank in (1, 3, 8, 64):
        for targets in (("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj", "o_proj")):
            name = f"r{rank}-{len(targets)}"
            engine.add_synthetic_adapter(name, rank, targets)
            want = engine.adapters.get(name).num_pages
            assert adapter_pages(cfg, rank, engine.config.block_size, targets) == want


def test_fit_recovers_coefficients_and_stays_non_negative():
    true = dict(zip(FEATURES, (2e-3, 1e-5, 1e-9, 3e-5, 2e-7, 1e-4, 5e-8, 1e-6, 4e-3, 9e-3, 1e-3,
                               3e-4, 2e-3, 1e-4, 2e-5)))
    rng = random.Random(0)
    samples = []
    for _ in range(200):  # prefill, decode and mixed shapes, with and without adapters
        n_pre, n_dec = rng.choice((0, 1, 4)), rng.choice((0, 8, 64))
        plen, ctx = rng.randint(8, 512), rng.randint(8, 1024)
        n_a, pages = rng.choice((0, 1, 5)), rng.choice((2, 16))
        lora = 1 if n_a else 0
        tokens = n_pre * plen + n_dec
        eager = 1.0 if n_pre and tokens > 512 else 0.0  # past the mixed graphs
        prompts = 1.0 if n_pre else 0.0
        f = (1.0, n_pre * plen, n_pre * plen * plen, n_dec, n_dec * ctx, n_a,
             lora * n_pre * plen * pages * rng.random(), lora * n_dec * pages * rng.random(),
             eager, eager * lora, lora, eager * n_a, prompts * (n_dec > 0), prompts * n_a,
             padding(tokens, 512) if prompts and not eager else 0.0)
        samples.append((f, sum(true[k] * v for k, v in zip(FEATURES, f))))
    coeffs, stats = fit(samples)
    for k in FEATURES:
        assert coeffs[k] == pytest.approx(true[k], rel=1e-6, abs=1e-15)
    assert stats["mean_rel_err"] < 1e-9
    # a feature that only adds noise with a negative slope is dropped, never negative
    noisy = [((1.0, x) + (0,) * (len(FEATURES) - 2), 1e-3 + 1e-6 * x - 1e-7 * (x % 3))
             for x in range(1, 50)]
    noisy += [((1.0, x) + (0,) * (len(FEATURES) - 2), 1e-3) for x in (1000, 2000)]
    coeffs, _ = fit(noisy)
    assert all(v >= 0 for v in coeffs.values())
    overhead, gbps = fit_bandwidth([(b, 1e-5 + b / 25e9) for b in (1e6, 4e6, 16e6)])
    assert overhead == pytest.approx(1e-5) and gbps == pytest.approx(25)


def test_fit_max_finds_the_host_bound_steps():
    """Steps bound by the host (an eager step whose kernels finish before Python launches the
    next) take max(device work, host work): fit_max recovers both pieces where a linear fit
    cannot, and falls back to the linear model (host None) where nothing is host-bound."""
    from slora.sim.cost import HOST_FEATURES, fit_max

    rng = random.Random(1)
    device = dict.fromkeys(FEATURES, 0.0) | {"const": 2e-3, "prefill_tokens": 2e-5,
                                             "decode_seqs": 1e-5, "decode_ctx": 1e-7, "eager": 1e-3}
    host = dict.fromkeys(HOST_FEATURES, 0.0) | {"const": 2e-3, "eager": 12e-3, "decode_seqs": 2e-5}
    samples = []
    for _ in range(300):
        tokens = rng.choice((0, 16, 128, 512, 1024, 2048))
        n_dec = rng.choice((0, 1, 8, 32, 128))
        if not tokens and not n_dec:
            continue
        f = [0.0] * len(FEATURES)
        f[0], f[1], f[3], f[4], f[8] = 1.0, tokens, n_dec, n_dec * rng.randint(8, 1024), float(tokens > 0)
        d = sum(device[k] * v for k, v in zip(FEATURES, f))
        h = sum(host[k] * f[FEATURES.index(k)] for k in HOST_FEATURES)
        samples.append((tuple(f), max(d, h) * (1 + 0.01 * rng.uniform(-1, 1))))
    linear, lstats = fit(samples)
    coeffs, host_coeffs, stats = fit_max(samples)
    assert host_coeffs is not None and 0 < stats["host_bound"] < len(samples)
    assert stats["mean_rel_err"] < 0.02 < lstats["mean_rel_err"]
    cost = CostModel(coeffs=coeffs, host_coeffs=host_coeffs)
    for f, t in samples:
        assert cost.forward_time(f) == pytest.approx(t, rel=0.05)
    # linear data: no host piece, the linear fit
    lin = [(f, sum(device[k] * v for k, v in zip(FEATURES, f))) for f, _ in samples]
    coeffs, host_coeffs, stats = fit_max(lin)
    assert stats["mean_rel_err"] < 1e-6
    # a profile with a host piece round-trips
    p = Profile(model="m", gpu="g", cost=cost, model_config={})
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).cost.host_coeffs == cost.host_coeffs
    with pytest.raises(ValueError, match="unknown host coefficient"):
        CostModel(host_coeffs={"prefill_tokens": 1.0})


def test_profile_round_trips_and_fits_the_cpu(cpu_profile, tmp_path):
    p = cpu_profile
    assert p.gpu.startswith("cpu") and p.num_pages and p.dtype == "float32"
    assert all(v >= 0 for v in p.cost.coeffs.values())
    # every profiled step takes time in the fit (on a busy machine the fit may give the time to
    # other features than the constant: CI once fitted const 0)
    assert all(p.cost.forward_time(tuple(s["features"][k] for k in FEATURES)) > 0
               for s in p.samples)
    assert {s["case"]["step"] for s in p.samples} == {"prefill", "mixed", "decode", "serve"}
    serve = [s for s in p.samples if s["case"]["step"] == "serve"]
    # a served trace's steps: every one with prompts, the decode ones capped (CPU_GRID's 200)
    decode = [s for s in serve if not s["features"]["prefill_tokens"]]
    assert 0 < len(decode) <= 200 and len(serve) > len(decode)
    assert any(s["features"]["decode_seqs"] and s["features"]["prefill_tokens"] for s in serve)
    again = Profile.load(p.save(tmp_path / "p.json"))
    assert again.to_dict() == p.to_dict()
    keys = json.loads((tmp_path / "p.json").read_text())
    assert {"model", "gpu", "coeffs", "h2d_gbps", "disk_gbps", "samples"} <= set(keys)


# A grid of few cases (both mixes with adapters, both late-arrival shapes) and no serving steps:
# the async-order tests profile an engine in a second or two.
SMALL_GRID = dict(batches=(1, 4), prompt_lens=(4, 16), mixes=("base", "distinct"), ranks=(4, 8),
                  decode_steps=3, max_case_tokens=2048, max_adapters=4, transfer_repeats=1,
                  overlap_repeats=1, serve_s=0.0)


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
    from slora.sim.profile import Grid, profile_engine

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
    old = {k: v for k, v in p.to_dict().items() if k != "async_scheduling"}  # made before it
    assert Profile.from_dict(old).async_scheduling is False


def test_logged_steps_attributes_async_time_to_the_collected_step(tiny_model_dir):
    """Async scheduling: each launched non-empty plan is logged once, when collected, in
    launch order, with the time since the collect before it (or since the call that scheduled
    it, after idling); the times add up to no more than the loop's."""
    from slora.request import SamplingParams
    from slora.sim.cost import plan_features
    from slora.sim.profile import logged_steps

    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=128, async_scheduling=True))
    engine.add_synthetic_adapter("a", 4)
    greedy, sampled = SamplingParams(max_tokens=5, ignore_eos=True), \
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0)  # collected at once
    launched, schedule = [], engine.scheduler.schedule

    def recorded(now):
        plan = schedule(now)
        if not plan.empty:
            launched.append(dict(zip(FEATURES, plan_features(plan, engine.adapters))))
        return plan

    engine.scheduler.schedule = recorded
    collect = engine.runner.collect
    t = time.perf_counter()
    with logged_steps(engine) as steps:
        for round in range(2):  # the second after idling
            engine.add_request([1, 2, 3], greedy, "a")
            engine.step()
            engine.add_request([4, 5], sampled)  # a late arrival, sampled
            engine.step()
            engine.add_request([6] * 7, greedy)
            while engine.has_unfinished():
                engine.step()
    wall = time.perf_counter() - t
    assert [s["features"] for s in steps] == launched and len(launched) >= 10
    assert all(s["seconds"] > 0 and 0 <= s["gc_s"] <= s["seconds"] for s in steps)
    assert sum(s["seconds"] for s in steps) <= wall
    assert steps[0]["copies"] and steps[0]["load_bytes"]  # the adapter's first load
    # everything restored
    assert "step" not in vars(engine) and "collect" not in vars(engine.runner)
    assert engine.runner.collect == collect and engine.scheduler.schedule is recorded


def test_logged_steps_sync_times_each_call(tiny_model_dir):
    """Without async scheduling a step's time is that of the `step()` call that ran it."""
    from slora.request import SamplingParams
    from slora.sim.profile import logged_steps

    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=64))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    calls, step = [], engine.step

    with logged_steps(engine) as steps:
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            calls.append(time.perf_counter() - t)
    assert len(steps) == len(calls) == 4
    assert all(0 < s["seconds"] <= c for s, c in zip(steps, calls))
    assert [s["features"]["prefill_tokens"] for s in steps] == [3, 0, 0, 0]
    assert set(steps[0]) == {"features", "seconds", "copies", "load_bytes", "prefetch_bytes",
                             "gc_s", "graphs", "compiles"}
    assert "step" not in vars(engine) and engine.step == step


def test_logged_steps_note_the_triton_kernels_compiled_within_a_step(tiny_model_dir, monkeypatch):
    """A step in which Triton compiles a kernel (a specialization the warm-up missed) names it
    in its `compiles`; Triton's compile hook is chained while the block runs and put back.
    (Under the interpreter nothing compiles: the runner's launch calls the hook itself.)"""
    from types import SimpleNamespace

    from triton import knobs

    from slora.request import SamplingParams
    from slora.sim.profile import logged_steps

    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda *, fn, **kw: earlier.append(fn.name))
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=64))
    launch, n = engine.runner.launch, [0]

    def compiling(plan, adapters, prev=None):
        n[0] += 1
        if n[0] == 2:  # the second step compiles a kernel
            knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_decode_kernel"), key=None)
        return launch(plan, adapters, prev)

    engine.runner.launch = compiling
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    hook = knobs.runtime.jit_post_compile_hook
    with logged_steps(engine) as steps:
        while engine.has_unfinished():
            engine.step()
    assert [s["compiles"] for s in steps] == [[], ["_decode_kernel"], []]
    assert earlier == ["_decode_kernel"] and knobs.runtime.jit_post_compile_hook is hook


# ----------------------------------------------------------------------------- same decisions

def _decisions(plan, now):
    """A step's decisions, by request id and adapter name."""
    return (now, [r.request_id for r in plan.decode], [r.request_id for r in plan.prefill],
            [n for n, _ in plan.adapter_loads], [n for n, _ in plan.prefetch], list(plan.evicted),
            [r.request_id for r in plan.preempted],
            [(r.request_id, r.finish_reason) for r in plan.finished])


def _decision_trace(seed=3):
    # bursty traffic on 12 adapters (ranks 4/8/16: 2, 4 and 8 pages) into a 56-page pool, at
    # most 8 running: queueing, adapter loads, prefetch, evictions and preemptions all happen
    return synthesize(num_adapters=12, rate=400.0, cv=2.0, alpha=0.6, duration=0.12,
                      input_len=(4, 60), output_len=(4, 40), ranks=(4, 8, 16), seed=seed)


ENGINE = dict(num_pages=56, block_size=16, max_num_seqs=8, max_batch_tokens=160,
              prefetch_reserve=4, prefetch_window=4, max_skips=4)

# The clock of the same-decisions test: a CPU profile of the tiny model (session 20's, rounded),
# fixed so the decisions do not depend on how fast the machine running the tests is (a fit on a
# busy CI machine once made steps so short that no adapter was ever evicted).
DECISION_COST = CostModel(
    coeffs=dict(const=6e-4, prefill_tokens=1.2e-5, decode_ctx=5e-6, adapters=1.5e-3,
                lora_decode=1.6e-5, eager=3e-4, lora=4e-4, eager_adapters=2e-5,
                mixed_adapters=2e-5),
    host_coeffs=dict(const=7e-4, decode_seqs=1.8e-4, adapters=1.1e-3, eager=4e-4, eager_lora=1.2e-3),
    h2d_gbps=6.0, disk_gbps=None, load_overhead_s=5e-5, prefetch_overlap=0.0)


@pytest.mark.parametrize("policy,async_scheduling", [
    ("fcfs", False), ("cluster", False), ("fair", False), ("abort", False),
    ("fcfs", True), ("abort", True)])
def test_engine_and_simulator_make_the_same_decisions(tiny_model_dir, cpu_profile, monkeypatch,
                                                      policy, async_scheduling):
    """... in the sync order of events, and in async scheduling's (each step launched before
    the one before it is collected; the device runs them back to back)."""
    trace = _decision_trace()
    engine_options = dict(ENGINE, policy=policy, slo_ttft_s=0.05, async_scheduling=async_scheduling)

    # the real engine, computing on CPU, on a virtual clock that advances by the cost model
    clock = VirtualClock()
    monkeypatch.setattr(slora.engine, "time", SimpleNamespace(monotonic=clock))
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 **engine_options))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    timing, runner = SimRunner(DECISION_COST), engine.runner
    execute, launch, collect = runner.execute, runner.launch, runner.collect
    device = {"free": 0.0}  # async: when the launched work ends; each flight's end

    def timed_execute(plan, adapters):
        dt = timing.step_time(plan, adapters)
        out = execute(plan, adapters)
        clock.now += dt
        return out

    def timed_launch(plan, adapters, prev=None):
        device["free"] = max(clock.now, device["free"]) + timing.step_time(plan, adapters)
        flight = launch(plan, adapters, prev)
        if flight is not None:
            device[id(flight)] = device["free"]
        return flight

    def timed_collect(flight):
        if flight is not None:
            clock.now = max(clock.now, device.pop(id(flight)))
        return collect(flight)

    if async_scheduling:
        runner.launch, runner.collect = timed_launch, timed_collect
    else:
        runner.execute = timed_execute
    real_steps, schedule = [], engine.scheduler.schedule

    def recorded_schedule(now):
        plan = schedule(now)
        real_steps.append(_decisions(plan, now))
        return plan

    engine.scheduler.schedule = recorded_schedule
    run = replay(engine, trace, vocab_size=engine.model_config.vocab_size, clock=clock,
                 sleep=clock.sleep)

    # the simulator on the same trace, recording the same facts after each step
    sim_steps = []
    # (the profile's order of events is the simulation's: no ProfileOrderWarning here)
    profile = dataclasses.replace(cpu_profile, cost=DECISION_COST,
                                  async_scheduling=async_scheduling)
    sim_run = simulate(trace, profile, engine_options=engine_options,
                       num_pages=engine_options["num_pages"],
                       model=ModelConfig.from_dir(tiny_model_dir), check=True,
                       on_step=lambda plan, start, dt: sim_steps.append(_decisions(plan, start)))

    assert len(real_steps) == len(sim_steps) > 20
    for i, (a, b) in enumerate(zip(real_steps, sim_steps)):
        assert a == b, f"step {i}: engine {a} != simulator {b}"
    s_real, s_sim = engine.stats(), sim_run.engine.stats()
    for key in ("adapter_loads", "adapter_evictions", "preemptions", "failed", "host_loads"):
        assert s_real[key] == s_sim[key], key
    assert s_real["adapter_evictions"] > 0
    assert any(step[4] for step in real_steps), "some adapters were prefetched"
    if policy == "fcfs":
        assert s_real["preemptions"] > 0
    if policy == "abort":
        assert s_real["slo_aborted"] > 0
    # same decisions at the same times: the same per-request timings, hence the same metrics
    assert sorted(map(_times, run.records)) == sorted(map(_times, sim_run.records))
    summary = summarize(run.records, slo_ttft_s=0.05, duration_s=run.duration_s).to_dict()
    assert {k: sim_run.result[k] for k in summary} == summary


def _times(r):
    return (r.arrival_time, r.first_token_time or -1.0, r.finish_time or -1.0, r.prompt_tokens,
            r.output_tokens, r.failed, r.adapter or "")


# ----------------------------------------------------------------------------- conservation

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
    assert pages_for_memory(ModelConfig.from_dir(LLAMA_7B), 16, "bfloat16", 80) < \
        pages_for_memory(ModelConfig.from_dir(LLAMA_7B), 16, "bfloat16", 141)


def test_cli_simulate_and_plot(tmp_path, cpu_profile):
    from slora.cli import main

    trace_path = tmp_path / "t.jsonl"
    write_trace(synthesize(num_adapters=8, rate=50, cv=1, alpha=1, duration=1, input_len=(4, 30),
                           output_len=(2, 20), ranks=(4, 8), seed=0), trace_path)
    prof = cpu_profile.save(tmp_path / "cpu.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", str(trace_path), "--profile", str(prof), "--num-pages", "64",
                 "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("throughput_req_s", "throughput_tok_s", "avg_latency_s", "ttft_p50_s", "ttft_p90_s",
                "ttft_p99_s", "slo_attainment", "num_requests", "num_completed"):
        assert key in result
    assert result["source"] == "simulate" and result["num_completed"] == 50
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
    assert main(["plot", *map(str, files), "-o", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_simulating_in_another_order_than_the_profile_warns(tmp_path, cpu_profile, capsys,
                                                            monkeypatch):
    """A sync profile simulated with async scheduling (or the reverse) draws one warning line
    that says to re-profile; the simulation still runs. Without the flag a simulation takes
    the profile's order. `slora profile --async-scheduling` profiles an engine with it."""
    import slora.sim.profile
    from slora.cli import main
    from slora.sim.simulator import ProfileOrderWarning

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


# ----------------------------------------------------------------------------- speed

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


def test_refit_derives_new_features_from_old_samples():
    """A profile stored before `eager`, `eager_lora`, `lora`, `eager_adapters`, `mixed` and
    `mixed_adapters` existed refits from its own samples."""
    from slora.sim.cost import CostModel, Profile

    old_keys = FEATURES[:8]
    samples = []
    for n_pre in (0, 1, 3):
        for n_a in (0, 1, 3):
            for n_dec in (0, 1, 8, 32):
                if not n_pre and not n_dec:
                    continue
                f = dict(zip(old_keys, (1.0, 64.0 * n_pre, 0.0, n_dec, 100.0 * n_dec, n_a, 0.0, 0.0)))
                eager = 1.0 if n_pre else 0.0
                t = 5e-3 + 2e-5 * f["prefill_tokens"] + 1e-5 * n_dec + 4e-3 * eager + 9e-3 * eager * (n_a > 0)
                samples.append({"features": f, "seconds": t})
    p = Profile(model="m", gpu="g", cost=CostModel(), model_config={}, samples=samples)
    q = p.refit()
    assert q.cost.coeffs["eager"] == pytest.approx(4e-3, rel=1e-6)
    assert q.cost.coeffs["eager_lora"] == pytest.approx(9e-3, rel=1e-6)
    assert q.cost.coeffs["lora"] == pytest.approx(0, abs=1e-9)
    assert q.cost.coeffs["eager_adapters"] == pytest.approx(0, abs=1e-9)
    assert q.cost.coeffs["mixed"] == pytest.approx(0, abs=1e-9)
    assert q.fit_stats["refit"] and q.fit_stats["mean_rel_err"] < 1e-9


def test_sim_vs_replay_logs_steps_and_their_residuals(tiny_model_dir, cpu_profile, tmp_path, capsys):
    """experiments/sim_vs_replay.py end to end on CPU: the replay's step log holds every step
    with its features, and the residual table compares it with the cost model."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "experiments" / "sim_vs_replay.py"
    spec = importlib.util.spec_from_file_location("sim_vs_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prof = cpu_profile.save(tmp_path / "cpu.json")
    out = tmp_path / "svr"
    assert mod.main(["--model", str(tiny_model_dir), "--profile", str(prof), "--duration", "1",
                     "--lengths", "4", "8", "--only", "n100-a1-r4", "--results", str(out),
                     "--engine", json.dumps({"device": "cpu", "dtype": "float32"})]) == 0
    steps = [json.loads(x) for x in (out / "n100-a1-r4-steps.jsonl").read_text().splitlines()]
    replay = json.loads((out / "n100-a1-r4-replay.json").read_text())
    assert steps and all(s["seconds"] > 0 and set(s["features"]) == set(FEATURES) for s in steps)
    assert all(s["graphs"] == 0 and 0 <= s["gc_s"] <= s["seconds"] for s in steps)  # CPU: none
    assert any(s["features"]["prefill_tokens"] for s in steps)  # prompts and
    assert any(s["features"]["decode_seqs"] for s in steps)  # decodes both logged
    assert sum(s["seconds"] for s in steps) <= replay["duration_s"]  # steps of this replay
    # each step logs the bytes of the adapter copies it made: every adapter loaded at least once
    nbytes = {r: b for r, b in zip(*_adapter_bytes(tiny_model_dir, out / "n100-a1-r4.jsonl"))}
    copied = [b for s in steps for b in s["load_bytes"] + s["prefetch_bytes"]]
    assert copied and set(copied) <= set(nbytes.values())
    assert all(s["copies"] == bool(s["load_bytes"] or s["prefetch_bytes"]) for s in steps)
    # (the engine's count also has the loads of its warm-up, before the log starts)
    assert 0 < sum(len(s["load_bytes"]) + len(s["prefetch_bytes"]) for s in steps) \
        <= replay["stats"]["adapter_loads"]
    assert "measured vs the cost model" in capsys.readouterr().out
    # a step far slower than its model shows as a stall, with its collector time and captures
    slow = tmp_path / "slow-steps.jsonl"
    slow.write_text(json.dumps({**steps[0], "seconds": 100.0, "gc_s": 0.25, "graphs": 2}) + "\n")
    assert ("stalls (steps over 3x the model's time): 1" in mod.step_residuals(slow, cpu_profile)
            and "garbage collector 250 ms, 2 graph captures" in mod.step_residuals(slow, cpu_profile))
    # --resimulate: the simulator again over the stored replay, no replay run
    (out / "n100-a1-r4-simulate.json").unlink()
    assert mod.main(["--model", str(tiny_model_dir), "--profile", str(prof), "--only", "n100-a1-r4",
                     "--results", str(out), "--resimulate",
                     "--engine", json.dumps({"device": "cpu", "dtype": "float32"})]) == 0
    printed = capsys.readouterr().out
    assert "replay:" not in printed and "simulate" in printed
    assert json.loads((out / "n100-a1-r4-replay.json").read_text()) == replay
    assert (out / "n100-a1-r4-simulate.json").exists()


def _adapter_bytes(model_dir, trace_path):
    """The names and bytes of a trace's adapters as an engine registers them (synthetic)."""
    from slora.workload import read_trace

    trace = read_trace(trace_path)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=64))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    infos = engine.adapters.adapters
    names = sorted({r.adapter for r in trace.requests if r.adapter})
    return names, [infos[n].nbytes for n in names]


def test_cli_profile_refit(tmp_path, cpu_profile, capsys):
    """`slora profile --refit` refits a stored profile's steps without a device or a model."""
    from slora.cli import main

    old = cpu_profile.to_dict()
    for s in old["samples"]:  # as a profile made before the newest features existed
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


def test_steps_that_replay_mixed_graphs_are_not_eager():
    """With `mixed_graph_tokens` set, a step with prompts of at most that many tokens in all
    replays a CUDA graph: the cost model's `eager` features are 0 for it."""
    from slora.sim.cost import plan_features

    pre = SimpleNamespace(num_new=10, num_tokens=10, adapter="a")
    dec = SimpleNamespace(prompt_token_ids=[1] * 5, output_token_ids=[2], adapter=None)
    plan = SimpleNamespace(prefill=[pre], decode=[dec, dec])
    adapters = SimpleNamespace(adapters={"a": SimpleNamespace(num_pages=3)})
    idx = {k: FEATURES.index(k) for k in ("eager", "eager_lora", "eager_adapters", "lora")}
    for graph_tokens, eager in ((0, 1.0), (11, 1.0), (12, 0.0), (64, 0.0)):
        f = plan_features(plan, adapters, graph_tokens)
        assert [f[idx[k]] for k in ("eager", "eager_lora", "eager_adapters")] == [eager] * 3
        assert f[idx["lora"]] == 1.0


def test_step_loads_in_pieces_wait_for_the_first_piece_only():
    """CostModel.step_time: the step's own loads in K pieces of layers, the forward waiting for
    each piece: the first piece's copy before any compute, the rest beside the forward as
    prefetch copies are. K = 1 (profiles before pieces, the CPU): every load before it."""
    whole = CostModel(prefetch_overlap=1.0)
    pieces = CostModel(prefetch_overlap=1.0, load_pieces=4)
    assert whole.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(14.0)
    assert pieces.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(11.0)
    # copies longer than the forward: the copy stream sets the time
    assert pieces.step_time(forward=1.0, blocking=8.0, prefetch=2.0, disk=0.5) == pytest.approx(10.5)
    serial = CostModel(prefetch_overlap=0.0, load_pieces=4)
    assert serial.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(14.0)
    p = Profile(model="m", gpu="g", cost=pieces, model_config={})
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).cost.load_pieces == 4
    old = {k: v for k, v in p.to_dict().items() if k != "load_pieces"}
    assert Profile.from_dict(old).cost.load_pieces == 1
    with pytest.raises(ValueError, match="load_pieces=0"):
        CostModel(load_pieces=0)
