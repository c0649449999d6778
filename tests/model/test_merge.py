"""Merged adapters (LoRAX's merged_adapters): the strategies on tensors worked by hand, the
pack/unpack round trip, and a merged adapter served beside its parts equal to PEFT running
an adapter whose weights are the merge (fp32)."""

import pytest
import torch
from safetensors.torch import load_file

from slora import Engine, EngineConfig, MergeSpec, SamplingParams
from slora.core.adapters import AdapterLayout
from slora.model.loader import AdapterError, pack_adapter, unpack_adapter
from slora.model.merge import merge_tensors
from tests.conftest import peft_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


def merged(xs, weights, **kw):
    return merge_tensors([torch.tensor(x) for x in xs], weights, MergeSpec(("a", "b"), **kw),
                         torch.Generator().manual_seed(0)).tolist()


def test_strategies_by_hand():
    a, b = [[1.0, -2.0], [0.5, 3.0]], [[-3.0, 1.5], [0.25, -1.0]]
    assert merged([a, b], [2.0, 1.0]) == [[-1.0, -2.5], [1.25, 5.0]]
    # ties, density 1: every element kept; the sign of a + b wins, the agreeing w x averaged
    assert merged([a, b], [2.0, 1.0], strategy="ties") == [[-3.0, -4.0], [0.625, 6.0]]
    # density 0.5: a keeps 3 and -2, b keeps -3 and 1.5; frequency votes: a tie goes to +
    assert merged([a, b], [1.0, 1.0], strategy="ties", density=0.5,
                  majority_sign_method="frequency") == [[-3.0, 1.5], [0.0, 3.0]]
    # dare at density 1 is linear; below, each element is 0 or rescaled, the same every time
    assert merged([a, b], [2.0, 1.0], strategy="dare_linear") == merged([a, b], [2.0, 1.0])
    half = merged([a], [1.0], strategy="dare_linear", density=0.5)
    assert half == merged([a], [1.0], strategy="dare_linear", density=0.5)
    assert all(v in (0.0, 2 * x) for row, xs in zip(half, a) for v, x in zip(row, xs))
    assert 0.0 in sum(half, []) and any(v != 0 for v in sum(half, []))


def test_bad_specs_are_clear_errors():
    for kw, why in ((dict(adapters=()), "adapters=.*one or more distinct"),
                    (dict(adapters=("a", "a")), "adapters=.*distinct"),
                    (dict(weights=(1.0,)), r"weights=\(1.0,\): must be 2 finite numbers"),
                    (dict(strategy="svd"), "strategy='svd': must be one of linear, ties"),
                    (dict(density=0.0), r"density=0.0: must be a number in \(0, 1\]"),
                    (dict(majority_sign_method="max"), "majority_sign_method='max'")):
        with pytest.raises(ValueError, match=why):
            MergeSpec(**{"adapters": ("a", "b"), **kw})


def test_unpack_inverts_pack(tiny_model_dir):
    from slora.config import LORA_MODULES, ModelConfig

    cfg = ModelConfig.from_dir(tiny_model_dir)
    ranks = [[4, 0, 2, 0, 0, 0, 3]] + [[4, 1, 0, 0, 0, 0, 0]] * (cfg.num_layers - 1)
    layout = AdapterLayout.build(cfg, ranks, vocab_ranks=(0, 2))
    g = torch.Generator().manual_seed(0)
    want = {}

    def get_ab(layer, module):
        r = 2 if module == "lm_head" else ranks[layer][LORA_MODULES.index(module)]
        d_in, d_out = cfg.module_dims(module)
        want[(layer, module)] = torch.randn(r, d_in, generator=g), torch.randn(d_out, r,
                                                                                generator=g)
        return want[(layer, module)]

    got = unpack_adapter(cfg, layout, pack_adapter(cfg, layout, 4096, torch.float32, get_ab))
    assert got.keys() == want.keys()
    for key, (A, B) in want.items():
        assert torch.equal(got[key][0], A) and torch.equal(got[key][1], B), key


def peft_tensors(path, scaling):
    """{(layer, module): (A, B scaled)} of a PEFT adapter saved by make_adapter."""
    out = {}
    for key, t in load_file(str(path / "adapter_model.safetensors")).items():
        parts = key.split(".")
        layer, module, which = int(parts[4]), parts[6], parts[7]
        a, b = out.get((layer, module), (None, None))
        out[(layer, module)] = (t, b) if which == "lora_A" else (a, t * scaling)
    return out


