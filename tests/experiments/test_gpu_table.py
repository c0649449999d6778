"""experiments/gpu_table.py and gpu.sh without a GPU: the table reads the fields that old and new
benchmark results both carry, from a run's folder or its .tar.gz, and puts each figure beside
its peer from the same run; gpu.sh parses and refuses unknown options."""

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_table(experiment):
    return experiment("gpu_table")


def write_run(path: Path, scale: float = 1.0, header: bool = True) -> Path:
    """A run as gpu.sh leaves it; without `header`, as a tree older than the harness wrote it."""
    head = {"gpu": "NVIDIA H200", "ceilings": {"copy_GBps": 4200.0, "gemm_bf16_TFLOPs": 700.0}}
    if header:
        head.update(commit="0123456789abcdef", command="python3 experiments/...")
    engine = {**head, "rows": [
        {"system": "slora", "model": "llama-2-7b", "batch": 32, "gen_tok_s": 5600.0,
         "decode_tok_s": 6400.0 * scale, "wall_s": 0.7},
        {"system": "slora+32x r16", "model": "llama-2-7b", "batch": 32,
         "gen_tok_s": 5040.0 * scale, "decode_tok_s": 5760.0, "wall_s": 0.8}]}
    s2 = {**head, "ceilings": {}, "scaling": [
        {"adapters": 0, "modules": "none", "output_tok_s": 8000.0, "ratio": 1.0},
        {"adapters": 2000, "modules": "qkvo", "output_tok_s": 6800.0 * scale, "ratio": 0.85}]}
    decode = {**head, "decode": [
        {"batch": 32, "modules": m, "step_ms": ms, "floor_ms": 4.0, "ratio": ms / 4.0}
        for m, ms in (("none", 5.2), ("qkvo", 5.6), ("all", 6.0))]}
    for name, res in (("engine/bench_engine.json", engine), ("s2/bench_scaling.json", s2),
                      ("decode/bench_scaling.json", decode)):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(res))
    (path / "pytest.log").write_text("....\n120 passed, 2 skipped in 61.20s (0:01:01)\n")
    (path / "commit.txt").write_text("b216879\n")  # gpu.sh's: the tree's commit
    return path


def test_one_run_holds_each_figure_beside_its_peer(gpu_table, tmp_path):
    run = gpu_table.load(str(write_run(tmp_path / "new")))
    got = {what: (fig, peer, name) for what, fig, peer, name in gpu_table.rows(run)}
    assert got == {
        "PEFT race, 32x r16: gen tok/s": (5040.0, 5600.0, "no LoRA"),
        "PEFT race, 32x r16: decode tok/s": (5760.0, 6400.0, "no LoRA"),
        "S2 qkvo, 2000 adapters: tok/s": (6800.0, 8000.0, "no LoRA"),
        "decode batch 32, none: ms/step": (5.2, 4.0, "byte floor"),
        "decode batch 32, qkvo: ms/step": (5.6, 4.0, "byte floor"),
        "decode batch 32, all: ms/step": (6.0, 4.0, "byte floor"),
        "device copy GB/s (read + write)": (4200.0, 4800, "datasheet"),
        "bf16 GEMM TFLOP/s (8192^3)": (700.0, 989, "datasheet")}
    text = gpu_table.table([run])
    assert text.splitlines()[0] == ("new: NVIDIA H200, commit 0123456789ab; "
                                    "tests: 120 passed, 2 skipped in 61.20s (0:01:01)")
    assert any(line.startswith("S2 qkvo, 2000 adapters: tok/s") and line.endswith("0.850")
               for line in text.splitlines())


