"""The replay loop: requests go in at their arrival times, every request ends as a record, and
the metrics agree with the recorded timings. First against a scripted engine on a virtual clock
(exact, fast), then end to end on the real engine with a tiny model."""

from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest

from slora.metrics import summarize
from slora.replay import replay
from slora.request import RequestMetrics, RequestOutput
from slora.workload import Trace, TraceRequest, synthesize

STEP_S = 0.1


class Clock:
    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


class ScriptedEngine:
    """Every step takes STEP_S and gives each running request one token; `abort` names requests
    to finish with finish_reason "abort" at their first step; `max_prompt` refuses longer prompts."""

    def __init__(self, clock, abort=(), max_prompt=10**9):
        self.clock, self.abort, self.max_prompt = clock, set(abort), max_prompt
        self.running, self.max_tokens = {}, {}
        self.submitted = []
        self.scheduler = self  # `count_token_gaps`, as `Scheduler`'s
        self.gaps = None

    @contextmanager
    def count_token_gaps(self):
        self.gaps = Counter()
        yield self.gaps
        self.gaps = None

    def add_request(self, prompt, sampling, adapter=None, request_id=None, arrival_time=None,
                    cache_prefix=True):
        if len(prompt) > self.max_prompt:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds {self.max_prompt}")
        rid = f"r{len(self.submitted)}"
        self.submitted.append((rid, prompt, sampling, adapter, arrival_time, self.clock()))
        self.running[rid] = RequestOutput(rid, adapter, list(prompt), "", [], None, None, False,
                                          RequestMetrics(arrival_time))
        self.max_tokens[rid] = sampling.max_tokens
        return rid

    def has_unfinished(self):
        return bool(self.running)

    def step(self):
        self.clock.now += STEP_S
        outs = []
        for rid, out in list(self.running.items()):
            out.token_ids.append(7)
            if out.metrics.first_token_time is None:
                out.metrics.first_token_time = self.clock.now
            elif self.gaps is not None:
                self.gaps[STEP_S] += 1
            if rid in self.abort or len(out.token_ids) == self.max_tokens[rid]:
                out.finished, out.finish_reason = True, "abort" if rid in self.abort else "length"
                out.metrics.finish_time = self.clock.now
                del self.running[rid]
            outs.append(out)
        return outs


def small_trace():
    return Trace([TraceRequest(0.5, "a", 3, prompt_len=4), TraceRequest(0.55, None, 1, prompt_len=6),
                  TraceRequest(5.0, "b", 2, prompt=[1, 2, 3])])


def test_requests_enter_at_arrival_times_and_all_complete():
    clock = Clock()
    engine = ScriptedEngine(clock)
    run = replay(engine, small_trace(), vocab_size=50, clock=clock, sleep=clock.sleep)

    assert len(run.records) == 3 and not any(r.failed for r in run.records)
    # the engine was idle until 0.5 s and between the first two requests' end and 5.0 s: it slept
    assert clock.sleeps[0] == pytest.approx(0.5) and len(clock.sleeps) == 2
    # submitted with the scheduled arrival time, never before it
    for (_, _, sampling, adapter, arrival, submitted_at), req in zip(engine.submitted,
                                                                     small_trace().requests):
        assert arrival == pytest.approx(100.0 + req.arrival_time) and submitted_at >= arrival
        assert sampling.max_tokens == req.output_len and sampling.ignore_eos and adapter == req.adapter
    prompts = [p for _, p, *_ in engine.submitted]
    assert [len(p) for p in prompts[:2]] == [4, 6] and max(prompts[0] + prompts[1]) < 50
    assert prompts[2] == [1, 2, 3]

    by_arrival = sorted(run.records, key=lambda r: r.arrival_time)
    assert [r.arrival_time for r in by_arrival] == pytest.approx([0.5, 0.55, 5.0])
    assert [r.output_tokens for r in by_arrival] == [3, 1, 2]
    assert run.duration_s == pytest.approx(max(r.finish_time for r in run.records))


