"""bench_scaling.py with PDL on or off and the few-rows GEMM's L2 prefetch set (session 11).

    python notes/h200-2026-11-30-s11/pdl_sweep.py on|off PREFETCH_K [bench_scaling args]
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]

from slora.kernels import gemm, pdl  # noqa: E402

import bench_scaling  # noqa: E402

pdl.ENABLED = sys.argv[1] == "on"
gemm.PREFETCH_K = int(sys.argv[2])
print(f"== PDL {sys.argv[1]}, prefetch {gemm.PREFETCH_K} columns", flush=True)
bench_scaling.main(sys.argv[3:])
