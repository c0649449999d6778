"""Packaging beside pyproject.toml: the one thing pyproject's package discovery cannot say.

The CUDA C++ sources stay at the repository's top level (csrc/) and ship inside the package
as `slora._csrc`, where `slora.kernels.cuda` finds them through importlib.resources; every
other package is discovered as pyproject.toml would (slora and its subpackages).
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["slora", "slora.*"]) + ["slora._csrc"],
      package_dir={"slora._csrc": "csrc"})
