"""Engine API behaviour on a tiny model: sampling knobs, stops, streaming, errors, stats."""

import pytest

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ConfigError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                               num_pages=64))


def test_generate_accepts_strings_ids_and_per_prompt_params(engine):
    ids = engine.tokenizer.encode("Hello world")
    outs = engine.generate(["Hello world", ids],
                           [SamplingParams(max_tokens=5, ignore_eos=True),
                            SamplingParams(max_tokens=3, ignore_eos=True)])
    assert len(outs[0].token_ids) == 5 and len(outs[1].token_ids) == 3
    assert outs[0].token_ids[:3] == outs[1].token_ids  # same prompt, greedy
    assert outs[0].text == engine.tokenizer.decode(outs[0].token_ids)
    m = outs[0].metrics
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finish_time


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(engine):
    sp = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    a = engine.generate("The quick", sp)[0].token_ids
    b = engine.generate("The quick", sp)[0].token_ids
    c = engine.generate("The quick", SamplingParams(max_tokens=12, temperature=1.5, seed=8,
                                                    ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate("Paris is", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    topk = engine.generate("Paris is", SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                      seed=1, ignore_eos=True))[0]
    tiny_p = engine.generate("Paris is", SamplingParams(max_tokens=8, temperature=2.0,
                                                        top_p=1e-6, seed=1, ignore_eos=True))[0]
    assert greedy.token_ids == topk.token_ids == tiny_p.token_ids


def test_stop_token_ids_and_strings(engine):
    full = engine.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    out = engine.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"
    stop = full.text[len(full.text) // 2:][:3]
    if stop.strip():
        out = engine.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True, stop=stop))[0]
        assert out.finish_reason == "stop" and stop not in out.text
        assert full.text.startswith(out.text)


def test_eos_stops_unless_ignored(engine):
    eos = engine.eos_token_ids[0]
    full = engine.generate("Hello", SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert eos not in full.token_ids or full.finish_reason == "length"


def test_stream_yields_each_token(engine):
    outs = list(engine.stream("Berlin is", SamplingParams(max_tokens=4, ignore_eos=True)))
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4]
    assert outs[-1].finished and not outs[0].finished


def test_add_request_and_step_loop(engine):
    rid = engine.add_request("The quick", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [rid]


def test_unknown_adapter_is_a_clear_error_and_engine_keeps_serving(engine):
    with pytest.raises(KeyError, match="unknown adapter 'nope'"):
        engine.generate("Hello", adapters="nope")
    assert not engine.has_unfinished()
    assert len(engine.generate("Hello", SamplingParams(max_tokens=2))[0].token_ids) >= 1


def test_adapters_past_max_lora_rank_are_refused(tiny_model_dir, adapter_factory):
    """EngineConfig.max_lora_rank bounds every module's rank (rank_pattern's too) at
    registration, naming the adapter, its rank and the limit; adapters within it serve."""
    from slora.model.loader import AdapterError

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=32, max_lora_rank=8))
    e.add_adapter("r8", adapter_factory(tiny_model_dir, r=8))
    big = adapter_factory(tiny_model_dir, r=4, rank_pattern={"v_proj": 12})
    with pytest.raises(AdapterError, match=r"adapter 'r12': its rank 12 is past "
                       r"EngineConfig.max_lora_rank=8; raise max_lora_rank"):
        e.add_adapter("r12", big)
    with pytest.raises(AdapterError, match="its rank 16 is past"):
        e.add_synthetic_adapter("s16", 16)
    assert e.list_adapters() == ["r8"]
    out = e.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), adapters="r8")[0]
    assert out.finish_reason == "length"
    with pytest.raises(ConfigError, match="max_lora_rank.*at least 1"):
        EngineConfig(max_lora_rank=0)