def test_metrics_agree_with_the_recorded_timings():
    clock = Clock()
    trace = synthesize(num_adapters=3, rate=4, cv=1, alpha=1, duration=10, input_len=(2, 5),
                       output_len=(1, 6), seed=0)
    run = replay(ScriptedEngine(clock), trace, vocab_size=50, clock=clock, sleep=clock.sleep)
    s = summarize(run.records, duration_s=run.duration_s)
    assert s.num_completed == s.num_requests == len(trace)
    lat = [r.finish_time - r.arrival_time for r in run.records]
    ttft = [r.first_token_time - r.arrival_time for r in run.records]
    assert s.avg_latency_s == pytest.approx(np.mean(lat))
    assert s.ttft_p90_s == pytest.approx(np.percentile(ttft, 90))
    assert min(ttft) >= 0 and s.throughput_req_s == pytest.approx(len(trace) / run.duration_s)
    # every token after a request's first came one step after the one before it
    assert run.token_gaps == {STEP_S: sum(r.output_tokens - 1 for r in run.records)}
    s = summarize(run.records, duration_s=run.duration_s, token_gaps=run.token_gaps)
    assert s.itl_p50_s == s.itl_p99_s == s.itl_max_s == STEP_S


def test_refused_and_aborted_requests_are_failed_records_with_reasons():
    clock = Clock()
    engine = ScriptedEngine(clock, abort={"r1"}, max_prompt=5)
    run = replay(engine, small_trace(), vocab_size=50, clock=clock, sleep=clock.sleep)
    assert len(run.records) == 3
    failed = {r.error for r in run.records if r.failed}
    assert failed == {"abort", "rejected at submission: prompt of 6 tokens exceeds 5"}


# ---------------------------------------------------------------------------------------------
# The real engine (the tiny random Llama of tests/conftest.py, on CPU).


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_replay_on_tiny_model(tiny_model_dir, async_scheduling):
    from slora import Engine, EngineConfig
    from slora.config import ModelConfig
    from slora.replay import register_adapters

    trace = synthesize(num_adapters=3, rate=8, cv=1, alpha=1, duration=1, input_len=(3, 12),
                       output_len=(1, 5), ranks=(4, 8), seed=0)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=64,
                                 async_scheduling=async_scheduling))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    run = replay(engine, trace, vocab_size=ModelConfig.from_dir(tiny_model_dir).vocab_size)

    assert len(run.records) == len(trace) and not any(r.failed for r in run.records)
    want = sorted((r.arrival_time, r.prompt_len, r.output_len) for r in trace.requests)
    got = sorted((r.arrival_time, r.prompt_tokens, r.output_tokens) for r in run.records)
    assert [g[1:] for g in got] == [w[1:] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want])
    for r in run.records:
        assert r.arrival_time <= r.first_token_time <= r.finish_time <= run.duration_s
    # one gap for every token after a request's first, each within the run
    assert sum(run.token_gaps.values()) == sum(r.output_tokens - 1 for r in run.records)
    assert all(0 < g <= run.duration_s for g in run.token_gaps)
    s = summarize(run.records, duration_s=run.duration_s)
    assert s.avg_latency_s == pytest.approx(np.mean([r.finish_time - r.arrival_time for r in run.records]))


def test_itl_percentiles_are_nearest_rank_over_tokens():
    from slora.metrics import itl_stats

    # 98 tokens after 10 ms gaps, one after 50 ms, one after 2 s: p99 is the 99th token's gap
    got = itl_stats({0.01: 98, 0.05: 1, 2.0: 1})
    assert got == {"itl_p50_s": 0.01, "itl_p99_s": 0.05, "itl_max_s": 2.0}
    assert itl_stats({0.01: 97, 0.05: 1, 2.0: 2})["itl_p99_s"] == 2.0
    assert itl_stats(None) == itl_stats({}) == {"itl_p50_s": None, "itl_p99_s": None,
                                                "itl_max_s": None}
