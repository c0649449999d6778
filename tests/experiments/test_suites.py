"""Experiment suites: every shipped suite file loads and expands; the driver runs a suite end to
end on a tiny model, writes one result per point and the figure, and resumes."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITES = sorted((ROOT / "experiments" / "suites").glob("*.json"))


@pytest.fixture(scope="module")
def run_suite(experiment):
    return experiment("run_suite")


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_suite_loads_and_expands(run_suite, path):
    suite = run_suite.load_suite(path)
    assert suite.name == path.stem and suite.description
    points = run_suite.expand(suite)
    assert len({p.name for p in points}) == len(points) > 0
    small = {**points[0].workload, "duration": 2}  # the real durations take seconds to draw
    trace = run_suite.make_trace(small, model=None)
    assert len(trace) >= 1


def test_table_suites_carry_the_papers_settings(run_suite):
    s1 = run_suite.load_suite(ROOT / "experiments/suites/table3-s1.json")
    s2 = run_suite.load_suite(ROOT / "experiments/suites/table3-s2.json")
    assert s1.workload["ranks"] == [8] and s2.workload["ranks"] == [64, 32, 16, 8]
    for s in (s1, s2):
        assert s.sweep["num_adapters"] == [5, 100, 1000, 2000] and s.workload["rate"] == 10
        assert s.model_shape == "llama-2-7b" and s.engine["load_format"] == "dummy"
    assert s1.reference["throughput_req_s"]["5"] == 8.05


def test_policy_points_share_one_trace(run_suite):
    suite = run_suite.load_suite(ROOT / "experiments/suites/policies.json")
    points = [p for p in run_suite.expand(suite) if p.workload["cv"] == 2]
    assert {p.engine["policy"] for p in points} == {"fcfs", "cluster", "abort", "fair"}
    assert {p.trace_name for p in points} == {"cv=2"}


def test_overrides_and_errors(run_suite, tmp_path):
    suite = run_suite.load_suite(ROOT / "experiments/suites/cv.json")
    changed = run_suite.apply_overrides(suite, ["duration=30", "cv=[1,3]", "policy=fair"])
    assert changed.workload["duration"] == 30 and changed.sweep["cv"] == [1, 3]
    assert changed.engine["policy"] == "fair" and suite.sweep["cv"] == [1, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="--set 'colour=red'"):
        run_suite.apply_overrides(suite, ["colour=red"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads((ROOT / "experiments/suites/cv.json").read_text()),
                               "workload": {"rate": 1, "speed": 2}}))
    with pytest.raises(ValueError, match=r"unknown workload key\(s\) \['speed'\]"):
        run_suite.load_suite(bad)


def test_runs_cpu_smoke_suite_on_tiny_model(run_suite, tiny_model_dir, tmp_path, capsys):
    argv = [str(ROOT / "experiments/suites/cpu-smoke.json"), "--model", str(tiny_model_dir),
            "--results", str(tmp_path), "--set", "duration=1.5", "--set", "num_pages=64", "--quiet"]
    assert run_suite.main(argv) == 0
    out_dir = tmp_path / "cpu-smoke"
    results = [json.loads((out_dir / f"num_adapters={n}.json").read_text()) for n in (2, 4)]
    for r in results:
        assert r["num_completed"] == r["num_requests"] == 3
        assert r["config"]["suite"] == "cpu-smoke" and r["config"]["engine"]["num_pages"] == 64
    assert (out_dir / "cpu-smoke.png").stat().st_size > 1000
    mtime = (out_dir / "num_adapters=2.json").stat().st_mtime
    assert run_suite.main(argv) == 0  # resumes: nothing to redo
    assert (out_dir / "num_adapters=2.json").stat().st_mtime == mtime
    assert "done" in capsys.readouterr().out
