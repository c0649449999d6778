"""slora/core (and the request/config modules it uses) import no torch, so the simulator can
drive the scheduler without it."""

import subprocess
import sys


def test_core_imports_no_torch():
    code = ("import sys\n"
            "import slora.core.scheduler, slora.core.pages, slora.core.adapters, slora.core.policies\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
