"""vLLM's Triton LoRA kernels as a peer for `bench_kernels.py`: never a dependency of slora.

    python experiments/vllm_peer.py [--version 0.33.0 | --wheel vllm-VERSION-TAGS.whl] [--dest results/peer]

fetches vLLM's wheel (`pip download --no-deps`, on a machine that reaches PyPI), unpacks its
LoRA Triton ops (`vllm/lora/ops/triton_ops`: the shrink, the expand and their metadata) and
writes stand-ins for the few vLLM modules they import (`envs`, `logger`, `platforms`, `utils`,
`triton_utils`), so that they import beside slora without vLLM's engine or its compiled
extensions. `dest` is a folder to put on sys.path; carry it to the GPU machine and run
`bench_kernels.py --only mbgmv --vllm results/peer` to time them beside MBGMV on the same
adapters (copied into vLLM's layout before any timing), in the same CUDA-graph method.

The stand-ins answer as vLLM does on one CUDA GPU with its environment unset: no batch
invariance, no tuned-config folder, PDL on sm_90 and newer, no dual stream; the kernels take
their built-in default tiles.
"""

from __future__ import annotations

import argparse
import glob
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OPS = "vllm/lora/ops/triton_ops/"
FILES = ("kernel_utils.py", "lora_shrink_op.py", "lora_expand_op.py", "lora_kernel_metadata.py",
         "utils.py")

STANDINS = {
    "vllm/__init__.py": "",
    "vllm/envs.py": '''\
def __getattr__(name):  # every VLLM_* setting unset: False / None
    if name.startswith("VLLM_"):
        return None
    raise AttributeError(name)
''',
    "vllm/logger.py": '''\
import logging


class _Logger(logging.LoggerAdapter):
    def _once(self, level, msg, *args):
        if (level, msg) not in _SEEN:
            _SEEN.add((level, msg))
            self.log(level, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args)


_SEEN = set()


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
''',
    "vllm/platforms/__init__.py": '''\
import torch


class _CudaPlatform:
    def is_cuda(self):
        return torch.cuda.is_available()

    def _capability(self):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def has_device_capability(self, capability):
        return self.is_cuda() and self._capability() >= capability

    def is_device_capability(self, capability):
        return self.is_cuda() and self._capability() == capability


current_platform = _CudaPlatform()
''',
    "vllm/triton_utils/__init__.py": '''\
import triton
import triton.language as tl
''',
    "vllm/utils/__init__.py": "",
    "vllm/utils/math_utils.py": '''\
def next_power_of_2(n):
    return 1 << max(0, int(n) - 1).bit_length()
''',
    "vllm/utils/torch_utils.py": '''\
import torch


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    return torch.as_tensor(data, dtype=dtype).to(device)


def direct_register_custom_op(*args, **kwargs):
    """Registers nothing: the op modules then call their Python functions directly."""
''',
    "vllm/lora/__init__.py": "",
    "vllm/lora/ops/__init__.py": "",
    OPS + "__init__.py": '''\
from .lora_expand_op import lora_expand
from .lora_kernel_metadata import LoRAKernelMeta
from .lora_shrink_op import lora_shrink
''',
}


def wheel_version(wheel: Path) -> str:
    """The version in a vLLM wheel's file name (`vllm-VERSION-TAGS.whl`)."""
    parts = Path(wheel).name.split("-")
    if len(parts) < 3 or parts[0] != "vllm" or not parts[-1].endswith(".whl"):
        raise SystemExit(f"{wheel}: not a vLLM wheel's name (expected vllm-VERSION-TAGS.whl)")
    return parts[1]


DEFAULT_VERSION = "0.33.0"  # the version fetched when neither --version nor --wheel names one


def fetch(version: str | None, dest: Path, wheel: Path | None = None) -> Path:
    """Unpack vLLM `version`'s LoRA Triton ops (from `wheel`, else a downloaded one) and the
    stand-ins into `dest`; returns dest. With a wheel, `version` None is the wheel's; another
    version than the wheel's is an error."""
    if wheel is not None:
        found = wheel_version(wheel)
        if version is not None and version != found:
            raise SystemExit(f"{wheel} is vLLM {found}, not --version {version}: drop --version "
                             "or pass that version's wheel")
        version = found
    version = version or DEFAULT_VERSION
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            tmp, f"vllm=={version}"], check=True)
            found = glob.glob(f"{tmp}/vllm-{version}-*.whl")
            if not found:
                raise SystemExit(f"pip download gave no vllm wheel for version {version}")
            wheel = Path(found[0])
        with zipfile.ZipFile(wheel) as z:
            for name in FILES:
                target = dest / OPS / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(OPS + name))
    for name, text in STANDINS.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    (dest / "VERSION").write_text(version + "\n", encoding="utf-8")
    return dest


def load(dest: str | Path):
    """vLLM's `triton_ops` module from a folder `fetch` wrote, and its version."""
    dest = Path(dest).resolve()
    if not (dest / OPS / "lora_shrink_op.py").is_file():
        raise SystemExit(f"{dest} holds no vLLM LoRA ops: run `python experiments/vllm_peer.py "
                         f"--dest {dest}` on a machine that reaches PyPI")
    sys.path.insert(0, str(dest))
    import importlib

    return (importlib.import_module("vllm.lora.ops.triton_ops"),
            (dest / "VERSION").read_text(encoding="utf-8").strip())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", help=f"vLLM's version (default: the wheel's, else "
                    f"{DEFAULT_VERSION})")
    ap.add_argument("--wheel", type=Path, help="a vLLM wheel already downloaded")
    ap.add_argument("--dest", type=Path, default=Path("results/peer"),
                    help="the folder to write (default: results/peer, git-ignored)")
    args = ap.parse_args(argv)
    dest = fetch(args.version, args.dest, args.wheel)
    ops, version = load(dest)
    print(f"vLLM {version}'s LoRA Triton ops in {dest}: "
          f"{', '.join(n for n in ('lora_shrink', 'lora_expand', 'LoRAKernelMeta') if hasattr(ops, n))}")


if __name__ == "__main__":
    main()
