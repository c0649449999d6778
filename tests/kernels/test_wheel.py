"""slora installs from a wheel with its kernel sources: `pip wheel .` (offline, setuptools from
this environment), the wheel installed in a fresh venv, and slora imported there reads
csrc/mbgmv.cu (the cupy backend's source) and the GPU tile tables from the installed package,
not from this checkout.

The fresh venv sees this environment's packages (torch, numpy, ...) through a .pth line that
appends their directory to sys.path; .pth files in that directory (the checkout's editable
install) are not processed, so `slora` resolves to the wheel's copy."""

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.resources, pathlib, slora, slora.kernels.cuda as cuda
print(pathlib.Path(slora.__file__).resolve())
print(pathlib.Path(str(cuda.SOURCE)).resolve())
print((importlib.resources.files("slora.kernels") / "configs" / "h200.json").is_file())
pathlib.Path("source.cu").write_text(cuda.SOURCE.read_text(encoding="utf-8"))
"""


def _source_tree(dst: Path) -> Path:
    """The files a wheel is built from, copied (the build writes build/ and *.egg-info)."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("slora", "csrc"):
        shutil.copytree(ROOT / name, dst / name, ignore=skip)
    return dst


def test_wheel_ships_the_kernel_sources(tmp_path):
    (tmp_path / "src").mkdir()
    src = _source_tree(tmp_path / "src")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "--no-index", "-q", "-w", str(dist)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = dist.glob("slora-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "slora/_csrc/mbgmv.cu" in names and "slora/kernels/configs/h200.json" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, timeout=120)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True)
    installed = Path(purelib.stdout.strip())
    (installed / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    run = tmp_path / "run"
    run.mkdir()
    res = subprocess.run([str(python), "-c", PROBE], cwd=run, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    package, source, table = res.stdout.split()
    assert Path(package).is_relative_to(installed.resolve()), package
    assert Path(source) == installed.resolve() / "slora" / "_csrc" / "mbgmv.cu"
    assert table == "True"
    assert (run / "source.cu").read_text() == (ROOT / "csrc" / "mbgmv.cu").read_text()