def test_two_runs_compare_an_old_tree_from_its_archive(gpu_table, tmp_path):
    write_run(tmp_path / "base", header=False)
    with tarfile.open(tmp_path / "base.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "base", arcname="base")
    new = write_run(tmp_path / "new", scale=1.01)
    lines = gpu_table.table([gpu_table.load(str(tmp_path / "base.tar.gz")),
                             gpu_table.load(str(new))]).splitlines()
    # the old tree's JSON names no commit: gpu.sh's commit.txt does
    assert lines[0].startswith("base: NVIDIA H200, commit b216879; tests: 120 passed")
    assert lines[1].startswith("new: NVIDIA H200, commit 0123456789ab; ")
    assert lines[3].split()[-1] == "new/base"
    s2 = next(line for line in lines if line.startswith("S2 qkvo"))
    assert s2.split()[-1] == "1.010"


def test_gpu_sh_parses_and_refuses_unknown_options():
    script = ROOT / "experiments" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    res = subprocess.run(["bash", str(script), "--colour"], capture_output=True, text=True)
    assert res.returncode == 2 and "--tree DIR" in res.stderr
    assert len(script.read_text().splitlines()) <= 80


def test_fp8_gemm_rows_set_the_word_path_beside_the_converting_one(gpu_table, tmp_path):
    """bench_fp8.json (gpu.sh --bench fp8): a row per (module, M) the few-rows kernels ran,
    its figure the unpacking kernel's weight GB/s, its peer the converting kernel's."""
    run = write_run(tmp_path / "fp8")
    (run / "fp8").mkdir()
    (run / "fp8" / "bench_fp8.json").write_text(json.dumps({"rows": [
        {"module": "o", "M": 32, "path": p, "us": us, "weight_GBps": gbps}
        for p, us, gbps in (("bf16", 14.0, 2400.0), ("fp8 unpacked", 8.0, 2100.0),
                            ("fp8 converted", 20.0, 840.0), ("fp8 _scaled_mm", 16.6, 1010.0))] + [
        {"module": "o", "M": 256, "path": "fp8 _scaled_mm", "us": 20.0, "weight_GBps": 840.0}]}))
    got = {what: (fig, peer, name) for what, fig, peer, name in
           gpu_table.rows(gpu_table.load(str(run)))}
    assert got["FP8 GEMM o x32: GB/s"] == (2100.0, 840.0, "converted")
    assert not [w for w in got if "x256" in w]


def test_chunk_rows_sit_beside_the_unchunked_row(gpu_table, tmp_path):
    """chunk/bench_scaling.json: each chunked S2 row's tok/s and p99 inter-token latency
    beside the unchunked row of the same adapters; long/: the long prompt's rate."""
    path = write_run(tmp_path / "new")
    rows = [{"adapters": a, "modules": m, "max_prefill_chunk": c, "output_tok_s": t,
             "itl_p99_ms": p99}
            for a, m, c, t, p99 in ((0, "none", 0, 8000.0, 200.0), (2000, "qkvo", 0, 6800.0, 250.0),
                                    (0, "none", 1024, 7900.0, 50.0),
                                    (2000, "qkvo", 1024, 6700.0, 60.0))]
    (path / "chunk").mkdir()
    (path / "chunk" / "bench_scaling.json").write_text(json.dumps({"scaling": rows}))
    (path / "long").mkdir()
    (path / "long" / "bench_scaling.json").write_text(json.dumps(
        {"long": {"prompt_tokens": 100000, "prefill_tok_s": 9000.0}}))
    got = {what: (fig, peer, name) for what, fig, peer, name in gpu_table.rows(gpu_table.load(str(path)))}
    assert got["S2 qkvo, 2000 ad., chunk 1024: tok/s"] == (6700.0, 6800.0, "unchunked")
    assert got["S2 qkvo, 2000 ad., chunk 1024: ITL p99 ms"] == (60.0, 250.0, "unchunked")
    assert got["S2 none, 0 ad., chunk 1024: ITL p99 ms"] == (50.0, 200.0, "unchunked")
    assert not any("chunk 0" in what for what in got)
    assert got["100000-token prompt: prompt tok/s"][0] == 9000.0
    text = gpu_table.table([gpu_table.load(str(path))])
    # a label longer than the usual column still stands apart from its peer's name
    assert "S2 qkvo, 2000 ad., chunk 1024: ITL p99 ms  unchunked" in text


def test_popularity_path_and_shared_rows_are_named_by_them(gpu_table, tmp_path):
    """bench_scaling's S2 rows at a popularity alpha and decode LoRA path, and its shared-
    adapter decode table (each row beside the no-LoRA row of its batch), in one run."""
    path = write_run(tmp_path / "new")
    s2 = json.loads((path / "s2/bench_scaling.json").read_text())
    s2["scaling"].append({"adapters": 2000, "modules": "qkvo", "output_tok_s": 7000.0,
                          "alpha": 0.1, "decode_lora": "mbgmv"})
    s2["shared"] = [{"batch": 32, "modules": "none", "adapters": 0, "step_ms": 10.0,
                     "decode_lora": None},
                    {"batch": 32, "modules": "qkvo", "adapters": 4, "step_ms": 11.0,
                     "decode_lora": "auto"}]
    (path / "s2/bench_scaling.json").write_text(json.dumps(s2))
    got = {what: (fig, peer, name) for what, fig, peer, name in gpu_table.rows(gpu_table.load(str(path)))}
    assert got["S2 qkvo, 2000 adapters: tok/s"] == (6800.0, 8000.0, "no LoRA")
    assert got["S2 qkvo, 2000 adapters, alpha 0.1, mbgmv: tok/s"] == (7000.0, 8000.0, "no LoRA")
    assert got["decode batch 32, 4 adapters, auto: ms/step"] == (11.0, 10.0, "no LoRA")


def test_shared_run_adds_its_s2_rows_and_decode_table(gpu_table, tmp_path):
    """shared/bench_scaling.json (gpu.sh --bench shared): S2 on one adapter and at popularity
    alphas, each beside its own run's no-LoRA row, and the shared-adapter decode table; a row
    the s2 run also holds keeps the s2 run's figure."""
    path = write_run(tmp_path / "new")
    (path / "shared").mkdir()
    (path / "shared" / "bench_scaling.json").write_text(json.dumps({
        "scaling": [{"adapters": a, "modules": m, "output_tok_s": t, "alpha": al}
                    for a, m, t, al in ((0, "none", 7900.0, 1.0), (1, "qkvo", 7500.0, 1.0),
                                        (2000, "qkvo", 6700.0, 1.0),
                                        (2000, "qkvo", 7100.0, 0.1))],
        "shared": [{"batch": 128, "modules": "none", "adapters": 0, "step_ms": 10.0},
                   {"batch": 128, "modules": "qkvo", "adapters": 1, "step_ms": 10.5,
                    "decode_lora": "auto"}]}))
    got = {what: (fig, peer, name) for what, fig, peer, name in
           gpu_table.rows(gpu_table.load(str(path)))}
    assert got["S2 qkvo, 2000 adapters: tok/s"] == (6800.0, 8000.0, "no LoRA")  # the s2 run's
    assert got["S2 qkvo, 1 adapters: tok/s"] == (7500.0, 7900.0, "no LoRA")
    assert got["S2 qkvo, 2000 adapters, alpha 0.1: tok/s"] == (7100.0, 7900.0, "no LoRA")
    assert got["decode batch 128, 1 adapters, auto: ms/step"] == (10.5, 10.0, "no LoRA")


def test_vllm_rows_set_mbgmv_beside_vllms_kernels(gpu_table, tmp_path):
    """vllm/bench_kernels.json (gpu.sh --bench vllm): a row per (tokens, rank) that timed vLLM's
    kernels, MBGMV's us beside theirs; a row without them (no --vllm) gives none."""
    run = write_run(tmp_path / "vllm")
    (run / "vllm").mkdir()
    (run / "vllm" / "bench_kernels.json").write_text(json.dumps({"mbgmv": [
        {"T": 1, "rank": 64, "us_ours": 5.35, "us_vllm": 10.15},
        {"T": 16, "rank": 8, "us_ours": 6.0, "us_vllm": 12.0},
        {"T": 256, "rank": 8, "us_ours": 30.0}]}))
    got = {what: (fig, peer, name) for what, fig, peer, name in
           gpu_table.rows(gpu_table.load(str(run)))}
    assert got["LoRA layer, 1 tokens, rank 64: us"] == (5.35, 10.15, "vLLM")
    assert got["LoRA layer, 16 tokens, rank 8: us"] == (6.0, 12.0, "vLLM")
    assert not [w for w in got if "256 tokens" in w]
