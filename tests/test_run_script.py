"""./run's worker count for `./run test`: the cores this process may use, whatever the thread
settings that `run` itself exports (nproc obeys OMP_NUM_THREADS, which `run` sets to 1)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cores(env: dict[str, str]) -> int:
    """`cores` from ./run, run alone under `env`."""
    text = (ROOT / "run").read_text()
    body = text[text.index("cores() {"):]
    body = body[:body.index("\n}\n") + 3]
    out = subprocess.run(["bash", "-c", body + "cores"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], **env}, check=True)
    return int(out.stdout)


def test_cores_count_the_affinity_whatever_the_thread_settings():
    quota = Path("/sys/fs/cgroup/cpu.max")
    want = len(os.sched_getaffinity(0))
    if quota.is_file() and quota.read_text().split()[0] != "max":
        q, p = map(int, quota.read_text().split())
        want = min(want, -(-q // p))
    assert cores({}) == want
    assert cores({"OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"}) == want
