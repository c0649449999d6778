"""Every unsupported or malformed adapter is rejected at add_adapter with a message naming the
adapter, the file and the reason; the same engine then serves valid requests correctly."""

import json
import shutil

import pytest

from slora import Engine, EngineConfig, SamplingParams
from slora.model.loader import AdapterError


@pytest.fixture(scope="module")
def good(tiny_model_dir, adapter_factory):
    return adapter_factory(tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"])


def _variant(good, tmp_path, name, edit_config=None, edit_files=None):
    d = tmp_path / name
    shutil.copytree(good, d)
    if edit_config:
        conf = json.loads((d / "adapter_config.json").read_text())
        edit_config(conf)
        (d / "adapter_config.json").write_text(json.dumps(conf))
    if edit_files:
        edit_files(d)
    return d


def _truncate(d):
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _rename_tensor(d, old, new):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    key = next(k for k in t if old in k)
    t[key.replace(old, new)] = t.pop(key)
    save_file(t, d / "adapter_model.safetensors")


def _reshape_tensor(d):
    import torch
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    key = next(k for k in t if "lora_A" in k)
    t[key] = torch.zeros(4, 7)
    save_file(t, d / "adapter_model.safetensors")


def _drop_b(d):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    t.pop(next(k for k in t if "lora_B" in k))
    save_file(t, d / "adapter_model.safetensors")


BAD = {
    "dora": (dict(config=lambda c: c.update(use_dora=True)), "use_dora"),
    "modules_to_save": (dict(config=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "bias": (dict(config=lambda c: c.update(bias="all")), "bias"),
    "embedding_target": (dict(config=lambda c: c.update(target_modules=["embed_tokens"])), "embed_tokens"),
    "rank0": (dict(config=lambda c: c.update(r=0)), "rank"),
    "not_json": (dict(files=lambda d: (d / "adapter_config.json").write_text("{oops")), "JSON"),
    "no_config": (dict(files=lambda d: (d / "adapter_config.json").unlink()), "adapter_config.json"),
    "no_weights": (dict(files=lambda d: (d / "adapter_model.safetensors").unlink()), "adapter_model"),
    "truncated": (dict(files=_truncate), "bytes"),
    "wrong_shape": (dict(files=_reshape_tensor), "do not fit"),
    "missing_B": (dict(files=_drop_b), "lora_B missing"),
    "lm_head_weight": (dict(files=lambda d: _rename_tensor(d, "self_attn.q_proj", "lm_head")), "lm_head"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_rejected_then_engine_serves(tiny_model_dir, good, tmp_path, case):
    edits, reason = BAD[case]
    bad = _variant(good, tmp_path, case, edits.get("config"), edits.get("files"))
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    with pytest.raises(AdapterError) as err:
        engine.add_adapter("broken", bad)
    msg = str(err.value)
    assert "'broken'" in msg and reason in msg and str(bad) in msg
    assert "broken" not in engine.list_adapters()
    engine.add_adapter("good", good)
    outs = engine.generate(["Hello", "Hello"], SamplingParams(max_tokens=4, ignore_eos=True),
                           adapters=["good", None])
    assert all(len(o.token_ids) == 4 for o in outs)


def test_bin_weights_load_like_safetensors(tiny_model_dir, good, tmp_path):
    import torch
    from safetensors.torch import load_file

    d = _variant(good, tmp_path, "bin")
    torch.save(load_file(d / "adapter_model.safetensors"), d / "adapter_model.bin")
    (d / "adapter_model.safetensors").unlink()
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    engine.add_adapter("st", good)
    engine.add_adapter("bin", d)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = engine.generate(["Hello", "Hello"], sp, adapters=["st", "bin"])
    assert a.token_ids == b.token_ids


def test_remove_adapter(tiny_model_dir, good):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    engine.add_adapter("a", good)
    engine.generate("Hello", SamplingParams(max_tokens=2), adapters="a")
    assert engine.stats()["pages_adapter"] > 0
    engine.remove_adapter("a")
    assert engine.stats()["pages_adapter"] == 0
    with pytest.raises(KeyError, match="unknown adapter"):
        engine.add_request("Hello", adapter="a")
