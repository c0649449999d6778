"""experiments/bench_tp.py through its main(argv) on CPU with a tiny random model in fp32: one
device, then two ranks over gloo. Checks the rows and the table, the tokens equal on both
degrees, never the rates' values."""

import json

import pytest

SMALL = ["--device", "cpu", "--dtype", "float32", "--requests", "6", "--tokens", "5",
         "--prompt-len", "8", "--batch", "3", "--adapters", "4", "--num-requests", "5",
         "--input-len", "8,16", "--output-len", "3,6", "--context", "8", "--decode-tokens", "5",
         "--max-batch-tokens", "128", "--num-pages", "256"]


def test_bench_tp_two_ranks_against_one_cpu(experiment, tiny_model_dir, tmp_path):
    res = experiment("bench_tp").main(["--model", str(tiny_model_dir), "--big-model",
                                       str(tiny_model_dir), *SMALL, "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_tp.json").read_text()) == json.loads(
        json.dumps(res, default=str))
    assert res["command"].startswith("python3 experiments/bench_tp.py --model ")
    assert res["gpu"] is None and res["commit"] and res["ceilings"]["copy_GBps"] > 0
    assert set(res["degrees"]) == {"1", "2"}
    cmp = res["compare"]
    assert cmp["identical"] == cmp["requests"] == 6 and cmp["max_logprob_diff"] < 1e-4
    assert cmp["first_difference"] == [None] * 6
    for d in res["degrees"].values():
        assert [len(r["tokens"]) for r in d["correctness"]] == [5] * 6
        assert {r["adapter"] for r in d["correctness"]} == {None, "check-r8", "check-r16",
                                                            "check-r32", "check-r64"}
        assert [(r["modules"], r["batch"]) for r in d["decode"]] == [("none", 3), ("qkvo", 3)]
        assert all(r["step_ms"] > 0 for r in d["decode"])
        assert d["s4"]["requests"] == 5 and d["s4"]["adapters"] == 4 and d["s4"]["output_tok_s"] > 0
    lines = {ln["what"]: ln for ln in res["table"]}
    assert lines["greedy requests equal to TP=1 (5 tokens)"]["tp2"] == "6/6"
    for what, target in (("decode b3 no LoRA, ms/step", "<= 0.6"),
                         ("decode b3 qkvo r32, ms/step", "<= 0.6"),
                         ("S4 4 adapters qkvo, output tok/s", ">= 1.7")):
        ln = lines[what]
        assert ln["tp1"] > 0 and ln["tp2"] > 0 and ln["target"] == target
        assert ln["ratio"] == pytest.approx(ln["tp2"] / ln["tp1"])
        assert isinstance(ln["met"], bool)
    assert "LoRA comm. estimate ms (TP=2 - TP=1 / 2)" in lines


def test_bench_tp_one_device_alone(experiment, tiny_model_dir, tmp_path):
    res = experiment("bench_tp").main(["--tp", "1", "--model", str(tiny_model_dir),
                                       "--big-model", str(tiny_model_dir), *SMALL,
                                       "--out", str(tmp_path)])
    assert set(res["degrees"]) == {"1"} and res["compare"] is None
    assert all(ln["ratio"] is None and "tp2" not in ln for ln in res["table"])
    assert res["table"][0]["what"] == "decode b3 no LoRA, ms/step"
