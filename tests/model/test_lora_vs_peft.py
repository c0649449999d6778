"""One heterogeneous batch (adapters of different ranks and targets, rsLoRA, rank/alpha
patterns, layers_to_transform, base-only rows) gives, request by request, PEFT's greedy tokens
for that request run alone with its adapter (fp32, CPU)."""

import pytest
import torch

# On a GPU the same comparison runs on CUDA (Triton kernels), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from slora import Engine, EngineConfig, SamplingParams

NEW = 16
ADAPTERS = {
    "rank1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
    "rank80_all": dict(r=80, lora_alpha=40, target_modules="all-linear"),
    "rslora": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"],
                     rank_pattern={"q_proj": 12}, alpha_pattern={"down_proj": 3}),
    "layer1_only": dict(r=6, lora_alpha=6, target_modules=["gate_proj", "down_proj"],
                        layers_to_transform=[1]),
    "regex": dict(r=5, lora_alpha=10, target_modules=r".*\.self_attn\.(q|v)_proj"),
}
PROMPTS = ["The quick brown fox", "Hello world! How", "Serving many LoRA adapters",
           "Paris is the capital of", "I am fine", "Berlin is"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, adapter_factory):
    paths = {name: adapter_factory(tiny_model_dir, seed=i, **kw)
             for i, (name, kw) in enumerate(ADAPTERS.items())}
    return tiny_model_dir, paths


def peft_greedy(model_dir, adapter_path, ids, n):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE)
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path).to(DEVICE)
    model.eval()
    x = torch.tensor([ids], device=DEVICE)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_heterogeneous_batch_matches_peft(setup):
    model_dir, paths = setup
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=128))
    for name, path in paths.items():
        engine.add_adapter(name, path)
    names = [None, *ADAPTERS]
    # every prompt with every adapter (and base), all in one continuous batch
    jobs = [(p, a) for p in PROMPTS[:3] for a in names] + [(PROMPTS[3], None), (PROMPTS[4], "rank1")]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    outs = engine.generate([p for p, _ in jobs], sp, adapters=[a for _, a in jobs])
    base = {}
    for (prompt, name), out in zip(jobs, outs):
        ids = engine.tokenizer.encode(prompt)
        want = peft_greedy(model_dir, paths.get(name), ids, NEW)
        assert out.token_ids == want, f"adapter {name}, prompt {prompt!r}"
        base.setdefault(prompt, {})[name] = out.token_ids
    # the adapters really change the output
    for prompt in PROMPTS[:3]:
        by_name = base[prompt]
        assert sum(by_name[a] != by_name[None] for a in ADAPTERS) >= len(ADAPTERS) - 1
    s = engine.stats()
    assert s["adapter_loads"] == len(ADAPTERS)
    assert s["pages_adapter"] > 0 and s["pages_kv"] == 0
    assert s["pages_free"] + s["pages_cached"] + s["pages_adapter"] == s["pages_total"]


def test_adapter_pages_are_rank_granular(setup):
    """Pages grow with rank, with no padding to a maximum rank: an adapter takes
    ceil(r * sum(d_in + d_out) / P) pages, dims rounded up to the 64-element row alignment
    (a no-op for real models, whose dims are multiples of 64), so under one page is wasted."""
    from slora.config import round_up
    from slora.kernels.reference import LORA_ALIGN

    model_dir, _ = setup
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32", num_pages=64))
    cfg, P = engine.model_config, engine.runner.page_size
    mods = ("q_proj", "k_proj", "v_proj", "o_proj")
    pages = []
    for r in (1, 8, 64):
        engine.add_synthetic_adapter(f"s{r}", r, mods)
        info = engine.adapters.get(f"s{r}")
        exact = r * sum(round_up(d, LORA_ALIGN) for m in mods for d in cfg.module_dims(m))
        assert (info.num_pages - 1) * P < exact <= info.num_pages * P
        pages.append(info.num_pages)
    assert pages[0] < pages[1] < pages[2]
