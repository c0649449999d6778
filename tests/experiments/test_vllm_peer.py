"""experiments/vllm_peer.py: unpacking a vLLM wheel's LoRA ops beside the stand-ins, and loading
them. The wheel here is a stand-in of the same layout (no network in tests); its op modules
import what vLLM's import, so the stand-ins must answer every one of those imports."""

import sys
import zipfile

import pytest

# what vLLM's LoRA op modules import from vLLM, one line each, then the names they define
OPS = {
    "kernel_utils.py": "from vllm.triton_utils import tl, triton\n",
    "lora_kernel_metadata.py": "class LoRAKernelMeta:\n    pass\n",
    "utils.py": ("from vllm import envs\nfrom vllm.logger import init_logger\n"
                 "from vllm.platforms import current_platform\n"
                 "from vllm.utils.math_utils import next_power_of_2\n"
                 "from vllm.utils.torch_utils import async_tensor_h2d\n"
                 "logger = init_logger(__name__)\nis_batch_invariant = envs.VLLM_BATCH_INVARIANT\n"
                 "def get_config():\n    logger.warning_once('default configs')\n"
                 "    return next_power_of_2(48), current_platform.is_cuda()\n"),
    "lora_shrink_op.py": ("from vllm.lora.ops.triton_ops.utils import get_config\n"
                          "from vllm.utils.torch_utils import direct_register_custom_op\n"
                          "def lora_shrink():\n    return get_config()\n"),
    "lora_expand_op.py": "def lora_expand():\n    return 'expand'\n",
}


@pytest.fixture
def peer(experiment):
    module = experiment("vllm_peer")
    path = list(sys.path)
    yield module
    sys.path[:] = path
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_fetch_then_load(peer, tmp_path):
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in OPS.items():
            z.writestr(peer.OPS + name, text)
        z.writestr("vllm/_C.abi3.so", b"\0")  # compiled extensions stay behind
    dest = peer.fetch("9.9.9", tmp_path / "peer", wheel)
    assert not (dest / "vllm/_C.abi3.so").exists()
    ops, version = peer.load(dest)
    assert version == "9.9.9"
    assert ops.lora_shrink() == (64, ops.lora_shrink.__globals__["get_config"]()[1])
    assert ops.lora_expand() == "expand" and ops.LoRAKernelMeta.__name__ == "LoRAKernelMeta"


def test_the_wheel_names_the_version(peer, tmp_path):
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in OPS.items():
            z.writestr(peer.OPS + name, text)
    assert peer.load(peer.fetch(None, tmp_path / "peer", wheel))[1] == "9.9.9"
    with pytest.raises(SystemExit, match="is vLLM 9.9.9, not --version 1.0.0"):
        peer.fetch("1.0.0", tmp_path / "other", wheel)
    with pytest.raises(SystemExit, match="not a vLLM wheel's name"):
        peer.fetch(None, tmp_path / "other", tmp_path / "torch-2.0-py3-none-any.whl")


def test_load_names_the_fetch_command(peer, tmp_path):
    with pytest.raises(SystemExit, match="experiments/vllm_peer.py --dest"):
        peer.load(tmp_path)
