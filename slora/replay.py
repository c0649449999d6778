"""Trace replay: issue a trace's requests to an engine at their arrival times, record outcomes.

The loop is the open-loop client of S-LoRA's harness, run in-process: requests arrive on the
clock whether or not the engine keeps up, so queueing shows in the latencies.

    when idle, sleep until the next arrival -> add every request now due -> step while anything
    is unfinished

`replay` takes anything with the engine's `add_request / step / has_unfinished` and a clock, so
the simulator drives the same loop on its virtual clock and the two share the metrics path.
A request is submitted with its *scheduled* arrival time, so a step that delays submission still
counts against the request's latency, as it would for a real client.

`run_replay` is the real engine's side: it builds the engine, replays, and returns the result
dict, with a step log (`slora.sim.steplog`) when asked. This module imports nothing of
`slora.sim` at its top: the simulator and the profiler import the loop from here.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from slora.config import EngineConfig, ModelConfig
from slora.metrics import RequestRecord, result_dict, summarize
from slora.request import SamplingParams
from slora.workload import Trace, TraceRequest

FAILED_REASONS = ("abort", "error")


@dataclass
class ReplayRun:
    """Records (times in seconds since the replay's start) and the span from start to last finish."""

    records: list[RequestRecord]
    duration_s: float
    token_gaps: dict[float, int] = field(default_factory=dict)  # inter-token gaps -> tokens


def replay(engine, trace: Trace, *, vocab_size: int, seed: int = 0, progress: bool = False,
           label: str = "replay", clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> ReplayRun:
    """Replay `trace` on `engine` on the wall clock (or the given clock) and record every request.

    vocab_size: prompts given as `prompt_len` become that many token ids drawn uniformly from
        [0, vocab_size) with `seed` (the content does not matter to throughput; greedy decoding
        with `ignore_eos` makes every request produce exactly `output_len` tokens); they share
        no prefix with any other request, so they skip the prefix cache (`cache_prefix`).
    Every request ends as a record: completed, failed with the engine's reason, or failed because
    the engine refused it at submission (ValueError) or never reported it finished.
    progress: a bar over the requests, one tick as each ends, named `label` (what runs:
        "replay", "simulate", a profile's serving trace).
    """
    rng = np.random.default_rng(seed)
    pending = deque(trace.requests)
    submitted: dict[str, TraceRequest] = {}
    records: dict[str, RequestRecord] = {}  # by request id
    rejected: list[RequestRecord] = []
    bar = _progress_bar(len(trace), progress, label)
    with engine.scheduler.count_token_gaps() as gaps:  # the inter-token latencies
        start = clock()
        while pending or engine.has_unfinished():
            now = clock() - start
            if pending and pending[0].arrival_time > now and not engine.has_unfinished():
                sleep(pending[0].arrival_time - now)
                # Slept until that arrival: it is due even if the clock reads a hair short of it.
                now = max(clock() - start, pending[0].arrival_time)
            while pending and pending[0].arrival_time <= now:
                req = pending.popleft()
                # a prompt of the trace as given; a length alone, random ids that share no
                # prefix with any other request (so they skip the prefix cache)
                given = req.prompt is not None
                prompt = req.prompt if given else _random_ids(rng, req.prompt_len, vocab_size)
                try:
                    sampling = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
                    rid = engine.add_request(prompt, sampling, adapter=req.adapter,
                                             arrival_time=start + req.arrival_time,
                                             cache_prefix=given)
                except ValueError as e:
                    rejected.append(_failed(req, f"rejected at submission: {e}"))
                    bar.update(1)
                    continue
                submitted[rid] = req
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        records[out.request_id] = _record(out, start)
                        bar.update(1)
        end = clock()
    bar.close()
    for rid, req in submitted.items():
        if rid not in records:
            records[rid] = _failed(req, "the engine never reported this request finished")
    return ReplayRun(list(records.values()) + rejected, end - start, dict(gaps))


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, n).tolist()


def _record(out, start: float) -> RequestRecord:
    m = out.metrics
    failed = out.finish_reason in FAILED_REASONS

    def rel(t: float | None) -> float | None:
        return None if t is None else t - start

    return RequestRecord(
        arrival_time=m.arrival_time - start, first_token_time=rel(m.first_token_time),
        finish_time=rel(m.finish_time), prompt_tokens=len(out.prompt_token_ids),
        output_tokens=len(out.token_ids), failed=failed, adapter=out.adapter,
        error=(out.error or out.finish_reason) if failed else None)


def _failed(req: TraceRequest, why: str) -> RequestRecord:
    return RequestRecord(arrival_time=req.arrival_time, first_token_time=None, finish_time=None,
                         prompt_tokens=req.input_len or 0, output_tokens=0, failed=True,
                         adapter=req.adapter, error=why)


def _progress_bar(total: int, enabled: bool, label: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=label, disable=not enabled, dynamic_ncols=True)


def register_adapters(engine, trace: Trace, *, synthetic: bool, adapter_dir: str | None) -> None:
    """Make the trace's adapters known to `engine` (validated now, loaded lazily by the engine).

    synthetic: register every adapter of the trace header with its rank, as S-LoRA's harness
        starts its server with all `num_adapters` of a setting. Adapters of one rank share one
        host buffer of random weights (S-LoRA's dummy mode: throughput does not depend on the
        values); each load still copies the adapter's full size to the device.
    adapter_dir: a directory holding one PEFT adapter directory per adapter name the trace uses.
    """
    used = trace.adapter_names()
    if synthetic:
        unranked = [n for n in used if n not in trace.adapters]
        if unranked:
            raise ValueError(f"synthetic adapters need a rank, and the trace header gives none for "
                             f"{', '.join(map(repr, unranked[:5]))}{' ...' if len(unranked) > 5 else ''}: "
                             f"add them to the header's \"adapters\" map, or serve real adapters "
                             f"with --adapter-dir")
        for name, rank in trace.adapters.items():
            engine.add_synthetic_adapter(name, rank)
    elif adapter_dir is not None:
        for name in used:
            engine.add_adapter(name, str(Path(adapter_dir) / name))
    elif used:
        raise ValueError(f"the trace uses {len(used)} adapters (e.g. {used[0]!r}): choose synthetic "
                         f"adapters or an adapter directory")


def run_replay(trace: Trace, *, model: str, engine_options: dict, synthetic_adapters: bool = False,
               adapter_dir: str | None = None, trace_path: str | None = None, seed: int = 0,
               warmup: bool = True, progress: bool = False,
               step_log: str | Path | None = None) -> dict:
    """Build an engine, replay `trace` on it, and return the result dict (`slora.metrics.result_dict`).

    engine_options: EngineConfig fields besides `model` (device, dtype, num_pages, policy, ...);
    the SLO bound of the metrics is the engine's `slo_ttft_s`, the bound its abort policy uses.
    step_log: a JSONL path to write every step to, as the simulator's cost model sees it (its
        features, its wall seconds, its adapter copies): what a disagreement between replay and
        simulation is traced with.
    """
    from slora import Engine  # torch: imported only when the real engine runs
    from slora.sim.steplog import logged_steps, write_step_log

    config = EngineConfig(model=model, **engine_options)
    vocab_size = ModelConfig.from_dir(model).vocab_size
    engine = Engine(config)
    register_adapters(engine, trace, synthetic=synthetic_adapters, adapter_dir=adapter_dir)
    try:
        if warmup:  # kernel compiles and graph captures before the clock starts
            engine.warmup(progress=progress)
        with logged_steps(engine) if step_log else nullcontext() as steps:
            run = replay(engine, trace, vocab_size=vocab_size, seed=seed, progress=progress)
        stats = engine.stats()
    finally:
        engine.close()  # the next replay in this process sizes its pool from free memory
    if steps is not None:
        write_step_log(steps, step_log)
    summary = summarize(run.records, slo_ttft_s=config.slo_ttft_s, duration_s=run.duration_s,
                        token_gaps=run.token_gaps)
    return result_dict(summary, source="replay", stats=stats, records=run.records,
                       token_gaps=run.token_gaps, config={
        "trace": trace_path, "workload": trace.params, "engine": asdict(config),
        "adapters": "synthetic" if synthetic_adapters else adapter_dir, "seed": seed})
