"""DoRA adapters (use_dora): one batch mixing DoRA adapters (on q/k/v/o and on all seven
modules, different ranks), a plain LoRA adapter and base rows gives, request by request, PEFT's
greedy tokens and log-probs for that request run alone with its adapter (fp32). Covered: biases
(q/k/v and o), Phi-3's fused q|k|v and gate|up modules, FP8 base weights (the norm of the
dequantized weight), the Triton path under the interpreter, and what is refused."""


import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import LORA_MODULES, ModelConfig
from slora.model.loader import AdapterError, PeftAdapter
from tests.conftest import batch_against_peft

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW = 8
PROMPTS = ["The quick brown fox", "Paris is the capital of"]
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {  # name -> LoraConfig kwargs, per model kind
    "llama": {
        "dora_qkvo": dict(r=4, lora_alpha=8, use_dora=True, target_modules=QKVO),
        "dora_all": dict(r=12, lora_alpha=6, use_dora=True, target_modules="all-linear",
                         rank_pattern={"down_proj": 5}),
        "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    },
    # q/k/v and o biases: DoRA rescales the output around the bias
    "llama_headdim_linear": {
        "dora_qkvo": dict(r=6, lora_alpha=12, use_dora=True, target_modules=QKVO,
                          use_rslora=True),
        "plain": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    },
    # fused q|k|v and gate|up: each part takes its rows of the magnitude vector
    "phi3": {
        "dora_fused": dict(r=4, lora_alpha=8, use_dora=True,
                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "dora_qkv_l1": dict(r=8, lora_alpha=8, use_dora=True, target_modules=["qkv_proj"],
                            layers_to_transform=[1]),
    },
}


def make_dora_adapter(model_dir, path, seed, **kw):
    """A PEFT adapter with random A and B and, for DoRA, a magnitude vector away from the
    norm of W + s B A, so that DoRA's rescale changes the outputs."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """kind -> (model dir, {name: adapter dir}), built on first use."""
    cache = {}

    def get(kind):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"dora_{kind}")
            model_dir = tiny_models(kind)
            cache[kind] = model_dir, {name: make_dora_adapter(model_dir, root / name, i, **kw)
                                      for i, (name, kw) in enumerate(ADAPTERS[kind].items())}
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_dora_in_one_batch_matches_peft(adapters, kind):
    model_dir, paths = adapters(kind)
    got = batch_against_peft(model_dir, paths, PROMPTS, NEW, DEVICE)
    for name in paths:  # every adapter changes some output: not base against base
        assert any(t[name][0] != t[None][0] for t in got.values()), name


def test_dora_rescale_is_not_a_no_op(adapters):
    """DoRA's rescale matters: the same A and B served as plain LoRA (use_dora off, the
    magnitudes dropped) give other outputs than the DoRA adapter."""
    model_dir, paths = adapters("llama")
    ad = PeftAdapter("d", paths["dora_qkvo"], ModelConfig.from_dir(model_dir))
    assert ad.dora and ad.layout.dora_modules == tuple(QKVO)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    engine.add_adapter("dora", paths["dora_qkvo"])
    flat = engine.adapters.get("dora").pack(engine.runner.page_size, torch.float32)
    deltas = [flat[layer, off:off + ModelConfig.from_dir(model_dir).module_dims(m)[1]]
              for layer in range(flat.shape[0])
              for m, off in zip(LORA_MODULES, ad.layout.dora) if off >= 0]
    assert all(d.abs().max() > 0.05 for d in deltas)  # magnitude / norm - 1 is far from 0


def test_dora_on_fp8_base_weights_uses_the_dequantized_weight(adapters):
    """With quantization="fp8" the norms are those of the dequantized weights: the engine
    equals PEFT on the model whose linear weights were replaced by their FP8 round trip."""
    from slora.model.quant import round_trip

    def fp8(model):
        with torch.no_grad():
            for name, mod in model.named_modules():
                if name.endswith(tuple(QKVO + ["gate_proj", "up_proj", "down_proj"])):
                    mod.weight.copy_(round_trip(mod.weight))

    model_dir, paths = adapters("llama")
    # (on CPU, the twins: the GPU's FP8 GEMMs quantize the activations too)
    batch_against_peft(model_dir, {"dora_all": paths["dora_all"]}, PROMPTS[:1], NEW, "cpu",
                       transform=fp8, quantization="fp8")


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU interpreter run; on a GPU the batch "
                    "test above runs the Triton kernels in CUDA graphs")
def test_dora_triton_graph_buffers_equal_torch(adapters):
    """The Triton path (MBGMV, MBGMM and the DoRA rescale kernel, under the interpreter on
    CPU) over the CUDA graphs' static, padded buffers (run eagerly: capture=False) gives the
    torch twins' tokens and log-probs: one batch with DoRA, plain and base rows, decode rows
    and a prompt in one step. The graphs are keyed by their DoRA groups."""
    model_dir, paths = adapters("llama_headdim_linear")
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                     num_pages=64, backend=backend, cuda_graphs=False))
        if backend == "triton":
            engine.runner.graphs = engine.runner.make_graphs(4, mixed_tokens=16, capture=False)
        for name, path in paths.items():
            engine.add_adapter(name, path)
        sp = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1)
        ids = [engine.add_request(PROMPTS[0], sp, a) for a in (None, "dora_qkvo", "plain")]
        engine.step()  # they decode while the next prompt prefills
        ids.append(engine.add_request(PROMPTS[1], sp, "dora_qkvo"))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        outs[backend] = [done[i] for i in ids]
        if backend == "triton":
            keys = engine.runner.graphs.graphs
            assert {k[0] for k in keys} == {"decode", "mixed"}
            assert all(k[-2] == ("qkv", "o") for k in keys), list(keys)  # dora_qkvo's groups
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.token_ids == b.token_ids
        assert ([lp[t] for lp, t in zip(a.logprobs, a.token_ids)]
                == pytest.approx([lp[t] for lp, t in zip(b.logprobs, b.token_ids)], abs=1e-4))


def test_warmup_covers_dora_batches(tiny_models):
    """The warm-up's temporary adapters: DoRA ones for the registered DoRA adapters' group set
    and for the union, which batches mixing DoRA and plain adapters replay."""
    from slora.core.adapters import AdapterLayout
    from slora.graphs import warmup_adapters

    cfg = ModelConfig.from_dir(tiny_models("llama"))
    dora = AdapterLayout.uniform(cfg, 8, QKVO, dora=True)
    plain = AdapterLayout.uniform(cfg, 8, ["gate_proj", "down_proj"])
    got = warmup_adapters([dora, plain])
    union = ("qkv", "o", "gate_up", "down")
    assert got == [(16, ("gate_up", "down"), False), (16, union, False),
                   (16, ("qkv", "o"), True), (16, union, True)]
    assert warmup_adapters([plain]) == [(16, ("gate_up", "down"), False)]
    # an engine's warm-up captures those graphs: keyed by (DoRA groups, groups)
    import gc

    e = Engine(EngineConfig(model=str(tiny_models("llama")), device="cpu", dtype="float32",
                            num_pages=256, cuda_graphs=False, max_num_seqs=2))
    e.add_synthetic_adapter("dora", 8, QKVO, dora=True)
    e.add_synthetic_adapter("plain", 8, ["gate_proj", "down_proj"])
    e.runner.graphs = e.runner.make_graphs(2, capture=False)
    e.warmup()
    gc.unfreeze()
    assert {k[-2:] for k in e.runner.graphs.graphs} == {
        ((), ()), ((), ("gate_up", "down")), ((), union), (("qkv", "o"), ("qkv", "o")),
        (("qkv", "o", "gate_up", "down"), union)}


def test_weight_norms_are_of_the_served_rows(tiny_models):
    """The runner's norms read each module's own rows of the fused q|k|v and gate|up
    weights."""
    engine = Engine(EngineConfig(model=str(tiny_models("llama")), device="cpu",
                                 dtype="float32", num_pages=16))
    cfg, lw = engine.model_config, engine.runner.model.w.layers[1]
    g = torch.Generator().manual_seed(0)
    items, want = [], []
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for m, w in (("k_proj", lw.qkv[q:q + kv]), ("up_proj", lw.gate_up[i:]), ("o_proj", lw.o)):
        d_in, d_out = cfg.module_dims(m)
        A, B = torch.randn(3, d_in, generator=g), torch.randn(d_out, 3, generator=g)
        items.append((1, m, A, B))
        want.append(torch.linalg.norm(w + B @ A, dim=1))
    for got, w in zip(engine.runner.weight_norms(items), want):
        torch.testing.assert_close(got, w)


def _dora_dir(peft_files, tmp_path, cfg, edit):
    """A DoRA adapter on q_proj written directly; `edit(tensors, config)` breaks it."""
    t = peft_files.tensors(cfg, r=4, modules=("q_proj",))
    for layer in range(cfg.num_layers):
        t[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_magnitude_vector"] = \
            torch.ones(cfg.q_size)
    conf = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    edit(t, conf)
    return peft_files.write(tmp_path / "a", t, conf)


@pytest.mark.parametrize("edit, match", [
    (lambda t, c: c.update(use_dora=False), "DoRA magnitude but adapter_config.json does not "
                                            "set use_dora=true"),
    (lambda t, c: t.pop("base_model.model.model.layers.1.self_attn.q_proj."
                        "lora_magnitude_vector"), "layer 1 q_proj: lora_magnitude_vector missing"),
    (lambda t, c: t.update({"base_model.model.model.layers.0.self_attn.q_proj."
                            "lora_magnitude_vector": torch.ones(3)}),
     r"shape \[3\] does not fit the base model \(expected \[64\]"),
    (lambda t, c: c.update(use_dora="yes"), "use_dora='yes' must be true or false"),
])
def test_bad_dora_adapters_are_refused(tiny_models, peft_files, tmp_path, edit, match):
    cfg = ModelConfig.from_dir(tiny_models("llama"))
    engine = Engine(EngineConfig(model=str(tiny_models("llama")), device="cpu", dtype="float32",
                                 num_pages=16))
    with pytest.raises(AdapterError, match=match):
        engine.add_adapter("bad", _dora_dir(peft_files, tmp_path, cfg, edit))
    assert engine.list_adapters() == []


def test_zero_norm_fails_that_adapter_alone(tiny_models, peft_files, tmp_path):
    """A module whose W + s B A has a row of norm 0 cannot be rescaled: its load fails with
    the reason, and the engine serves the other requests."""
    model_dir = tiny_models("llama")
    cfg = ModelConfig.from_dir(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_pages=32))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    engine.add_adapter("zero", _dora_dir(peft_files, tmp_path, cfg,
                                         lambda t, c: t[key][0].zero_()))
    engine.runner.model.w.layers[0].qkv[0].zero_()  # row 0 of layer 0's q_proj: W + s B A = 0
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = engine.generate([PROMPTS[0], PROMPTS[0]], sp, adapters=["zero", None])
    assert outs[0].finish_reason == "error" and "norm 0" in outs[0].error
    assert outs[1].finish_reason == "length"
