"""csrc/ CUDA sources compile for Hopper (sm_90) without register spills, where nvcc exists.
(Numerics are checked against the twins on a GPU: tests/kernels/test_lora.py, impl 'cuda'.)"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_compiles_for_sm90_without_spills(source, tmp_path):
    res = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", "-Xptxas", "-v",
                          str(CSRC / source), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    spilled = [int(n) for n in re.findall(r"(\d+) bytes spill", res.stderr)]
    assert spilled and not any(spilled), res.stderr
