"""Serving metrics from per-request timings: what S-LoRA's harness reports, and what we compare.

The real engine (`slora.replay`) and the simulator both produce `RequestRecord`s; `summarize`
turns them into one `Summary`, and `result_dict` into the result JSON that `slora plot` reads.
So a replay and a simulation of the same trace are measured by the same code.

Definitions (S-LoRA's, except where noted):
- duration: from the trace's time zero to the last finish, unless given (S-LoRA's benchmark time).
- throughput_req_s: completed requests / duration; throughput_tok_s: their output tokens / duration.
- avg_latency_s: mean of finish - arrival over completed requests.
- avg_tpot_s: mean time per output token after the first, (finish - first token) / (output - 1),
  over completed requests with more than one output token (vLLM's TPOT; S-LoRA divides the
  whole latency by the output length, which mixes queueing and prefill into it).
- avg_ttft_s: mean first-token latency (first token - arrival) over completed requests.
- ttft_p50_s / p90_s / p99_s: first-token latency (first token - arrival) percentiles over
  completed requests, numpy's linear interpolation.
- itl_p50_s / p99_s / max_s: inter-token latency, the time between a request's successive
  tokens as the engine resolves them (every token after a request's first: a gap that spans a
  preemption and its recompute counts whole), over all requests' tokens, each gap counted
  once per token; nearest rank (the smallest gap that at least that share of the gaps do not
  exceed). None when the run did not count them (`Scheduler.count_token_gaps`).
- slo_attainment: the fraction of all requests whose first token came within `slo_ttft_s`
  (6 s, S-LoRA's bound); failed requests count as misses.
Statistics over an empty set are None (null in JSON), not NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_SLO_TTFT_S = 6.0


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome. Times are seconds on one clock (e.g. since the trace's start).

    failed: aborted or errored (the reason in `error`); a failed request may still have a first
    token. A completed request has both `first_token_time` and `finish_time`.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    prompt_tokens: int
    output_tokens: int
    failed: bool = False
    adapter: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.failed and (self.first_token_time is None or self.finish_time is None):
            raise ValueError("RequestRecord: a completed request needs first_token_time and "
                             "finish_time (mark it failed=True otherwise)")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class Summary:
    throughput_req_s: float
    throughput_tok_s: float
    avg_latency_s: float | None
    avg_tpot_s: float | None
    avg_ttft_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    slo_attainment: float
    slo_ttft_s: float
    duration_s: float
    num_requests: int
    num_completed: int
    num_failed: int

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
              duration_s: float | None = None,
              token_gaps: Mapping[float, int] | None = None) -> Summary:
    """Metrics over `records`; `duration_s` defaults to the last finish time (clock zero = start);
    `token_gaps`: seconds between successive tokens -> how many tokens (the ITL figures)."""
    if not records:
        raise ValueError("summarize: no request records")
    done = [r for r in records if not r.failed]
    if duration_s is None:
        duration_s = max((r.finish_time for r in records if r.finish_time is not None), default=0.0)
    if duration_s <= 0:
        raise ValueError(f"summarize: duration_s={duration_s!r} must be positive")
    ttfts = np.array([r.ttft for r in done], dtype=float)
    tpots = [(r.finish_time - r.first_token_time) / (r.output_tokens - 1)
             for r in done if r.output_tokens > 1]
    in_slo = sum(1 for r in records if r.ttft is not None and r.ttft <= slo_ttft_s and not r.failed)

    def pct(q: float) -> float | None:
        return float(np.percentile(ttfts, q)) if len(ttfts) else None

    return Summary(
        throughput_req_s=len(done) / duration_s,
        throughput_tok_s=sum(r.output_tokens for r in done) / duration_s,
        avg_latency_s=_mean([r.finish_time - r.arrival_time for r in done]),
        avg_tpot_s=_mean(tpots),
        avg_ttft_s=float(ttfts.mean()) if len(ttfts) else None,
        ttft_p50_s=pct(50),
        ttft_p90_s=pct(90),
        ttft_p99_s=pct(99),
        **itl_stats(token_gaps),
        slo_attainment=in_slo / len(records),
        slo_ttft_s=slo_ttft_s,
        duration_s=duration_s,
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
    )


def itl_stats(token_gaps: Mapping[float, int] | None) -> dict[str, float | None]:
    """{"itl_p50_s", "itl_p99_s", "itl_max_s"} of a gap -> count map (None each when it is
    None or empty): nearest rank, the smallest gap g with count(gaps <= g) >= q * total."""
    gaps = sorted((g, n) for g, n in (token_gaps or {}).items() if n > 0)
    if not gaps:
        return {"itl_p50_s": None, "itl_p99_s": None, "itl_max_s": None}
    total = sum(n for _, n in gaps)

    def rank(q: float) -> float:
        need, seen = q * total, 0
        for g, n in gaps:
            seen += n
            if seen >= need:
                return g
        return gaps[-1][0]

    return {"itl_p50_s": rank(0.5), "itl_p99_s": rank(0.99), "itl_max_s": gaps[-1][0]}


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def latencies(records: list[RequestRecord],
              token_gaps: Mapping[float, int] | None = None) -> dict[str, list]:
    """Per completed request, in arrival order: first-token latency ("ttft_s") and end-to-end
    latency ("e2e_s"), in seconds rounded to the microsecond; with `token_gaps`, the
    inter-token gaps as [seconds, tokens] pairs ("itl_s"), the gaps rounded to 0.1 ms (so a
    run of any length stores a few thousand pairs), ascending. `slora plot` draws their
    distributions; the Summary's percentiles are statistics of the same lists (of the exact
    gaps, for ITL)."""
    done = sorted((r for r in records if not r.failed), key=lambda r: r.arrival_time)
    out: dict[str, list] = {"ttft_s": [round(r.ttft, 6) for r in done],
                            "e2e_s": [round(r.finish_time - r.arrival_time, 6) for r in done]}
    if token_gaps:
        binned: dict[float, int] = {}
        for g, n in token_gaps.items():
            key = round(g, 4)
            binned[key] = binned.get(key, 0) + n
        out["itl_s"] = [[g, n] for g, n in sorted(binned.items())]
    return out


def result_dict(summary: Summary, *, source: str, config: dict, stats: dict | None = None,
                records: list[RequestRecord] | None = None,
                token_gaps: Mapping[float, int] | None = None) -> dict:
    """The result JSON: metrics at the top level, then what produced them.

    source: "replay" (the real engine) or "simulate"; `slora plot` draws them as separate series.
    config: {"trace": path, "workload": trace params, "engine": EngineConfig fields, ...}.
    stats: the engine's counters at the end (`Engine.stats()`).
    records: the requests the summary was computed from; given, their `latencies` are stored
        last, under "latencies" (with `token_gaps`, the run's inter-token gaps too).
    """
    out = {**summary.to_dict(), "source": source, "config": config, "stats": stats or {}}
    if records is not None:
        out["latencies"] = latencies(records, token_gaps)
    return out
