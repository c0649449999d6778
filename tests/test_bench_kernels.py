"""experiments/bench_kernels.py --smoke on CPU (the interpreter): the mixed-step comparison's two
ways of running a mixed step (decode rows through the prefill kernels, or through the decode
kernels) agree with the reference. Rates under the interpreter mean nothing; errors do."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mixed_step_comparison_smoke(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--smoke",
                    "--only-mixed", "--out", str(tmp_path)], check=True, capture_output=True)
    rows = json.loads((tmp_path / "bench_kernels_mixed.json").read_text())["mixed"]
    assert [r["n_dec"] for r in rows] == [3]
    for r in rows:
        for how in ("one", "split"):
            assert r[f"err_attn_{how}"] < 1e-4 and r[f"err_lora_{how}"] < 1e-4
            assert r[f"us_attn_{how}"] > 0 and r[f"us_lora_{how}"] > 0
