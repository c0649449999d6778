"""Session 9, call 7: the batch-32 decode step under a few tile rules of the few-rows GEMM
(slora.kernels.gemm.skinny_cfg replaced for the run), one engine, one table per rule.

    python3 notes/h200-2026-11-30-s9/call7/gemm_rules.py   (from the repo root, on a GPU)
"""
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "experiments")
import bench_scaling  # noqa: E402
from slora.kernels import gemm  # noqa: E402

shipped = gemm.skinny_cfg


def rule(**over):
    def cfg(M, N, K, device):
        c = shipped(M, N, K, device)
        for key, val in over.items():
            c[key] = val(c, N, K) if callable(val) else val
        return c
    return cfg


RULES = {
    "shipped": shipped,
    "stages 4": rule(num_stages=4),
    "K 256 when split": rule(BLOCK_K=lambda c, N, K: 256 if c["SPLIT"] > 1 else 128),
    "q/k/v and gate/up N128 w8 s4": rule(
        BLOCK_N=lambda c, N, K: 128 if c["SPLIT"] == 1 else 64,
        num_warps=lambda c, N, K: 8 if c["SPLIT"] == 1 else 4,
        num_stages=lambda c, N, K: 4),
    "split x2": rule(SPLIT=lambda c, N, K: c["SPLIT"] * 2 if c["SPLIT"] > 1 else 1),
}
for name, fn in RULES.items():
    gemm.skinny_cfg = fn
    print(f"== rule: {name}", flush=True)
    bench_scaling.main(["--part", "decode", "--batches", "16,32", "--breakdown", "",
                        "--num-pages", "4000", "--out", f"/tmp/rules/{name.replace(' ', '_').replace('/', '')}"])
