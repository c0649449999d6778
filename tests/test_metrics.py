"""Metrics on hand-made records equal the values computed by hand."""

import json

import numpy as np
import pytest

from slora.metrics import RequestRecord, result_dict, summarize

RECORDS = [
    # arrival, first token, finish, prompt, output: ttft 1, latency 3, tpot (3-1)/4
    RequestRecord(0.0, 1.0, 3.0, 10, 5),
    # ttft 1.5, latency 5, tpot (6-2.5)/5
    RequestRecord(1.0, 2.5, 6.0, 20, 6),
    # ttft 7 (misses a 6 s SLO), latency 8, one output token: no tpot
    RequestRecord(2.0, 9.0, 10.0, 5, 1),
    # failed before its first token
    RequestRecord(3.0, None, None, 8, 0, failed=True, error="abort"),
]


def test_summary_by_hand():
    s = summarize(RECORDS)
    assert s.duration_s == 10.0  # the last finish
    assert s.throughput_req_s == pytest.approx(3 / 10)
    assert s.throughput_tok_s == pytest.approx((5 + 6 + 1) / 10)
    assert s.avg_latency_s == pytest.approx((3 + 5 + 8) / 3)
    assert s.avg_tpot_s == pytest.approx((0.5 + 0.7) / 2)
    assert s.avg_ttft_s == pytest.approx((1 + 1.5 + 7) / 3)
    # ttfts sorted [1, 1.5, 7]; linear interpolation at rank q/100 * 2
    assert s.ttft_p50_s == pytest.approx(1.5)
    assert s.ttft_p90_s == pytest.approx(1.5 + 0.8 * 5.5)
    assert s.ttft_p99_s == pytest.approx(1.5 + 0.98 * 5.5)
    assert s.slo_attainment == pytest.approx(2 / 4)  # the failed request counts as a miss
    assert (s.num_requests, s.num_completed, s.num_failed) == (4, 3, 1)


def test_slo_bound_and_duration_are_settable():
    s = summarize(RECORDS, slo_ttft_s=8.0, duration_s=20.0)
    assert s.slo_attainment == pytest.approx(3 / 4) and s.slo_ttft_s == 8.0
    assert s.throughput_req_s == pytest.approx(3 / 20)


def test_failed_request_with_a_first_token_is_still_a_miss():
    late_abort = RequestRecord(0.0, 0.5, 2.0, 4, 2, failed=True, error="abort")
    s = summarize([RECORDS[0], late_abort])
    assert s.slo_attainment == 0.5 and s.num_completed == 1


def test_all_failed_gives_nulls_not_nans():
    s = summarize([RECORDS[3]], duration_s=5.0)
    assert s.throughput_req_s == 0 and s.slo_attainment == 0
    assert s.avg_latency_s is None and s.ttft_p90_s is None and s.avg_tpot_s is None
    json.dumps(s.to_dict(), allow_nan=False)


def test_bad_input():
    with pytest.raises(ValueError, match="no request records"):
        summarize([])
    with pytest.raises(ValueError, match="needs first_token_time and finish_time"):
        RequestRecord(0.0, None, 1.0, 3, 1)
    with pytest.raises(ValueError, match="duration_s"):
        summarize([RECORDS[3]])  # nothing finished: no duration to divide by


def test_result_dict_is_json_with_the_metric_keys():
    r = result_dict(summarize(RECORDS), source="replay", config={"workload": {"rate": 1}},
                    stats={"preemptions": 0})
    for key in ("throughput_req_s", "throughput_tok_s", "avg_latency_s", "ttft_p50_s", "ttft_p90_s",
                "ttft_p99_s", "slo_attainment", "num_requests", "num_completed", "config"):
        assert key in r
    assert r["source"] == "replay" and r["stats"] == {"preemptions": 0}
    json.dumps(r, allow_nan=False)


def test_result_dict_stores_each_completed_requests_latencies_in_arrival_order():
    r = result_dict(summarize(RECORDS), source="replay", config={}, records=RECORDS[::-1])
    done = sorted((x for x in RECORDS if not x.failed), key=lambda x: x.arrival_time)
    assert r["latencies"] == {"ttft_s": [pytest.approx(x.ttft) for x in done],
                              "e2e_s": [pytest.approx(x.finish_time - x.arrival_time) for x in done]}
    s = summarize(RECORDS)
    assert s.ttft_p50_s == pytest.approx(float(np.percentile(r["latencies"]["ttft_s"], 50)))
    assert "latencies" not in result_dict(s, source="replay", config={})