def test_too_long_prompt_fails_alone(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=4, block_size=16))
    outs = e.generate([list(range(2, 100)), "Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3


def test_max_model_len_past_the_model_or_the_pool_is_refused(tiny_model_dir):
    kw = dict(model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=16)
    with pytest.raises(ConfigError, match=r"max_model_len=257: past the model's context window "
                       r"\(256: max_position_embeddings 256\)"):
        Engine(EngineConfig(max_model_len=257, num_pages=64, **kw))
    with pytest.raises(ConfigError, match=r"max_model_len=200: the pool holds 64 tokens "
                       r"\(4 pages of 16\); raise num_pages"):
        Engine(EngineConfig(max_model_len=200, num_pages=4, **kw))
    # unset: the model's window, capped by the pool; set within both: as set
    assert Engine(EngineConfig(num_pages=4, **kw)).max_model_len == 64
    assert Engine(EngineConfig(num_pages=64, **kw)).max_model_len == 256
    assert Engine(EngineConfig(max_model_len=100, num_pages=64, **kw)).max_model_len == 100


def test_bad_inputs_are_clear_errors(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=3)
    with pytest.raises(ConfigError, match=r"gemm_max_rows=-1: must be >= 0"):
        EngineConfig(gemm_max_rows=-1)
    with pytest.raises(ConfigError, match=r"host_threads=-1: must be >= 0"):
        EngineConfig(host_threads=-1)
    with pytest.raises(ConfigError, match=r"decode_lora='sgmv': expected one of \('auto', "
                                          r"'mbgmv', 'segments', 'hybrid'\)"):
        EngineConfig(decode_lora="sgmv")
    with pytest.raises(ConfigError, match=r"max_num_seqs=70000: must be in \[1, 65535\]"):
        EngineConfig(max_num_seqs=70000)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**6])


def test_logprobs_hold_top_n_and_chosen(engine):
    out = engine.generate("Hello", SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token


def test_stats_keys(engine):
    s = engine.stats()
    for k in ("pages_total", "pages_free", "pages_kv", "pages_adapter", "adapter_loads",
              "adapter_evictions", "preemptions"):
        assert k in s
    assert (s["pages_free"] + s["pages_kv"] + s["pages_adapter"] + s["pages_cached"]
            == s["pages_total"])


def test_cuda_backend_on_cpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="backend='cuda'.*CUDA device"):
        Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", backend="cuda", num_pages=8))


def test_abort_returns_a_final_output_and_frees_pages(engine):
    rid = engine.add_request("The quick", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[rid].finished and outs[rid].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.stats()["pages_kv"] == 0


def test_incremental_text_matches_full_decode(engine):
    """Streamed texts grow by appending and end as the full decode, even for random bytes."""
    sp = SamplingParams(max_tokens=40, temperature=3.0, seed=3, ignore_eos=True)
    outs = list(engine.stream("Hello", sp))
    final = outs[-1]
    assert final.text == engine.tokenizer.decode(final.token_ids)
    for a, b in zip(outs, outs[1:-1]):
        assert b.text.startswith(a.text)


def test_close_frees_the_pool_at_once(tiny_model_dir):
    """close() hands the pool back now: an engine built next sizes its pool from free memory
    (on a GPU) and must not find the last one's still held."""
    import weakref

    eng = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=64))
    eng.add_synthetic_adapter("a", 4)
    eng.warmup()  # freezes what exists (gc.freeze): close() must collect it all the same
    eng.generate(["hello"], SamplingParams(max_tokens=2), adapters="a")
    pool = weakref.ref(eng.runner.pool)
    eng.close()
    assert pool() is None


def test_adapter_copies_fill_scattered_pages_of_several_adapters(tiny_model_dir, adapter_factory):
    """One load call of two adapters whose pages are scattered and interleaved (as they are
    once KV pages and evictions have cut the pool up): each page holds its adapter's rows in
    every layer, in the adapter's page order, and no other page is written."""
    import torch

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=40))
    e.add_adapter("a", adapter_factory(tiny_model_dir, r=8, target_modules="all-linear"))
    e.add_adapter("b", adapter_factory(tiny_model_dir, r=4, target_modules=["q_proj"], seed=1))
    runner, info = e.runner, e.adapters.adapters
    na, nb = info["a"].num_pages, info["b"].num_pages
    assert na > 2 and nb >= 1
    pages_a = [3 * i + 1 for i in range(na)][::-1]  # not consecutive, descending
    pages_b = [3 * i + 2 for i in range(nb)]  # between a's pages
    runner.host_tier.load([("a", pages_a), ("b", pages_b)], e.adapters, lambda layer: None)
    L, _, ps = runner.pool.shape
    for name, pages in (("a", pages_a), ("b", pages_b)):
        host = runner.host_tier.host_copy(info[name], e.adapters).view(L, len(pages), ps)
        assert host.abs().sum() > 0
        assert torch.equal(runner.pool[:, pages], host)
    others = sorted(set(range(runner.pool.shape[1])) - set(pages_a) - set(pages_b))
    assert runner.pool[:, others].abs().sum() == 0


