"""experiments/bench_prefix.py end to end on CPU with a tiny random model: the shared-prompt
trace replayed with prefix caching off and on, and simulated; no timings."""

import json

from slora.workload import read_trace


def test_bench_prefix_cpu(experiment, tiny_model_dir, tmp_path):
    engine = json.dumps({"device": "cpu", "dtype": "float32", "num_pages": 256,
                         "block_size": 16})
    res = experiment("bench_prefix").main([
        "--model", str(tiny_model_dir), "--adapters", "3", "--requests", "12", "--prefix", "48",
        "--input-len", "4", "8", "--output-len", "2", "4", "--rate", "50", "--rank", "4",
        "--engine", engine, "--profile", "experiments/profiles/h200-llama2-7b.json",
        "--out", str(tmp_path)])
    assert res == json.loads((tmp_path / "bench_prefix.json").read_text())
    trace = read_trace(tmp_path / "prefix-trace.jsonl")
    by_adapter = {}
    for r in trace.requests:  # each adapter's prompts share their first 48 tokens
        assert by_adapter.setdefault(r.adapter, r.prompt[:48]) == r.prompt[:48]
    assert len(trace) == 12 and len(by_adapter) > 1
    rows = {(r["setting"], r["source"]): r for r in res["rows"]}
    assert len(rows) == 4 and all(r["completed"] == 12 for r in rows.values())
    for source in ("replay", "simulate"):
        assert rows[("prefix caching off", source)]["prefix_hit_tokens"] == 0
        assert rows[("prefix caching on", source)]["prefix_hit_tokens"] > 0
    assert "mean TTFT off / on" in res["table"] and "simulate vs replay" in res["table"]
