"""experiments/bench_kernels.py --smoke on CPU (the interpreter), through its main(argv): each of
its modes runs and its kernels agree with the reference (e.g. the mixed-step comparison's two
ways of running a mixed step: decode rows through the prefill kernels, or through the decode
kernels). Rates under the interpreter mean nothing; errors do."""

import json
import os

import pytest

# --smoke runs CPU tensors through the Triton kernels: only under the interpreter, which the
# test run turns on where there is no GPU (tests/conftest.py)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter is off in this test run (a GPU)")


@pytest.fixture(scope="module")
def bench(experiment):
    return experiment("bench_kernels")


def test_mixed_step_comparison_smoke(bench, tmp_path):
    res = bench.main(["--smoke", "--only-mixed", "--out", str(tmp_path)])
    assert res.keys() == json.loads((tmp_path / "bench_kernels_mixed.json").read_text()).keys()
    assert res["command"].startswith("python3 experiments/bench_kernels.py --smoke --only-mixed")
    assert res["gpu"] is None and res["commit"] and res["ceilings"]["copy_GBps"] > 0
    rows = res["mixed"]
    assert [r["n_dec"] for r in rows] == [3]
    for r in rows:
        for how in ("one", "split"):
            assert r[f"err_attn_{how}"] < 1e-4 and r[f"err_lora_{how}"] < 1e-4
            assert r[f"us_attn_{how}"] > 0 and r[f"us_lora_{how}"] > 0


def test_overlap_smoke(bench, tmp_path):
    """--only overlap: the attention, GEMM and decode-chain ops alone, in series and forked,
    each timed (no SM carve-outs on CPU); the shares derive from the timings."""
    res = bench.main(["--smoke", "--only", "overlap", "--overlap-tokens", "5",
                      "--out", str(tmp_path)])
    row = json.loads((tmp_path / "bench_kernels_overlap.json").read_text())["overlap"]
    assert row == res["overlap"] and (row["B"], row["T"], row["layers"]) == (3, 5, 2)
    assert {k for k in row if k.startswith("ms_")} == {
        "ms_attention", "ms_gemms", "ms_serial", "ms_streams_gemms_first",
        "ms_streams_attention_first", "ms_chain", "ms_chain_serial", "ms_chain_streams"}
    assert all(row[k] > 0 for k in row if k.startswith("ms_")) and row["carveouts"] == []
    assert row["bytes_share"] > 0
    assert row["hidden_share"] == pytest.approx(
        (row["ms_chain_serial"] - row["ms_chain_streams"]) / row["ms_gemms"])


def test_experts_smoke(bench, tmp_path):
    """--only experts: the three forms of a layer of experts, timed, agreeing, at each
    batch."""
    res = bench.main(["--smoke", "--only", "experts", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_kernels_experts.json").read_text())["experts"]
    assert rows == res["experts"]
    assert [(r["model"], r["tokens"]) for r in rows] == [
        (m, t) for m in ("qwen3-30b-a3b", "mixtral-8x7b") for t in (1, 3)]
    assert all(r["ms_grouped"] > 0 and r["ms_dense"] > 0 and r["ms_fused"] > 0
               and r["err"] < 1e-5 for r in rows)


def test_gemm_sweep_smoke(bench, tmp_path):
    """--tune gemm: each decode GEMM shape through cuBLAS (F.linear) and the few-rows Triton
    kernel, its picked tiles and the sweep's, all matching F.linear in fp32."""
    bench.main(["--smoke", "--tune", "gemm", "--tune-only", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_kernels_tune.json").read_text())["tune"]
    assert {r["module"] for r in rows} == {"qkv", "o", "gate_up", "down"}
    assert {r["kind"] for r in rows} == {"cublas", "triton", "triton-sweep"}
    assert all(r["err"] < 1e-5 and r["us"] > 0 for r in rows)


def test_only_one_table_smoke(bench, tmp_path):
    """--only mbgmv / attention: the ceilings and that one table, its rows matching the
    reference, and none of the other tables."""
    for only in ("mbgmv", "attention"):
        out = tmp_path / only
        bench.main(["--smoke", "--only", only, "--out", str(out)])
        res = json.loads((out / "bench_kernels_smoke.json").read_text())
        assert res[only] and not res["mixed"] and not res["mbgmm"]
        assert ("attention" in res) == (only == "attention")
        assert bool(res["mbgmv"]) == (only == "mbgmv")
        for r in res[only]:
            assert r.get("err_ours", r.get("err")) < 1e-4


def test_mbgmv_sharing_smoke(bench, tmp_path):
    """--sharing: the tokens on one adapter, on two, each on its own, through MBGMV and the
    rows grouped by adapter, both matching the reference; the bytes count each distinct
    adapter once; `auto` names the path the table picks."""
    res = bench.main(["--smoke", "--only", "mbgmv", "--batches", "4", "--ranks", "8",
                      "--sharing", "1,2,0", "--modules", "1", "--out", str(tmp_path)])
    rows = res["mbgmv"]
    assert [(r["T"], r["rank"], r["adapters"]) for r in rows] == [(4, 8, 1), (4, 8, 2), (4, 8, 4)]
    for r in rows:
        assert r["err_ours"] < 1e-4 and r["err_seg"] < 1e-4 and r["us_seg"] > 0
    assert rows[0]["auto"] == "segments" and rows[-1]["auto"] == "mbgmv"
    assert rows[2]["bytes"] - rows[0]["bytes"] == 3 * (rows[1]["bytes"] - rows[0]["bytes"])
