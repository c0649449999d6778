"""examples/quickstart.py runs as written and prints what it promises: one batch of the
embedded SmolLM2 with the shipped pirate adapter beside the base model, then the engine's
counters. It needs the embedded model (the demo extra), as tests/model/test_smollm.py does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from slora.model import smollm  # noqa: E402

try:
    smollm.find_gguf()
except RuntimeError as e:
    pytest.skip(str(e), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path):
    # HOME in tmp_path: the script converts the model into its own ~/.cache/slora
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    *conversion, pirate, base, stats = done.stdout.splitlines()
    assert len(conversion) == 2 and "converting" in conversion[0]  # the fresh cache's, once
    lines = [pirate, base, stats]
    assert lines[0].startswith("pirate: 'Arr") or lines[0].startswith('pirate: "Arr')
    assert "Paris" in lines[0] and lines[1].startswith("base: ") and "Paris" in lines[1]
    assert "'adapter_loads': 1" in lines[2] and "'pages_total'" in lines[2]
    assert (tmp_path / ".cache" / "slora" / smollm.MODEL_NAME).is_dir()
