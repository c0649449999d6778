"""Host memory stays bounded: between uses the engine keeps an adapter's weights only in the
host tier, which `host_cache_gb` bounds, whatever the adapter's format; a synthetic adapter's
shared buffer lives while an adapter of its (rank, targets, seed) is registered. Measured as
the bytes of the tensors the engine can reach, not as timings."""

import gc
import types

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ModelConfig
from slora.model.loader import PeftAdapter

N = 200  # adapters of each format
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` through references:
    attributes, containers, bound methods, closures and default arguments. Classes and modules
    are not followed (a function's globals neither), so what is counted hangs off the roots."""
    seen, storages, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        elif not isinstance(obj, (type, types.ModuleType)):
            stack += gc.get_referents(obj)
    return sum(storages.values())


def host_tier_bytes(engine) -> int:
    return tensor_bytes(engine.runner.host_tier.tensors)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory, peft_files):
    """N safetensors and N .bin adapters of rank 8 on every module, each of its own weights."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    root = tmp_path_factory.mktemp("host_memory")
    conf = dict(peft_type="LORA", r=8, lora_alpha=16, target_modules=list(MODULES))
    return {fmt: [peft_files.write(root / f"{fmt}{i}", peft_files.tensors(cfg, 8, MODULES, seed=i),
                                 conf, fmt=fmt) for i in range(N)]
            for fmt in ("safetensors", "bin")}


def test_bin_adapters_keep_no_weights_after_registration(tiny_model_dir, adapter_dirs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    peft = PeftAdapter("bin", adapter_dirs["bin"][0], cfg)
    assert tensor_bytes(peft) == 0
    assert tensor_bytes(peft.pack(256, torch.float32)) > 0 and tensor_bytes(peft) == 0


def test_many_adapters_of_every_format_stay_within_host_cache(tiny_model_dir, adapter_dirs):
    """N adapters of each format (safetensors, .bin, synthetic), registered and each used
    once: the tensors the engine holds grow by at most the host tier's bound, the synthetic
    adapters' shared buffers and the copies of the adapters of one step."""
    seqs = 4
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=256, max_num_seqs=seqs))
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([[5, 6, 7]] * seqs, sp)  # the engine's own buffers, made by a first step
    base = tensor_bytes(engine)
    engine.add_adapter("probe", adapter_dirs["bin"][0])
    adapter_bytes = engine.adapters.get("probe").nbytes
    engine.remove_adapter("probe")
    # room for 10 adapters, set after measuring one
    engine.adapters.host_cache_bytes = bound = 10 * adapter_bytes
    for fmt in ("safetensors", "bin"):
        for i, d in enumerate(adapter_dirs[fmt]):
            engine.add_adapter(f"{fmt}{i}", d)
    for i in range(N):
        engine.add_synthetic_adapter(f"synthetic{i}", 8, MODULES, seed=i % 4)
    names = sorted(engine.list_adapters())
    assert len(names) == 3 * N
    outs = engine.generate([[5, 6, 7]] * len(names), sp, adapters=names)
    assert all(o.finish_reason == "length" for o in outs)
    st = engine.stats()
    assert st["host_loads"] >= 3 * N - 10 and st["host_evictions"] > 0  # every adapter was read
    assert engine.adapters.host_bytes <= bound and host_tier_bytes(engine) <= bound
    synthetic = tensor_bytes(engine._synthetic)
    assert len(engine._synthetic) == 4 and synthetic == 4 * adapter_bytes
    grown = tensor_bytes(engine) - base
    # .bin adapters that kept their weights would add N x 64 KiB here
    assert grown <= bound + synthetic + seqs * adapter_bytes, (grown, bound, synthetic)


def test_synthetic_buffers_freed_with_their_last_adapter(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=512))
    for seed in range(100):
        engine.add_synthetic_adapter(f"s{seed}", 8, seed=seed)
    engine.add_synthetic_adapter("twin", 8, seed=0)  # shares s0's buffer
    assert len(engine._synthetic) == 100
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([[5, 6, 7]] * 3, sp, adapters=["s0", "twin", "s1"])
    for seed in range(100):
        engine.remove_adapter(f"s{seed}")
    assert list(engine._synthetic) == [(8, ("q_proj", "k_proj", "v_proj", "o_proj"), 0)]
    engine.generate([[5, 6, 7]], sp, adapters="twin")
    engine.remove_adapter("twin")
    assert engine._synthetic == {} and tensor_bytes(engine._synthetic) == 0
    assert engine.runner.host_tier.tensors == {}
    engine.add_synthetic_adapter("again", 8, seed=0)  # a fresh buffer for a key seen before
    assert len(engine._synthetic) == 1
    engine.generate([[5, 6, 7]], sp, adapters="again")


def test_warmup_frees_its_buffers_and_keeps_the_registered_ones(tiny_model_dir):
    """Warm-up adapters are removed when warm-up ends: the buffers only they used go with
    them, those that registered adapters share stay."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=512))
    engine.add_synthetic_adapter("small", 8)
    buffers = dict(engine._synthetic)
    engine.warmup()
    assert engine._synthetic == buffers and engine.list_adapters() == ["small"]
    engine.remove_adapter("small")
    assert engine._synthetic == {}
