"""experiments/*.py are scripts, not a package: the `experiment` fixture loads one by name."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="session")
def experiment():
    """experiment("bench_scaling") -> the module experiments/bench_scaling.py, loaded once."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load
