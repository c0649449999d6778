"""LoRA on embed_tokens and lm_head, on models with untied and tied embeddings, and tokens an
adapter adds to the vocabulary, served in one batch with ordinary adapters and base rows:
greedy tokens and log-probs equal PEFT's, request by request (fp32). A saved embedding or head
that is not the base model's own, and an added-token id sent with another adapter, are
refused."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora import Engine, EngineConfig, SamplingParams
from slora.model.loader import AdapterError
from tests.conftest import peft_greedy

# On a GPU the same comparison runs on CUDA (Triton kernels), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

NEW = 8
ADAPTERS = {
    "embed": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    "head": dict(r=6, lora_alpha=6, target_modules=["lm_head"]),
    "both": dict(r=8, lora_alpha=16, use_rslora=True, rank_pattern={"lm_head": 3},
                 target_modules=["embed_tokens", "lm_head", "v_proj"]),
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


def make_vocab_adapter(model_dir, path, seed, **kwargs):
    """A PEFT adapter whose every LoRA weight is random (PEFT starts one of each pair at zero);
    saved as PEFT saves it, with the embedding and head copies save_embedding_layers adds."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def run_staggered(engine, jobs, sp):
    """The outputs of `jobs` (prompt, adapter), in order: the first half queued, one step
    run, then the rest queued, so a step mixes decode rows and prompts."""
    first = len(jobs) // 2
    rids = [engine.add_request(p, sp, a) for p, a in jobs[:first]]
    done = {o.request_id: o for o in engine.step() if o.finished}
    rids += [engine.add_request(p, sp, a) for p, a in jobs[first:]]
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[r] for r in rids]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_adapters")
    return {kind: {name: make_vocab_adapter(tiny_models(kind), root / f"{kind}-{name}", i, **kw)
                   for i, (name, kw) in enumerate(ADAPTERS.items())}
            for kind in ("llama", "llama_tied_llama3")}


@pytest.fixture(scope="module")
def peft_results(tiny_models, adapters):
    """kind -> {(prompt ids, adapter): PEFT's (tokens, log-probs)}, each run once."""
    cache = {}

    def get(kind, ids, name):
        key = (kind, tuple(ids), name)
        if key not in cache:
            cache[key] = peft_greedy(tiny_models(kind), adapters[kind].get(name), ids, NEW,
                                     DEVICE)
        return cache[key]

    return get


@pytest.mark.parametrize("kind,backend,graphs", [
    ("llama", "torch", False), ("llama_tied_llama3", "torch", False)] +
    [("llama", "triton", True)] * (DEVICE == "cuda"))
def test_vocab_lora_in_one_batch_matches_peft(tiny_models, adapters, peft_results, kind,
                                              backend, graphs):
    """Half the requests arrive a step later, so a step mixes decode rows and prompts. With
    `graphs`, steps run over the CUDA graphs' static padded buffers (eagerly: capture=False),
    as a graph replays them. (On CPU, the Triton kernels of these paths run in
    test_added_tokens_in_one_batch_match_peft.)"""
    model_dir, paths = tiny_models(kind), adapters[kind]
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=128, backend=backend, cuda_graphs=False))
    if graphs:
        engine.runner.graphs = engine.runner.make_graphs(engine.config.max_num_seqs,
                                                         mixed_tokens=64, capture=False)
    for name, path in paths.items():
        engine.add_adapter(name, path)
    assert engine.adapters.get("both").layout.vocab_ranks == (8, 3)
    names = [None, *paths]
    jobs = [(p, a) for p in PROMPTS for a in names]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = run_staggered(engine, jobs, sp)
    if graphs:
        assert {k[-1] for k in engine.runner.graphs.graphs} >= {("qkv", "embed", "lm_head")}
    by_prompt = {}
    for (prompt, name), out in zip(jobs, outs):
        toks, lps = peft_results(kind, engine.tokenizer.encode(prompt), name)
        assert out.token_ids == toks, f"{kind}: adapter {name}, prompt {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"{kind}: adapter {name}, {prompt!r}"
        by_prompt.setdefault(prompt, {})[name] = mine
    for name in names[1:]:  # each adapter changes the log-probs: not base against base
        assert any(lp[name] != pytest.approx(lp[None], abs=1e-3) for lp in by_prompt.values())


