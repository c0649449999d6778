"""experiments/bench_fp8.py on the CPU (the Triton interpreter): one call times the FP8 few-rows
kernel's word-unpacking path and the converting path it replaces, each at its own tiles, and
every few-rows variant it times computes the twin's product."""

import pytest
import torch

from slora.model import quant


def test_one_call_times_unpacked_and_converted_fp8_kernels(experiment):
    bench = experiment("bench_fp8")
    cpu = torch.device("cpu")
    tiles = dict(bench.few_rows_tiles(3, 48, 256, cpu))
    assert tiles["fp8 unpacked"]["UNPACK"] and not tiles["fp8 converted"]["UNPACK"]
    # past 64 rows the W8A8 kernel alone (a 16-bit x's tiles do not fit), past 128 none
    assert [p for p, _ in bench.few_rows_tiles(65, 48, 256, cpu)] == ["fp8 W8A8",
                                                                     "fp8 W8A8, x rounded"]
    assert bench.few_rows_tiles(129, 48, 256, cpu) == []
    swept = bench.few_rows_tiles(3, 48, 256, cpu, sweep=True)
    grid = [c for p, c in swept if p.startswith("fp8 unpacked N")]
    assert len(grid) > 10 and all(c["UNPACK"] for c in grid)
    assert all(a != b for i, a in enumerate(grid) for b in grid[i + 1:])  # each launch once
    assert not tiles["fp8 W8A8"]["UNPACK"]
    w8a8 = [c for p, c in swept if p.startswith("fp8 W8A8 N")]
    assert len(w8a8) == len(grid) and not any(c["UNPACK"] for c in w8a8)

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) / 16
    q = quant.quantize_fp8(w)
    x = torch.randn(3, 256, generator=g)
    want = quant.linear(x, q)
    paths = dict(bench.variants(3, 48, 256, cpu))
    for path in ("fp8 unpacked", "fp8 converted"):
        torch.testing.assert_close(paths[path](x, w, q), want, rtol=1e-4, atol=1e-4)
    # the GEMM over x rounded once is the W8A8 path's product, call after call
    rounded = paths["fp8 W8A8, x rounded"]
    assert torch.equal(rounded(x, w, q), paths["fp8 W8A8"](x, w, q))
    assert torch.equal(rounded(x, w, q), paths["fp8 W8A8"](x, w, q))


def test_summary_sets_unpacked_beside_converted(experiment):
    bench = experiment("bench_fp8")
    rows = [dict(module="o", M=32, path=p, us=us, weight_GBps=gbps) for p, us, gbps in
            (("bf16", 14.0, 2400.0), ("fp8 unpacked", 8.0, 2100.0), ("fp8 converted", 20.0, 840.0),
             ("fp8 unpacked N128 K256 s3 x1", 7.5, 2240.0))]
    line = bench.summary(rows, 4200.0).splitlines()[1]
    assert line.split()[:2] == ["o", "32"]
    assert "( 50%)" in line and "2.50" in line and "N128 K256 s3 x1 7.5 us" in line
