"""Same decisions: the engine (the tiny model, really computing) and the simulator replay one
trace with their step times taken from one cost model; every step's admissions, adapter loads,
prefetches, evictions and preemptions agree, and so do the metrics, in the sync order of
events and in async scheduling's, under every queue policy."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import slora.engine
from slora import Engine, EngineConfig
from slora.config import ModelConfig
from slora.metrics import summarize
from slora.replay import register_adapters, replay
from slora.sim import CostModel, SimRunner, VirtualClock, simulate
from slora.workload import synthesize, with_shared_prefix


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


# The clock of the same-decisions test: a CPU profile of the tiny model, rounded and fixed, so the
# decisions do not depend on how fast the machine running the tests is (a fit on a busy machine
# can make steps so short that no adapter is ever evicted, and the test would check little).
DECISION_COST = CostModel(
    coeffs=dict(const=6e-4, prefill_tokens=1.2e-5, decode_ctx=5e-6, adapters=1.5e-3,
                lora_decode=1.6e-5, eager=3e-4, lora=4e-4, eager_adapters=2e-5,
                mixed_adapters=2e-5),
    host_coeffs=dict(const=7e-4, decode_seqs=1.8e-4, adapters=1.1e-3, eager=4e-4, eager_lora=1.2e-3),
    h2d_gbps=6.0, disk_gbps=None, load_overhead_s=5e-5, prefetch_overlap=0.0)


@pytest.mark.parametrize("policy,async_scheduling,prefix", [
    ("fcfs", False, 0), ("cluster", False, 0), ("fair", False, 0), ("abort", False, 0),
    ("fcfs", True, 0), ("abort", True, 0), ("fcfs", True, 40)])
def test_engine_and_simulator_make_the_same_decisions(tiny_model_dir, cpu_profile, monkeypatch,
                                                      policy, async_scheduling, prefix):
    """... in the sync order of events, and in async scheduling's (each step launched before
    the one before it is collected; the device runs them back to back); with `prefix`, every
    adapter's prompts share a system prompt of that many tokens, which prefix caching finds."""
    trace = _decision_trace()
    if prefix:
        trace = with_shared_prefix(trace, prefix, ModelConfig.from_dir(tiny_model_dir).vocab_size)
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
    for key in ("adapter_loads", "adapter_evictions", "preemptions", "failed", "host_loads",
                "prefix_hit_tokens", "prefix_query_tokens", "pages_cached"):
        assert s_real[key] == s_sim[key], key
    if prefix:  # (preempted requests find their own pages again: hits happen without too)
        assert s_real["prefix_hit_tokens"] >= 10 * prefix
    assert s_real["adapter_evictions"] > 0
    assert any(step[4] for step in real_steps), "some adapters were prefetched"
    if policy == "fcfs":
        assert s_real["preemptions"] > 0
    if policy == "abort":
        assert s_real["slo_aborted"] > 0
    # same decisions at the same times: the same per-request timings, hence the same metrics
    assert sorted(map(_times, run.records)) == sorted(map(_times, sim_run.records))
    summary = summarize(run.records, slo_ttft_s=0.05, duration_s=run.duration_s,
                        token_gaps=run.token_gaps).to_dict()
    assert {k: sim_run.result[k] for k in summary} == summary
    assert summary["itl_p50_s"] > 0


def _times(r):
    return (r.arrival_time, r.first_token_time or -1.0, r.finish_time or -1.0, r.prompt_tokens,
            r.output_tokens, r.failed, r.adapter or "")