def test_vocab_lora_pages_hold_the_larger_of_embed_and_head(tiny_models, adapters):
    """embed_tokens' rows sit in layer 0's slot and lm_head's in the last layer's, from the
    same offset: an adapter on both takes the pages of the larger, past the linear modules."""
    from slora.core.adapters import AdapterLayout
    from slora.config import ModelConfig, round_up

    cfg = ModelConfig.from_dir(tiny_models("llama"))
    v, h = round_up(cfg.vocab_size, 64), round_up(cfg.hidden_size, 64)
    qv = AdapterLayout.uniform(cfg, 4, ("q_proj",))
    both = AdapterLayout.uniform(cfg, 4, ("q_proj", "embed_tokens", "lm_head"))
    assert both.vocab_offsets[0][0] == both.vocab_offsets[1][0] == qv.elems
    assert both.elems == qv.elems + 4 * (v + h)
    assert both.vocab_layers == (0, cfg.num_layers - 1)
    assert both.modules == ("q_proj", "embed_tokens", "lm_head")


@pytest.mark.parametrize("change", ["rows", "lm_head rows", "resized"])
def test_saved_embedding_that_is_not_the_bases_is_refused(tiny_models, adapters, tmp_path,
                                                          change):
    """A copy whose base-vocabulary rows differ from the base model's, or copies of two sizes,
    are refused naming what slora serves; the engine serves the next adapter."""
    import shutil

    model_dir = tiny_models("llama")
    d = tmp_path / "a"
    shutil.copytree(adapters["llama"]["both"], d)
    t = load_file(d / "adapter_model.safetensors")
    key = next(k for k in t if k.endswith(("embed_tokens.base_layer.weight", "lm_head.base_layer.weight"))
               and (k.split(".")[-3] == "lm_head") == (change == "lm_head rows"))
    if change == "resized":
        t[key] = torch.cat([t[key], torch.randn(2, t[key].shape[1])])
    else:
        t[key][3] += 1.0
    save_file(t, d / "adapter_model.safetensors")
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                                 num_pages=32, max_added_tokens=4))
    want = {"rows": "saved embed_tokens differs from the base model's",
            "lm_head rows": "saved lm_head differs from the base model's",
            "resized": "copies hold \\[320, 322\\] rows"}[change]
    with pytest.raises(AdapterError, match=want) as e:
        engine.add_adapter("bad", d)
    assert "slora serves LoRA on embed_tokens and lm_head" in str(e.value)
    engine.add_adapter("good", adapters["llama"]["embed"])  # the engine goes on
    assert engine.generate(["Hello"], SamplingParams(max_tokens=2), adapters="good")[0].token_ids


# ----------------------------------------------------------------------------- added tokens

ADDED = ["<sql>", "</sql>"]


