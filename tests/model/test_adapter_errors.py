"""Every unsupported or malformed adapter raises AdapterError naming the adapter, the file and
the reason: at add_adapter, or when its weights are first read (`PeftAdapter.pack`, on a
host-tier miss), which checks them again (finite, the file unchanged or of the same layout,
read whole). The same engine then serves valid requests correctly."""

import json
import math
import os
import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ModelConfig
from slora.model.loader import AdapterError, PeftAdapter


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


def _add_embedding_lora(d):
    """An embed_tokens LoRA whose A has 7 columns, not the vocabulary's."""
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    p = "base_model.model.model.embed_tokens.lora_embedding_"
    t.update({p + "A": torch.zeros(4, 7), p + "B": torch.zeros(64, 4)})
    save_file(t, d / "adapter_model.safetensors")


def _bin_not_pickle(d):
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"not a pickle")


BAD = {
    "dora": (dict(config=lambda c: c.update(use_dora=True)), "use_dora"),
    "modules_to_save": (dict(config=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "bias": (dict(config=lambda c: c.update(bias="all")), "bias"),
    "embedding_shape": (dict(files=_add_embedding_lora), "embed_tokens"),
    "rank0": (dict(config=lambda c: c.update(r=0)), "rank"),
    "not_json": (dict(files=lambda d: (d / "adapter_config.json").write_text("{oops")), "JSON"),
    "no_config": (dict(files=lambda d: (d / "adapter_config.json").unlink()), "adapter_config.json"),
    "no_weights": (dict(files=lambda d: (d / "adapter_model.safetensors").unlink()), "adapter_model"),
    "truncated": (dict(files=_truncate), "bytes"),
    "wrong_shape": (dict(files=_reshape_tensor), "do not fit"),
    "missing_B": (dict(files=_drop_b), "lora_B missing"),
    "lm_head_weight": (dict(files=lambda d: _rename_tensor(d, "self_attn.q_proj", "lm_head")), "lm_head"),
    "alpha_nan": (dict(config=lambda c: c.update(lora_alpha=float("nan"))), "lora_alpha"),
    "alpha_negative": (dict(config=lambda c: c.update(lora_alpha=-16)), "lora_alpha"),
    "alpha_pattern_zero": (dict(config=lambda c: c.update(alpha_pattern={"q_proj": 0})),
                           "alpha_pattern"),
    "config_not_object": (dict(files=lambda d: (d / "adapter_config.json").write_text("[4]")),
                          "not an object"),
    "bin_not_pickle": (dict(files=_bin_not_pickle), "torch.load"),
    # initialisations that change the base weights: the adapter fits that changed base
    "pissa": (dict(config=lambda c: c.update(init_lora_weights="pissa_niter_16")),
              "init_lora_weights='pissa_niter_16': this initialisation changes the base"),
    "olora": (dict(config=lambda c: c.update(init_lora_weights="olora")),
              "path_initial_model_for_weight_conversion"),
    "loftq": (dict(config=lambda c: c.update(init_lora_weights="loftq")),
              "serve the base model LoftQ saved"),
}


def _serves_as(tiny_model_dir, good, other) -> None:
    """Adapter directory `other` gives `good`'s tokens."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    engine.add_adapter("good", good)
    engine.add_adapter("other", other)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = engine.generate(["Hello", "Hello"], sp, adapters=["good", "other"])
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_initialisations_that_keep_the_base_serve(tiny_model_dir, good, tmp_path, init):
    """An adapter whose initialisation left the base weights as they are (or one converted
    to a standard LoRA adapter, whose config says true) serves as its tensors say."""
    _serves_as(tiny_model_dir, good,
               _variant(good, tmp_path, "init", lambda c: c.update(init_lora_weights=init)))


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
    _serves_as(tiny_model_dir, good, d)


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


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


def _expect_adapter_error(name, path, cfg, page_size=256):
    """Registration and a first read either succeed (finite weights) or raise AdapterError
    naming the adapter; any other exception fails the test."""
    try:
        peft = PeftAdapter(name, path, cfg)
    except AdapterError as e:
        assert e.adapter == name and repr(name) in str(e)
        return "refused"
    assert all(math.isfinite(s) and s > 0 for s in peft.scaling.values())
    try:
        flat = peft.pack(page_size, torch.float32)
    except AdapterError as e:
        assert e.adapter == name and repr(name) in str(e) and str(peft.weights_file) in str(e)
        return "failed at first read"
    assert flat.shape == (cfg.num_layers, peft.layout.num_pages(page_size) * page_size)
    assert bool(torch.isfinite(flat).all())
    return "served"


# --- config fields: wrong types, non-finite and non-positive values

def test_refused_configs(peft_files, cfg, tmp_path):
    """Each config is refused at registration with the field it gets wrong in the message."""
    good = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    cases = {
        "r='4'": (dict(r="4"), "rank r"), "r=True": (dict(r=True), "rank r"),
        "r=4.0": (dict(r=4.0), "rank r"), "r=None": (dict(r=None), "rank r"),
        "alpha=NaN": (dict(lora_alpha=float("nan")), "lora_alpha"),
        "alpha=inf": (dict(lora_alpha=float("inf")), "lora_alpha"),
        "alpha=-inf": (dict(lora_alpha=float("-inf")), "lora_alpha"),
        "alpha=-8": (dict(lora_alpha=-8), "lora_alpha"),
        "alpha=0": (dict(lora_alpha=0), "lora_alpha"),
        "alpha='8'": (dict(lora_alpha="8"), "lora_alpha"),
        "alpha=[8]": (dict(lora_alpha=[8]), "lora_alpha"),
        "alpha=10**400": (dict(lora_alpha=10 ** 400), "lora_alpha"),
        "alpha=5e-324": (dict(lora_alpha=5e-324), "scaling"),  # alpha / r underflows to 0
        "alpha_pattern<0": (dict(alpha_pattern={"q_proj": -1}), "alpha_pattern"),
        "alpha_pattern NaN": (dict(alpha_pattern={"v_proj": float("nan")}), "alpha_pattern"),
        "alpha_pattern list": (dict(alpha_pattern=[1, 2]), "alpha_pattern"),
        "rank_pattern list": (dict(rank_pattern=["q_proj"]), "rank_pattern"),
        "rank_pattern str": (dict(rank_pattern={"q_proj": "4"}), "rank_pattern"),
        "rank_pattern regex": (dict(rank_pattern={"q_proj(": 4}), "regular expression"),
        "target_modules int": (dict(target_modules=7), "target_modules"),
        "target_modules [int]": (dict(target_modules=[1, 2]), "target_modules"),
        "target_modules []": (dict(target_modules=[]), "target_modules"),
        "target_modules dict": (dict(target_modules={"q_proj": 1}), "target_modules"),
        "use_rslora str": (dict(use_rslora="false"), "use_rslora"),
        "use_dora 1": (dict(use_dora=1), "use_dora"),
        "peft_type list": (dict(peft_type=["LORA"]), "peft_type"),
    }
    tensors = peft_files.tensors(cfg)
    for case, (edit, reason) in cases.items():
        d = peft_files.write(tmp_path / "a", tensors, {**good, **edit})
        with pytest.raises(AdapterError) as err:
            PeftAdapter("bad", d, cfg)
        msg = str(err.value)
        assert "'bad'" in msg and "adapter_config.json" in msg and reason in msg, (case, msg)
        assert err.value.adapter == "bad"
    for text in (b"[1, 2]", b'"LORA"', b"42", b"null", b"\xff\xfe{", b"\x80", b"[" * 100_000):
        (d / "adapter_config.json").write_bytes(text)
        with pytest.raises(AdapterError, match="adapter_config.json"):
            PeftAdapter("bad", d, cfg)


def test_scaling_of_valid_configs(peft_files, cfg, tmp_path):
    """lora_alpha / r (or / sqrt(r) with rsLoRA), alpha_pattern per module."""
    conf = dict(r=4, lora_alpha=2.0, target_modules=["q_proj", "v_proj"], use_rslora=True,
                alpha_pattern={"v_proj": 12})
    peft = PeftAdapter("ok", peft_files.write(tmp_path / "a", peft_files.tensors(cfg), conf), cfg)
    assert peft.scaling[(0, "q_proj")] == 1.0 and peft.scaling[(1, "v_proj")] == 6.0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=5)
MODULE_NAMES = st.sampled_from(["q_proj", "v_proj", "k_proj", "down_proj", "embed_tokens",
                                "lm_head", "model.layers.0.self_attn.q_proj", "(", ".*", ""])
CONFIG_FIELDS = {
    "peft_type": st.just("LORA") | JSON,
    "r": st.sampled_from([4, 8]) | JSON,
    "lora_alpha": st.sampled_from([8, 0.5]) | JSON,
    "target_modules": st.just(["q_proj", "v_proj"]) | st.lists(MODULE_NAMES, max_size=3)
    | MODULE_NAMES | JSON,
    "rank_pattern": st.dictionaries(MODULE_NAMES, st.sampled_from([4, 8]) | JSON, max_size=2)
    | JSON,
    "alpha_pattern": st.dictionaries(MODULE_NAMES, st.sampled_from([1, 16.0]) | JSON, max_size=2)
    | JSON,
    "use_rslora": st.booleans() | JSON,
    "use_dora": st.just(False) | JSON,
    "fan_in_fan_out": st.just(False) | JSON,
    "bias": st.just("none") | JSON,
    "modules_to_save": st.none() | JSON,
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.fixed_dictionaries(
    {k: CONFIG_FIELDS[k] for k in ("r", "target_modules")},
    optional={k: v for k, v in CONFIG_FIELDS.items() if k not in ("r", "target_modules")}) | JSON)
def test_fuzzed_config_raises_adapter_error_or_serves(peft_files, cfg, fuzz_dir, conf):
    peft_files.write(fuzz_dir, peft_files.tensors(cfg), conf)
    _expect_adapter_error("fuzz", fuzz_dir, cfg)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "a"


# --- safetensors headers that lie, and truncated or corrupt files

def _safetensors_parts(tensors):
    from safetensors.torch import save

    raw = save(tensors)
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_safetensors(d, header, data, length=None):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    (d / "adapter_model.safetensors").write_bytes(
        (len(text) if length is None else length).to_bytes(8, "little") + text + data)


def test_refused_safetensors_headers(peft_files, cfg, tmp_path):
    """Headers that lie about dtype, shape or offsets, and truncated files: AdapterError
    naming the file and the tensor or the sizes."""
    d = peft_files.write(tmp_path / "a", peft_files.tensors(cfg))
    header, data = _safetensors_parts(peft_files.tensors(cfg))
    key = next(k for k in header if k != "__metadata__")

    def edit(field, value):
        h = json.loads(json.dumps(header))
        h[key][field] = value
        return h

    begin, end = header[key]["data_offsets"]
    cases = [
        (edit("dtype", "F16"), data, "take"),            # half the bytes its offsets span
        (edit("dtype", "I64"), data, "dtype"),           # not a float
        (edit("dtype", 7), data, "dtype"),
        (edit("shape", [4, 65]), data, "take"),          # more elements than its bytes
        (edit("shape", [64, 4]), data, "do not fit"),    # same bytes, transposed
        (edit("shape", [256]), data, "not a matrix"),
        (edit("shape", "4x64"), data, "shape"),
        (edit("shape", [4, -64]), data, "shape"),
        (edit("data_offsets", [end, begin]), data, "data_offsets"),
        (edit("data_offsets", [begin, end, 0]), data, "data_offsets"),
        (edit("data_offsets", [begin + 4, end + 4]), data, "overlap or leave a gap"),
        (edit("data_offsets", None), data, "data_offsets"),
        ({**header, key: [1, 2]}, data, "not an object"),
        ([header], data, "not an object"),
        (b"{not json", data, "JSON"),
        (b"\xff" * 16, data, "JSON"),
        (header, data[:-4], "bytes"),                    # truncated
        (header, data + b"\0" * 8, "bytes"),             # trailing bytes
    ]
    for h, body, reason in cases:
        _write_safetensors(d, h, body)
        with pytest.raises(AdapterError) as err:
            PeftAdapter("bad", d, cfg)
        msg = str(err.value)
        assert "'bad'" in msg and "adapter_model.safetensors" in msg and reason in msg, msg
    for length in (0, 1 << 62, len(json.dumps(header)) + 10 ** 6):
        _write_safetensors(d, header, data, length=length)
        with pytest.raises(AdapterError, match="header length"):
            PeftAdapter("bad", d, cfg)
    for size in (0, 3, 8, 20):
        f = d / "adapter_model.safetensors"
        _write_safetensors(d, header, data)
        f.write_bytes(f.read_bytes()[:size])
        with pytest.raises(AdapterError, match="adapter_model.safetensors"):
            PeftAdapter("bad", d, cfg)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_safetensors_raise_adapter_error_or_serve(peft_files, cfg, fuzz_dir, data):
    """Random edits of a valid file's header, length field and bytes: registration and the
    first read raise AdapterError or serve finite weights, never another exception."""
    header, body = _safetensors_parts(peft_files.tensors(cfg))
    peft_files.write(fuzz_dir, {}, None)
    keys = sorted(k for k in header if k != "__metadata__")
    length = None
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["field", "drop", "entry", "header", "length", "body"]))
        key = data.draw(st.sampled_from(keys))
        if kind in ("field", "drop", "entry") and not isinstance(header, dict):
            kind = "header"
        if kind == "field" and isinstance(header.get(key), dict):
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[key][field] = data.draw(
                st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "BOOL", "F8_E4M3"])
                | st.lists(st.integers(-2, 300), max_size=3) | JSON)
        elif kind == "drop":
            header.pop(key, None)
        elif kind == "entry":
            header[key] = data.draw(JSON)
        elif kind == "header":
            header = data.draw(JSON)
        elif kind == "length":
            length = data.draw(st.integers(0, (1 << 64) - 1))
        else:
            cut = data.draw(st.integers(0, len(body)))
            body = body[:cut] + data.draw(st.binary(max_size=8)) + body[cut + 1:]
    _write_safetensors(fuzz_dir, header, body, length)
    _expect_adapter_error("fuzz", fuzz_dir, cfg)


# --- .bin files that are not pickles, or hold something else than a state dict

def test_refused_bin_files(peft_files, cfg, tmp_path):
    d = peft_files.write(tmp_path / "a", peft_files.tensors(cfg), fmt="bin")
    good = peft_files.tensors(cfg)
    key = next(iter(good))
    f = d / "adapter_model.bin"
    raw_cases = [(b"", "torch.load"), (b"not a pickle at all", "torch.load"),
                 (f.read_bytes()[:100], "torch.load")]
    obj_cases = [
        ([1, 2, 3], "not a state dict"), ("LORA", "not a state dict"), (None, "not a state dict"),
        ({1: torch.zeros(4, 64)}, "not a tensor name"),
        ({**good, key: [0.0] * 4}, "not a tensor"),
        ({**good, key: good[key].to(torch.int64)}, "not supported"),
        ({**good, key: good[key].to(torch.complex64)}, "not supported"),
        ({**good, key: good[key].to_sparse()}, "not supported"),
        ({**good, key: good[key].flatten()}, "not a matrix"),
        ({**good, key: good[key].T.contiguous()}, "do not fit"),
        ({**good, key: torch.full_like(good[key], float("nan"))}, "non-finite"),
        ({**good, "lm_head.weight": torch.zeros(4, 4)}, "lm_head"),
        ({}, "no LoRA weights"),
    ]
    for raw, reason in raw_cases:
        f.write_bytes(raw)
        with pytest.raises(AdapterError) as err:
            PeftAdapter("bad", d, cfg)
        assert "'bad'" in str(err.value) and str(f) in str(err.value) and reason in str(err.value)
    for obj, reason in obj_cases:
        torch.save(obj, f)
        with pytest.raises(AdapterError) as err:
            PeftAdapter("bad", d, cfg)
        assert "'bad'" in str(err.value) and str(f) in str(err.value), str(err.value)
        assert reason in str(err.value), str(err.value)


TENSORS = st.builds(
    lambda dtype, shape, fill: torch.full(shape, fill).to(dtype),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    st.lists(st.sampled_from([0, 1, 4, 32, 64]), max_size=3).map(tuple),
    st.sampled_from([0.0, 1.0, float("nan"), float("inf")]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bin_raise_adapter_error_or_serve(peft_files, cfg, fuzz_dir, data):
    """Random bytes, random pickled objects and valid state dicts with entries replaced:
    AdapterError or finite weights served, never another exception."""
    state = peft_files.tensors(cfg)
    peft_files.write(fuzz_dir, state, fmt="bin")
    f = fuzz_dir / "adapter_model.bin"
    kind = data.draw(st.sampled_from(["bytes", "object", "entries"]))
    if kind == "bytes":
        raw = f.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        f.write_bytes(data.draw(st.sampled_from([raw[:cut], raw[:cut] + b"\0" + raw[cut + 1:]]))
                      if data.draw(st.booleans()) else data.draw(st.binary(max_size=64)))
    elif kind == "object":
        torch.save(data.draw(JSON | st.dictionaries(st.text(max_size=4), TENSORS, max_size=3)), f)
    else:
        for key in data.draw(st.lists(st.sampled_from(sorted(state)), min_size=1, max_size=3)):
            state[key] = data.draw(TENSORS | JSON)
        torch.save(state, f)
    _expect_adapter_error("fuzz", fuzz_dir, cfg)


# ----------------------------------------------------------------------------- reads at first use

def _packed(path, cfg, dtype=torch.float32):
    return PeftAdapter("ref", path, cfg).pack(256, dtype)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_nonfinite_weights_fail_the_first_read(peft_files, cfg, tmp_path, fmt):
    """NaN or inf weights in a file registered clean are found when `pack` reads them:
    AdapterError naming the tensor, with `adapter` set; (a .bin file is read whole at
    registration too, so there they are refused at once)."""
    tensors = peft_files.tensors(cfg)
    d = peft_files.write(tmp_path / "a", tensors, fmt=fmt)
    peft = PeftAdapter("nan", d, cfg)
    for key, value in ((next(k for k in tensors if "lora_B" in k), float("nan")),
                       (next(k for k in tensors if "lora_A" in k), float("-inf"))):
        bad = dict(tensors)
        bad[key] = bad[key].clone()
        bad[key][1, 2] = value
        peft_files.write(d, bad, fmt=fmt)
        with pytest.raises(AdapterError) as err:
            peft.pack(256, torch.float32)
        msg = str(err.value)
        assert err.value.adapter == "nan" and "'nan'" in msg and repr(key) in msg, msg
        assert "non-finite" in msg
        if fmt == "bin":
            with pytest.raises(AdapterError, match="non-finite"):
                PeftAdapter("nan", d, cfg)
    peft_files.write(d, tensors, fmt=fmt)  # fixed in place: the next read serves it
    assert torch.equal(peft.pack(256, torch.float32), _packed(d, cfg))


def test_weights_that_overflow_the_pool_dtype_fail_the_read(peft_files, cfg, tmp_path):
    """lora_B x scaling past float16's range: finite in the file, inf in the pool."""
    tensors = peft_files.tensors(cfg)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = 6e4  # x scaling 2 = 1.2e5 > 65504
    peft = PeftAdapter("big", peft_files.write(tmp_path / "a", tensors), cfg)
    assert bool(torch.isfinite(peft.pack(256, torch.float32)).all())
    with pytest.raises(AdapterError, match=rf"{re.escape(repr(key))} overflows torch.float16"):
        peft.pack(256, torch.float16)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_file_changed_after_registration(peft_files, cfg, tmp_path, fmt):
    """The same layout: the new weights are served, read whole. Another layout (a rank, a
    module): AdapterError saying it changed and to re-add it. Gone, truncated or garbage:
    AdapterError; back as registered: served again."""
    d = peft_files.write(tmp_path / "a", peft_files.tensors(cfg, seed=1), fmt=fmt)
    peft = PeftAdapter("ch", d, cfg)
    old = peft.pack(256, torch.float32)
    peft_files.write(d, peft_files.tensors(cfg, seed=2), fmt=fmt)
    new = peft.pack(256, torch.float32)
    assert not torch.equal(new, old) and torch.equal(new, _packed(d, cfg))
    for other in (peft_files.tensors(cfg, r=8),
                  peft_files.tensors(cfg, modules=("q_proj", "k_proj"))):
        peft_files.write(d, other, fmt=fmt)
        with pytest.raises(AdapterError) as err:
            peft.pack(256, torch.float32)
        msg = str(err.value)
        assert err.value.adapter == "ch" and "changed since add_adapter" in msg, msg
        assert "add_adapter it again" in msg
    f = d / f"adapter_model.{fmt}"
    peft_files.write(d, peft_files.tensors(cfg, seed=2), fmt=fmt)
    raw = f.read_bytes()
    for broken in (None, raw[:len(raw) // 2], b"\0" * len(raw)):
        if broken is None:
            f.unlink()
        else:
            f.write_bytes(broken)
        with pytest.raises(AdapterError) as err:
            peft.pack(256, torch.float32)
        assert err.value.adapter == "ch" and str(f) in str(err.value)
    f.write_bytes(raw)
    assert torch.equal(peft.pack(256, torch.float32), new)


class _RewrittenWhileRead:
    """`open` for the loader: the file is rewritten in place (`new` bytes, a later mtime)
    after the first half of each of the first `times` reads, as a writer racing the read."""

    def __init__(self, new: bytes, times: int) -> None:
        self.new, self.times, self.opened = new, times, 0

    def __call__(self, file, mode="r", *args, **kwargs):
        fh = open(file, mode, *args, **kwargs)
        self.opened += 1
        if self.opened > self.times:
            return fh
        racer = self

        class Racing:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                fh.close()

            def fileno(self):
                return fh.fileno()

            def read(self, n=-1):
                return fh.read(n)

            def readinto(self, view):
                got = fh.readinto(view[:max(1, len(view) // 2)])
                with open(file, "r+b") as w:
                    w.write(racer.new)
                st = os.stat(file)
                os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
                return got

        return Racing()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_file_rewritten_during_the_read_is_never_served_half_old(peft_files, cfg, tmp_path,
                                                                   monkeypatch, fmt):
    from slora.model import loader

    d = peft_files.write(tmp_path / "a", peft_files.tensors(cfg, seed=1), fmt=fmt)
    f = d / f"adapter_model.{fmt}"
    peft = PeftAdapter("race", d, cfg)
    other = peft_files.write(tmp_path / "b", peft_files.tensors(cfg, seed=2), fmt=fmt)
    old, new = f.read_bytes(), (other / f.name).read_bytes()
    assert len(new) == len(old)  # the rewrite keeps the size: only the mtime tells
    monkeypatch.setattr(loader, "open", _RewrittenWhileRead(new, times=1), raising=False)
    # the first read got half of each; the second, the new file whole
    assert torch.equal(peft.pack(256, torch.float32), _packed(other, cfg))
    f.write_bytes(old)
    monkeypatch.setattr(loader, "open", _RewrittenWhileRead(new, times=10), raising=False)
    with pytest.raises(AdapterError, match="kept changing") as err:
        peft.pack(256, torch.float32)
    assert err.value.adapter == "race"


def test_a_failed_read_leaves_the_host_tier_as_it_was(peft_files, tiny_model_dir, cfg, tmp_path):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    d = peft_files.write(tmp_path / "a", peft_files.tensors(cfg))
    engine.add_adapter("a", d)
    engine.add_adapter("ok", peft_files.write(tmp_path / "b", peft_files.tensors(cfg)))
    tier, adapters = engine.runner.host_tier, engine.adapters
    tier.host_copy(adapters.get("ok"), adapters)
    before = (dict(tier.tensors), adapters.host_bytes, adapters.host_loads)
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError) as err:
        tier.host_copy(adapters.get("a"), adapters)
    assert err.value.adapter == "a"
    assert (dict(tier.tensors), adapters.host_bytes, adapters.host_loads) == before
    assert not adapters.on_host("a") and not adapters.get("a").resident


def test_nonfinite_weights_fail_their_requests_alone(peft_files, tiny_model_dir, cfg, tmp_path):
    """NaN weights found at first use: that adapter's requests end with finish_reason
    "error" naming it, the others' tokens are those of a clean run, no page leaks, and once
    the file is fixed the next request reads it again and is served."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    tensors = peft_files.tensors(cfg, seed=3)
    good = peft_files.write(tmp_path / "good", tensors)
    engine.add_adapter("good", good)
    clean = engine.generate(["Hello", "Hello"], sp, adapters=["good", None])
    bad = dict(tensors)
    key = next(k for k in bad if "lora_B" in k)
    bad[key] = torch.full_like(bad[key], float("nan"))
    d = peft_files.write(tmp_path / "bad", bad)
    engine.add_adapter("bad", d)  # the header is fine: registration does not read the data
    outs = engine.generate(["Hello"] * 4, sp, adapters=["good", "bad", None, "bad"])
    for o in (outs[1], outs[3]):
        assert o.finish_reason == "error" and "'bad'" in o.error and "non-finite" in o.error
    assert [outs[0].token_ids, outs[2].token_ids] == [c.token_ids for c in clean]
    st_ = engine.stats()
    assert st_["pages_kv"] == 0 and not engine.adapters.get("bad").resident
    peft_files.write(d, tensors)
    again = engine.generate(["Hello"], sp, adapters="bad")
    assert again[0].finish_reason == "length" and again[0].token_ids == clean[0].token_ids


# ----------------------------------------------------------------------------- names

@pytest.mark.parametrize("name, exc", [(None, TypeError), (42, TypeError), (b"a", TypeError),
                                       (("a",), TypeError), ("", ValueError)])
def test_adapter_names_must_be_nonempty_str(tiny_model_dir, good, name, exc):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    with pytest.raises(exc, match="adapter name must be a non-empty str"):
        engine.add_adapter(name, good)
    with pytest.raises(exc, match="adapter name must be a non-empty str"):
        engine.add_synthetic_adapter(name, 4)
    assert engine.list_adapters() == [] and engine._synthetic == {}


def test_refused_synthetic_adapters_leave_no_buffer(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    engine.add_synthetic_adapter("a", 4)
    buffers = dict(engine._synthetic)
    for kwargs, exc in [(dict(name="a", rank=8), ValueError),          # name taken
                        (dict(name="b", rank=4096), ValueError),       # larger than the pool
                        (dict(name="b", rank=2.5), TypeError),
                        (dict(name="b", rank=True), TypeError),
                        (dict(name="b", rank=0), ValueError),
                        (dict(name="b", rank=4, target_modules=[]), ValueError),
                        (dict(name="b", rank=4, target_modules=["wte"]), ValueError),
                        (dict(name="b", rank=4, seed="abc"), TypeError),
                        (dict(name="b", rank=4, seed=2 ** 64), ValueError)]:
        with pytest.raises(exc):
            engine.add_synthetic_adapter(**kwargs)
        assert engine.list_adapters() == ["a"] and engine._synthetic == buffers, kwargs
    engine.add_synthetic_adapter("b", 4, "q_proj")  # one module by name
    assert engine.adapters.get("b").layout.modules == ("q_proj",)
