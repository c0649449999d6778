"""experiments/bench_prefetch.py end to end on CPU with a tiny random model: many adapters, a
pool far smaller than their total, waves of requests. Checks that adapters are loaded,
evicted and (with a window) prefetched, and that every step is accounted for; no timings."""

import json


def test_bench_prefetch_cpu(experiment, tiny_model_dir, tmp_path):
    res = experiment("bench_prefetch").main(["--model", str(tiny_model_dir), "--device", "cpu", "--adapters", "60",
                     "--rank", "8", "--num-pages", "48", "--batch", "4", "--prefetch-reserve", "4",
                     "--waves", "6", "--wave-size", "4", "--steps-per-wave", "3",
                     "--prompt-len", "8", "--gen-len", "6", "--out", str(tmp_path)])
    assert res == json.loads((tmp_path / "bench_prefetch.json").read_text())
    assert res["command"].startswith("python3 experiments/bench_prefetch.py --model ")
    rows = res["rows"]
    no_window, window = rows
    for r in rows:
        s = r["stats"]
        assert s["adapter_loads"] > 0 and s["adapter_evictions"] > 0
        assert (s["pages_free"] + s["pages_kv"] + s["pages_adapter"] + s["pages_cached"]
                == s["pages_total"])
        assert s["pages_kv"] == 0 and s["failed"] == 0
        assert 0 < r["blocking_loads"] + r["prefetches"] <= s["adapter_loads"]  # + warm-up's
        assert r["steps"] == len(r["steps_detail"])
    assert no_window["prefetches"] == 0 and window["prefetches"] > 0