@pytest.fixture(scope="module")
def added(tiny_models, tmp_path_factory):
    """A base model whose vocabulary is its tokenizer's (300), and adapters for it that add
    two tokens: "sql" saved with save_embedding_layers (the resized embedding and head
    copies), "tt" with trainable_token_indices (deltas on the added rows); "qv" an ordinary
    one, "both" with LoRA on embed_tokens and lm_head. The added lm_head rows are the head rows of tokens the base model picks, scaled up,
    so greedy decoding produces added tokens too."""
    import shutil

    import transformers
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("added")
    src = tiny_models("llama")
    base = root / "base"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.resize_token_embeddings(tok.get_vocab_size())
    model.save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, base / f)
    engine = Engine(EngineConfig(model=str(base), device=DEVICE, dtype="float32", num_pages=32))
    picks = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    favourite = [t for out in picks for t in out.token_ids]
    paths = {}
    for i, (name, kw) in enumerate({
            "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "tt": dict(r=4, lora_alpha=8, target_modules=["o_proj"],
                       trainable_token_indices=[300, 301]),
            "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "both": ADAPTERS["both"]}.items()):
        paths[name] = root / name
        torch.manual_seed(i)
        m = transformers.AutoModelForCausalLM.from_pretrained(base)
        if name in ("sql", "tt"):
            m.resize_token_embeddings(302, mean_resizing=False)
            with torch.no_grad():
                w = m.lm_head.weight
                w[300:] = 1.5 * w[torch.tensor(favourite[i:i + 2])]
                m.model.embed_tokens.weight[300:].normal_(0, 0.5)
        pm = peft.get_peft_model(m, peft.LoraConfig(init_lora_weights=False, **kw)) \
            if (peft := __import__("peft")) else None
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n or "lora_embedding" in n or "trainable_tokens_delta" in n:
                    p.normal_(0, 0.3)
        pm.save_pretrained(paths[name], save_embedding_layers=name != "qv")
        if name in ("sql", "tt"):
            t = Tokenizer.from_file(str(base / "tokenizer.json"))
            t.add_tokens(ADDED)
            t.save(str(paths[name] / "tokenizer.json"))
            shutil.copy(base / "tokenizer_config.json", paths[name] / "tokenizer_config.json")
    return base, paths


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_added_tokens_in_one_batch_match_peft(added, backend):
    """Adapters' added tokens in their prompts (their own tokenizers) and produced by greedy
    decoding, in one batch with ordinary adapters, one with LoRA on embed_tokens and lm_head,
    and base rows: PEFT's tokens and log-probs on the resized model, request by request; the
    other rows never produce them. On Triton, steps run over the CUDA graphs' static padded
    buffers (eagerly: capture=False), as a graph replays them; interpreted on CPU, with one
    prompt, fewer tokens and adapters."""
    base, paths = added
    if backend == "triton":
        pytest.importorskip("triton")
    engine = Engine(EngineConfig(model=str(base), device=DEVICE, dtype="float32",
                                 num_pages=64, backend=backend, cuda_graphs=False,
                                 max_added_tokens=4))
    if backend == "triton":
        engine.runner.graphs = engine.runner.make_graphs(engine.config.max_num_seqs,
                                                         mixed_tokens=64, capture=False)
    for name, path in paths.items():
        engine.add_adapter(name, path)
    assert engine.adapters.get("sql").layout.added_tokens == 2
    prompts = ["<sql>The quick brown fox", "Paris is </sql> the"]
    full = DEVICE == "cuda" or backend == "torch"
    names = [None, "sql", "tt", "qv", "both"] if full else [None, "sql", "both"]
    jobs = [(p, a) for p in (prompts if full else prompts[:1]) for a in names]
    new = NEW if full else 3
    sp = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=2)
    outs = run_staggered(engine, jobs, sp)
    if backend == "triton":
        # a captured graph serves the vocabulary paths (one whose groups cover the batch's)
        want = {"qkv", "embed", "lm_head", "added"}
        assert any(want <= set(k[-1]) for k in engine.runner.graphs.graphs)
    produced = set()
    for (prompt, name), out in zip(jobs, outs):
        ids = engine.tokenizer_of(name).encode(prompt)
        assert (max(ids) >= 300) == (name in ("sql", "tt")), (name, ids)  # its own tokenizer
        resize = (lambda m: m.resize_token_embeddings(302, mean_resizing=False)) \
            if name in ("sql", "tt") else None  # (its added rows come from its copies)
        toks, lps = peft_greedy(base, paths.get(name), ids, new, DEVICE, resize)
        assert out.token_ids == toks, f"adapter {name}, prompt {prompt!r}"
        mine = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert mine == pytest.approx(lps, abs=1e-3), f"adapter {name}, {prompt!r}"
        if name in ("sql", "tt"):
            produced |= {t for t in out.token_ids if t >= 300}
            assert any(tok in out.text for tok in ADDED) == bool(set(out.token_ids) & {300, 301})
        else:  # other rows never see them: not produced, not in their top log-probs
            assert all(t < 300 for lp in out.logprobs for t in lp)
    assert produced, "greedy decoding produced an added token"


