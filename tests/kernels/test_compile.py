"""Every Triton kernel compiles for the H200 (sm_90) in the variants the engine launches
there (experiments/compile_check.py, the wheel's ptxas, no GPU needed): lowering errors the
interpreter, which runs the kernels as numpy, cannot see. Runs in a subprocess without
TRITON_INTERPRET, which this suite sets."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))


def test_every_kernel_compiles_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, not a cached binary
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "compile_check.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    compiled = [l for l in res.stdout.splitlines() if l.endswith("  ok")]
    assert "FAILED" not in res.stdout
    # every variant of the 17 kernels (`compile_check.variants`), those of a decode or mixed
    # step's kernels also with PDL (every kernel but prefill attention)
    assert len(compiled) == 93, res.stdout
    assert sum(", PDL " in l for l in compiled) == 45, res.stdout


def test_pdl_order_flags_what_the_kernel_before_may_still_touch():
    """compile_check.pdl_order, on PTX shapes: metadata loads may precede the wait; a store,
    an atomic, an async copy or a return before it, or no wait or launch at all, may not."""
    from compile_check import pdl_order

    wait, launch = "griddepcontrol.wait; // dummy %r1", "griddepcontrol.launch_dependents;"
    load, store = "ld.global.b32 %r2, [%rd1];", "st.global.b32 [%rd2], %r2;"
    ok = "\n".join([load, wait, store, launch, "ret;"])
    assert pdl_order(ok) == ""
    assert "no griddepcontrol.wait" in pdl_order("\n".join([load, store, launch]))
    assert "launch_dependents" in pdl_order("\n".join([wait, store]))
    assert "st.global" in pdl_order("\n".join([store, wait, launch]))
    # a PREFETCH variant asks L2 for its lines before the wait
    hint = "prefetch.global.L2 [%rd3];"
    assert pdl_order("\n".join([hint, load, wait, store, launch]), prefetch=True) == ""
    assert "no prefetch" in pdl_order("\n".join([load, wait, hint, store, launch]), prefetch=True)
    assert "atom." in pdl_order("\n".join(["atom.global.add.u32 %r3, [%rd3], 1;", wait, launch]))
    assert "cp.async" in pdl_order("\n".join(["cp.async.ca.shared.global [%r4], [%rd4], 16;",
                                             wait, launch]))
    assert "ret" in pdl_order("\n".join(["@%p1 bra $L1;", "ret;", "$L1:", wait, launch]))
    assert "ret" in pdl_order("\n".join(["@%p1 ret;", wait, launch]))


def test_lora_kernels_read_adapter_tiles_in_16_byte_accesses(tmp_path):
    """No MBGMV, MBGMM or DoRA rescale variant loads a bf16 tile element by element
    (`ld.global.b16`): the adapter rows are 64-element aligned chunks, and the kernels tell the
    compiler so. The FP8
    few-rows GEMM's word path copies W in 16-byte pieces."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "compile_check.py"),
                          "--loads"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lora_rows = [l for l in res.stdout.splitlines() if l.startswith(("mbgmv", "mbgmm", "dora"))]
    assert len(lora_rows) == 18, res.stdout
    assert not [l for l in lora_rows if "ld.global.b16" in l], "\n".join(lora_rows)
    # the FP8 GEMM reading words copies its W tiles in 16-byte cp.async.cg alone (the float8
    # tiles it replaces go in 8-byte cp.async.ca)
    fp8 = [l for l in res.stdout.splitlines() if l.startswith("fp8 gemm")]
    assert len(fp8) == 6, res.stdout
    assert all(("cp.async.ca" in l) == ("converted" in l) for l in fp8), "\n".join(fp8)
