"""experiments/bench_kernels.py --smoke on CPU (the interpreter): each of its modes runs and its
kernels agree with the reference (e.g. the mixed-step comparison's two ways of running a mixed
step: decode rows through the prefill kernels, or through the decode kernels). Rates under the
interpreter mean nothing; errors do."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mixed_step_comparison_smoke(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--smoke",
                    "--only-mixed", "--out", str(tmp_path)], check=True, capture_output=True)
    rows = json.loads((tmp_path / "bench_kernels_mixed.json").read_text())["mixed"]
    assert [r["n_dec"] for r in rows] == [3]
    for r in rows:
        for how in ("one", "split"):
            assert r[f"err_attn_{how}"] < 1e-4 and r[f"err_lora_{how}"] < 1e-4
            assert r[f"us_attn_{how}"] > 0 and r[f"us_lora_{how}"] > 0


def test_gemm_sweep_smoke(tmp_path):
    """--tune gemm: each decode GEMM shape through cuBLAS (F.linear) and the few-rows Triton
    kernel, its picked tiles and the sweep's, all matching F.linear in fp32."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--smoke",
                    "--tune", "gemm", "--tune-only", "--out", str(tmp_path)], check=True,
                   capture_output=True)
    rows = json.loads((tmp_path / "bench_kernels_tune.json").read_text())["tune"]
    assert {r["module"] for r in rows} == {"qkv", "o", "gate_up", "down"}
    assert {r["kind"] for r in rows} == {"cublas", "triton", "triton-sweep"}
    assert all(r["err"] < 1e-5 and r["us"] > 0 for r in rows)


def test_gemm_lora_smoke(tmp_path):
    """--gemm-lora: each decode GEMM with its LoRA expand in two launches and in one, the two
    agreeing in fp32, for every module group."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--smoke",
                    "--gemm-lora", "--out", str(tmp_path)], check=True, capture_output=True)
    rows = json.loads((tmp_path / "bench_kernels_gemm_lora.json").read_text())["gemm_lora"]
    assert {r["module"] for r in rows} == {"qkv", "o", "gate_up", "down"}
    assert all(r["err"] < 1e-5 and r["us_one"] > 0 and r["us_two"] > 0 for r in rows)


def test_only_one_table_smoke(tmp_path):
    """--only mbgmv / attention: the ceilings and that one table, its rows matching the
    reference, and none of the other tables."""
    for only in ("mbgmv", "attention"):
        out = tmp_path / only
        subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--smoke",
                        "--only", only, "--out", str(out)], check=True, capture_output=True)
        res = json.loads((out / "bench_kernels_smoke.json").read_text())
        assert res[only] and not res["mixed"] and not res["mbgmm"]
        assert ("attention" in res) == (only == "attention")
        assert bool(res["mbgmv"]) == (only == "mbgmv")
        for r in res[only]:
            assert r.get("err_ours", r.get("err")) < 1e-4