def test_added_token_ids_with_another_adapter_are_refused(added):
    base, paths = added
    engine = Engine(EngineConfig(model=str(base), device=DEVICE, dtype="float32",
                                 num_pages=64, max_added_tokens=4))
    for name, path in paths.items():
        engine.add_adapter(name, path)
    for adapter in (None, "qv"):
        with pytest.raises(ValueError, match=r"\[300\] are outside the vocabulary \[0, 300\) "
                           "of the base model.*served only with that adapter"):
            engine.add_request([5, 300, 6], SamplingParams(max_tokens=2), adapter)
    with pytest.raises(ValueError, match=r"\[302\].*adapter 'sql''s 2 added tokens"):
        engine.add_request([5, 302], SamplingParams(max_tokens=2), "sql")
    out = engine.generate([[5, 300, 6]], SamplingParams(max_tokens=2), adapters="sql")[0]
    assert out.finish_reason == "length"
    small = Engine(EngineConfig(model=str(base), device=DEVICE, dtype="float32", num_pages=64))
    with pytest.raises(AdapterError, match="adds 2 tokens .*max_added_tokens is 0"):
        small.add_adapter("sql", paths["sql"])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager(added):
    """Vocabulary LoRA and added tokens inside captured CUDA graphs (decode and mixed steps):
    the eager engine's tokens."""
    base, paths = added
    jobs = [(p, a) for p in ("<sql>The quick brown fox", "Paris is </sql> the")
            for a in (None, "sql", "tt", "qv", "both")]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(base), device="cuda", dtype="float32",
                                     num_pages=64, max_added_tokens=4, cuda_graphs=graphs,
                                     mixed_graph_tokens=64))
        for name, path in paths.items():
            engine.add_adapter(name, path)
        results[graphs] = [o.token_ids for o in run_staggered(engine, jobs, sp)]
        if graphs:
            assert {k[0] for k in engine.runner.graphs.graphs} == {"decode", "mixed"}
    assert results[True] == results[False]


def test_served_prompts_and_token_texts_use_the_adapters_tokenizer(added):
    """Over HTTP (OpenAI and LoRAX routes), an adapter's prompt is encoded with its own
    tokenizer and its added tokens' texts are its own: the in-process engine's tokens, text
    and prompt length."""
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    import httpx

    from slora.async_engine import AsyncEngine
    from slora.server.app import build_app
    from slora.server.settings import ServerSettings
    from slora.server.testing import serve_in_thread

    base, paths = added
    cfg = EngineConfig(model=str(base), device="cpu", dtype="float32", num_pages=64,
                       max_added_tokens=4)
    reference = Engine(cfg)
    reference.add_adapter("sql", paths["sql"])
    prompts = ["<sql>The quick brown fox", "Paris is </sql> the"]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=1)
    wants = reference.generate(prompts, sp, adapters="sql")
    engine = AsyncEngine(cfg)
    try:
        engine.add_adapter("sql", paths["sql"])
        with serve_in_thread(build_app(engine, ServerSettings(model_name="base"))) as live:
            answers = [(httpx.post(f"{live.url}/v1/completions", json={
                "model": "sql", "prompt": p, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}).json(),
                httpx.post(f"{live.url}/generate", json={"inputs": p, "parameters": {
                    "adapter_id": "sql", "max_new_tokens": NEW, "ignore_eos_token": True,
                    "details": True}}).json()) for p in prompts]
    finally:
        engine.shutdown()
    tokenizer = reference.tokenizer_of("sql")
    for (oa, lx), want in zip(answers, wants):
        assert oa["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert max(want.prompt_token_ids) >= 300  # "<sql>" / "</sql>" as one added token
        choice = oa["choices"][0]
        assert choice["text"] == want.text == lx["generated_text"]
        assert choice["logprobs"]["tokens"] == [
            tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert [t["id"] for t in lx["details"]["tokens"]] == want.token_ids
        assert [t["text"] for t in lx["details"]["tokens"]] == choice["logprobs"]["tokens"]
    assert any(t >= 300 for want in wants for t in want.token_ids)  # added tokens came out
