"""experiments/bench_serve.py --smoke: the S2 comparison's whole path on CPU (a tiny random
model, the in-process replay, then `slora serve` in a child process on 127.0.0.1 driven over
HTTP). Checks what both replays served and the files they leave, never timings."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_bench_serve_smoke(experiment, tmp_path, capsys):
    bench = experiment("bench_serve")
    res = bench.main(["--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out

    assert res["requests"] == 8
    for side in ("inprocess", "http"):
        r = res[side]
        assert r["num_completed"] == r["num_requests"] == 8 and r["num_failed"] == 0
        assert r["throughput_tok_s"] > 0 and r["ttft_p50_s"] is not None
    # both replays served the same tokens: every request its output_len (ignore_eos)
    for name in ("inprocess.json", "http.json"):
        result = json.loads((tmp_path / name).read_text())
        tokens = result["throughput_tok_s"] * result["duration_s"]
        assert tokens == pytest.approx(res["output_tokens"])
        lat = result["latencies"]
        assert (len(lat["ttft_s"]), len(lat["e2e_s"])) == (8, 8)
        # a gap for each token after a request's first, in-process and over HTTP alike
        assert sum(n for _, n in lat["itl_s"]) == res["output_tokens"] - 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench_serve.json", "http.json", "inprocess.json", "serve.log"]
    assert res["engine"]["num_pages"] == res["inprocess"]["stats"]["pages_total"]
    assert res["ratio"] > 0 and res["server_exit"] == 0
    assert "slora serve" in out and "throughput http / in-process" in out

    # the two result files plot side by side, one line each
    from slora.cli import main
    from slora.plot import load_results, series_keys

    paths = [tmp_path / "inprocess.json", tmp_path / "http.json"]
    assert series_keys(load_results(paths)) == ["source"]
    assert main(["plot", *map(str, paths), "-o", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 0
