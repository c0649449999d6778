"""experiments/bench_engine.py through its main(argv) on CPU with a tiny random model: slora's
rows (synchronous scheduling: the engine's default on CPU) beside HF transformers', the
harness's header first. Checks the rows, never the rates' values."""

import json


def test_bench_engine_cpu(experiment, tiny_model_dir, tmp_path):
    res = experiment("bench_engine").main([
        "--models", str(tiny_model_dir), "--batches", "1,3", "--prompt-len", "8",
        "--gen-len", "5", "--num-pages", "64", "--device", "cpu",
        "--dtype", "float32", "--out", str(tmp_path)])
    assert res["rows"] == json.loads((tmp_path / "bench_engine.json").read_text())["rows"]
    assert res["command"].startswith("python3 experiments/bench_engine.py --models ")
    assert res["gpu"] is None and res["commit"] and res["ceilings"]["copy_GBps"] > 0
    assert [(r["system"], r["batch"]) for r in res["rows"]] == [
        ("slora sync", 1), ("slora sync", 3), ("hf", 1), ("hf", 3)]
    for r in res["rows"]:
        assert r["gen_tok_s"] > 0 and r["wall_s"] > 0
        assert (r["decode_tok_s"] > 0) if r["system"].startswith("slora") else "decode_tok_s" not in r