def test_adapter_reads_run_on_the_tiers_read_threads(tiny_model_dir, adapter_factory):
    """HostAdapterTier.read_threads: an adapter's read (its packing into pages) runs on that
    many intra-op threads, and the step's host work on the count set before and after it."""
    import torch

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=40))
    e.add_adapter("a", adapter_factory(tiny_model_dir, r=8, target_modules=["q_proj"]))
    info, tier = e.adapters.adapters["a"], e.runner.host_tier
    seen, pack = [], info.pack

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return pack(*args, **kwargs)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        object.__setattr__(info, "pack", counted)
        tier.read_threads = 2
        host = tier.host_copy(info, e.adapters)
        assert seen == [2] and torch.get_num_threads() == 1
        assert torch.equal(host, pack(e.runner.pool.shape[2], e.runner.dtype))
    finally:
        torch.set_num_threads(before)


def test_host_threads_remember_the_count_torch_had(monkeypatch):
    """set_host_threads: each engine sets its own count; every one of them gets back the
    count torch had before the first did, for its adapter reads."""
    import torch

    from slora.runner import device

    monkeypatch.setattr(device, "_torch_threads", [])
    before = torch.get_num_threads()
    try:
        assert device.set_host_threads(1) == before and torch.get_num_threads() == 1
        assert device.set_host_threads(2) == before and torch.get_num_threads() == 2
        assert device.set_host_threads(0) == before and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_adapter_copies_in_pieces_of_layers_fill_the_same_pages(tiny_model_dir, adapter_factory):
    """A step's own adapter loads go a piece of layers at a time on the GPU, the forward
    waiting for each piece (HostAdapterTier.load_for_step): the pieces, copied one after another,
    leave the pool as the whole copy does, and each piece is announced once, in layer order."""
    import torch

    from slora.graphs import piece_starts

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=32))
    e.add_adapter("a", adapter_factory(tiny_model_dir, r=8, target_modules="all-linear"))
    pages = e.adapters.load("a")
    runner = e.runner
    runner.host_tier.load([("a", pages)], e.adapters)
    whole = runner.pool.clone()
    assert whole[:, pages].abs().sum() > 0
    runner.pool[:, pages] = 0
    seen = []
    runner.host_tier.load([("a", pages)], e.adapters, seen.append)
    assert seen == piece_starts(e.model_config.num_layers) and len(seen) > 1
    assert torch.equal(runner.pool, whole)


def test_a_steps_adapter_copies_are_queued_after_its_inputs(tiny_model_dir, adapter_factory):
    """ModelRunner.launch queues a step's own adapter loads and its prefetches after the
    step's inputs (on the GPU the copy engine would otherwise serve a whole adapter before
    the uploads the forward waits for), and the forward after its own loads."""
    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=64, prefetch_window=4))
    for i in range(3):
        e.add_adapter(f"a{i}", adapter_factory(tiny_model_dir, r=4, seed=i))
    runner, calls = e.runner, []
    parts = {"prepare": runner.batches, "_ids_from_prev": runner, "load_for_step": runner.host_tier,
             "_forward": runner, "prefetch": runner.host_tier}
    for name, part in parts.items():
        def logged(*args, _name=name, _f=getattr(part, name)):
            if _name not in ("load_for_step", "prefetch") or args[0]:  # copies, not none
                calls.append(_name)
            return _f(*args)
        setattr(part, name, logged)
    out = e.generate(["hi"] * 3, adapters=["a0", "a1", "a2"])
    assert len(out) == 3 and "load_for_step" in calls
    for i, name in enumerate(calls):
        if name in ("load_for_step", "prefetch"):
            assert "_ids_from_prev" in calls[:i] and calls[:i].count("prepare") > calls[:i].count("_forward")
        if name == "_forward":
            assert calls[i - 1] in ("load_for_step", "_ids_from_prev")


def test_the_forward_cut_into_pieces_of_layers_gives_the_same_logits(tiny_model_dir):
    """`LlamaModel.layers` over consecutive ranges, between `embed` and `head`, as the eager
    step waiting for its adapter copies and the graph captures run it, equals `forward`."""
    import torch

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=32))
    e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=2))
    e.add_request([9, 10, 11], SamplingParams(max_tokens=2))
    plan = e.scheduler.schedule(0.0)
    runner, model = e.runner, e.runner.model
    batch = runner.batches.prepare(plan, e.adapters)
    whole = model.forward(batch, runner.pool)
    for cuts in ([0, 1], [0]):
        hidden = model.embed(batch, runner.pool)
        for start, end in zip(cuts, cuts[1:] + [model.num_layers]):
            hidden = model.layers(batch, runner.pool, hidden, start, end)
        assert torch.equal(model.head(batch, hidden, runner.pool), whole)
