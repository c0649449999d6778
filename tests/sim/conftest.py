"""Fixtures of the simulator's tests: one torch thread, and a CPU profile of the tiny model
(measured once per test run: the profile tests, the CLI tests and the same-decisions tests share
it)."""

from __future__ import annotations

import time

import pytest

from slora.sim import Profile


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engines here run tiny steps, which one intra-op thread computes fastest: more
    threads only wait on each other, and far longer when other processes share the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def cpu_profile(tiny_model_dir, tmp_path_factory):
    """A profile of the tiny model on CPU (CPU_GRID), measured on the first use."""
    from slora.sim.profile import run_profile

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    t = time.perf_counter()
    run_profile(str(tiny_model_dir), path, engine_options=dict(device="cpu", dtype="float32"),
                log=lambda _: None)
    profile = Profile.load(path)
    print(f"\nCPU profile of the tiny model: {time.perf_counter() - t:.1f} s, "
          f"{profile.fit_stats['samples']} steps, mean relative error "
          f"{profile.fit_stats['mean_rel_err']:.0%}")
    return profile
