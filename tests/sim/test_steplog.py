"""Step logs (`slora.sim.steplog`): every step of a real engine with its cost-model features
and its time, in the sync order and in async scheduling's; the Triton kernels compiled within
a step; and experiments/sim_vs_replay.py, which writes a replay's step log and compares it with
the cost model."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

from slora import Engine, EngineConfig
from slora.replay import register_adapters
from slora.request import SamplingParams
from slora.sim.cost import FEATURES, plan_features
from slora.sim.steplog import logged_steps
from slora.workload import read_trace


def test_logged_steps_attributes_async_time_to_the_collected_step(tiny_model_dir):
    """Async scheduling: each launched non-empty plan is logged once, when collected, in
    launch order, with the time since the collect before it (or since the call that scheduled
    it, after idling); the times add up to no more than the loop's."""
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
    from triton import knobs

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


def test_sim_vs_replay_logs_steps_and_their_residuals(tiny_model_dir, cpu_profile, tmp_path, capsys):
    """experiments/sim_vs_replay.py end to end on CPU: the replay's step log holds every step
    with its features, and the residual table compares it with the cost model."""
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
    assert "itl p99 s replay / sim" in printed  # the decode tails compared too
    assert json.loads((out / "n100-a1-r4-replay.json").read_text()) == replay
    assert (out / "n100-a1-r4-simulate.json").exists()


def _adapter_bytes(model_dir, trace_path):
    """The names and bytes of a trace's adapters as an engine registers them (synthetic)."""
    trace = read_trace(trace_path)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=64))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    infos = engine.adapters.adapters
    names = sorted({r.adapter for r in trace.requests if r.adapter})
    return names, [infos[n].nbytes for n in names]