def write_peft(model_dir, path, weights: dict, r: int, alpha: int):
    """A PEFT adapter with `weights` ({(layer, module): (A, B scaled)}), saved as PEFT saves."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    targets = sorted({m for _, m in weights})
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha,
                                                      target_modules=targets,
                                                      init_lora_weights=False))
    scaling = alpha / r
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                parts = name.split(".")
                layer, module = int(parts[4]), parts[6]
                A, B = weights.get((layer, module), (torch.zeros_like(p), None))
                if "lora_A" in name:
                    p.copy_(A)
                else:
                    p.copy_(B / scaling if B is not None else torch.zeros_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("strategy,density", [("linear", 1.0), ("ties", 0.6),
                                              ("dare_ties", 0.7)])
def test_merged_adapter_matches_peft_on_the_merge(tiny_model_dir, adapter_factory, tmp_path,
                                                  strategy, density):
    """Two adapters of rank 8 (other alphas, one more module) merged; served in one batch
    with its parts and the base model. The reference: PEFT on an adapter holding the merged
    weights (linear: sum_i w_i of each matrix, by hand; ties / dare: `merge_weights`')."""
    from slora.model.merge import merge_weights

    a = adapter_factory(tiny_model_dir, seed=3, lora_alpha=16)
    b = adapter_factory(tiny_model_dir, seed=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "o_proj"])
    spec = MergeSpec(("a", "b"), (0.7, 0.5), strategy, density)
    parts = [peft_tensors(a, 16 / 8), peft_tensors(b, 8 / 8)]
    if strategy == "linear":
        want = {k: tuple(sum(w * p[k][i] for w, p in zip((0.7, 0.5), parts) if k in p)
                         for i in (0, 1)) for k in parts[0].keys() | parts[1].keys()}
    else:
        want = merge_weights(parts, spec)
    ref = write_peft(tiny_model_dir, tmp_path / "ref", want, r=8, alpha=16)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                                 num_pages=128))
    engine.add_adapter("a", a)
    engine.add_adapter("b", b)
    engine.add_merged_adapter("ab", spec)
    assert engine.adapters.get("ab").layout.modules == ("q_proj", "v_proj", "o_proj")
    names = [None, "a", "ab", "b"]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    outs = engine.generate([p for p in PROMPTS for _ in names], sp, adapters=names * 2)
    for out in outs[2::4]:
        toks, lps = peft_greedy(tiny_model_dir, ref, out.prompt_token_ids, 6, DEVICE)
        assert out.token_ids == toks
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(lps,
                                                                                     abs=1e-3)
    assert outs[2].token_ids != outs[1].token_ids or outs[2].logprobs != outs[1].logprobs


def test_merges_that_cannot_be_made_are_refused(tiny_model_dir, adapter_factory):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=128))
    engine.add_adapter("r8", adapter_factory(tiny_model_dir, seed=5))
    engine.add_adapter("r4", adapter_factory(tiny_model_dir, seed=6, r=4, lora_alpha=8))
    engine.add_adapter("dora", adapter_factory(tiny_model_dir, seed=7, use_dora=True))
    with pytest.raises(AdapterError, match=r"layer 0 q_proj has ranks \[8, 4\] in \['r8', 'r4'\]"):
        engine.add_merged_adapter("m", MergeSpec(("r8", "r4")))
    with pytest.raises(AdapterError, match="'dora' cannot be merged: DoRA adapters"):
        engine.add_merged_adapter("m", MergeSpec(("r8", "dora")))
    with pytest.raises(KeyError, match="nope"):
        engine.add_merged_adapter("m", MergeSpec(("r8", "nope")))
    assert "m" not in engine.list_adapters()
    # a merge of one adapter with weight 1 serves its tokens; other weights another identity
    engine.add_merged_adapter("one", MergeSpec(("r8",)))
    engine.add_merged_adapter("half", MergeSpec(("r8",), (0.5,)))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate([PROMPTS[0]] * 2, sp, adapters=["r8", "one"])
    assert outs[0].token_ids == outs[1].token_ids
    ids = {engine.adapters.get(n).identity for n in ("r8", "one", "half")}
    assert len(ids) == 3
