"""The engine on the Triton backend (interpreted on CPU, real on CUDA) gives the torch
backend's tokens for a mixed batch: decode + prefill rows, several adapters, base-only rows."""

import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from slora import Engine, EngineConfig, SamplingParams  # noqa: E402
from slora.graphs import GRAPH_PIECES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _backends():
    """torch (the twins) first; the csrc CUDA MBGMV too where a GPU and cupy are present."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return ("torch", "triton")
    return ("torch", "triton", "cuda") if DEVICE == "cuda" else ("torch", "triton")


BACKENDS = _backends()


@pytest.mark.parametrize("dtype", ["float32", "float16"] if DEVICE == "cpu" else ["float32", "bfloat16"])
def test_triton_backend_matches_torch_backend(tiny_model_dir, adapter_factory, dtype):
    """Every backend gives the twins' tokens."""
    paths = {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
             "r20": adapter_factory(tiny_model_dir, r=20, target_modules="all-linear", seed=1)}
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France.", "Berlin"]
    adapters = ["r3", None, "r20", "r3"]
    results = {}
    # the Triton backend's decode LoRA every way: MBGMV (or the table's split), the rows
    # grouped by adapter, and both kernels over their shares of the rows
    runs = [(b, "auto") for b in BACKENDS] + [("triton", "segments"), ("triton", "hybrid")]
    for backend, decode_lora in runs:
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype=dtype,
                                num_pages=48, backend=backend, decode_lora=decode_lora,
                                cuda_graphs=False))
        for n, p in paths.items():
            e.add_adapter(n, p)
        sps = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in (6, 3, 8, 5)]
        jobs = list(zip(prompts, sps, adapters))
        ids = [e.add_request(*job) for job in jobs[:2]]
        done = {o.request_id: o for o in e.step() if o.finished}
        # the next step mixes the first two's decode rows with the last two's prefill
        ids += [e.add_request(*job) for job in jobs[2:]]
        while e.has_unfinished():
            done.update({o.request_id: o for o in e.step() if o.finished})
        results[backend, decode_lora] = [done[i] for i in ids]
    torch_run = results["torch", "auto"]
    for a, b in (pair for run in runs[1:] for pair in zip(torch_run, results[run])):
        if dtype == "float32":
            assert a.token_ids == b.token_ids
        la = [lp[t] for lp, t in zip(a.logprobs, a.token_ids)]
        lb = [lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
        n = min(len(la), len(lb), 1)  # first token: same inputs in both, compare closely
        # Two correct implementations round at different points. Measured between the twin
        # and the Triton backend on this tiny model (large random weights): fp16 <= 0.004,
        # bf16 (8-bit mantissa) up to 0.11 in the first token's log-prob.
        tol = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 0.2}[dtype]
        assert la[:n] == pytest.approx(lb[:n], abs=tol)


@pytest.mark.parametrize("dtype", ["float32"] if DEVICE == "cpu" else ["float32", "bfloat16"])
def test_lora_rows_added_by_the_next_kernel_give_the_same_logprobs(tiny_model_dir,
                                                                   adapter_factory, dtype,
                                                                   monkeypatch):
    """A decode step hands qkv's, o's, gate_up's and down's LoRA rows to the rotary + K/V
    store, the residual add, the GLU and the next layer's residual add (`backend.Pending`)
    instead of adding them in the expand: the same tokens and log-probs, exactly, with a base
    row and adapters of two ranks."""
    from slora.kernels import backend

    paths = [adapter_factory(tiny_model_dir, r=r, target_modules="all-linear", seed=r)
             for r in (4, 16)]
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France."]
    seen, ln1, handed = [], set(), []
    ready = backend.TritonBackend._ready
    add_rms_norm = backend.TritonBackend.add_rms_norm

    def counting(self, t):
        seen.append(isinstance(t, backend.Pending))
        return ready(self, t)

    def noting(self, x, delta, weight, eps, feeds=None, **kw):
        # a layer's first residual add (before its ln1) takes the layer before's down
        handed.append(weight.data_ptr() in ln1 and isinstance(delta, backend.Pending))
        return add_rms_norm(self, x, delta, weight, eps, feeds, **kw)

    def run():
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype=dtype,
                                num_pages=48, backend="triton"))
        ln1.update(lw.ln1.data_ptr() for lw in e.runner.model.w.layers)
        for i, p in enumerate(paths):
            e.add_adapter(f"a{i}", p)
        outs = e.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0),
                          adapters=["a1", None, "a0"])
        e.close()
        return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)])
                for o in outs]

    monkeypatch.setattr(backend.TritonBackend, "_ready", counting)
    monkeypatch.setattr(backend.TritonBackend, "add_rms_norm", noting)
    deferred = run()
    assert any(seen)  # the decode steps handed their rows on
    assert any(handed)  # down's among them, to the next layer
    linear_lora = backend.TritonBackend.linear_lora
    monkeypatch.setattr(backend.TritonBackend, "linear_lora",
                        lambda self, *a, defer=False: linear_lora(self, *a, defer=False))
    seen.clear()
    assert run() == deferred
    assert not any(seen)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("decode_lora", ["auto", "segments", "hybrid"])
def test_cuda_graphs_match_eager(tiny_model_dir, adapter_factory, decode_lora):
    paths = {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
             "r40": adapter_factory(tiny_model_dir, r=40, target_modules="all-linear", seed=1)}
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France.", "Berlin", "I"]
    adapters = ["r3", None, "r40", "r3", None]
    results = {}
    for graphs in (False, True):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16",
                                num_pages=64, cuda_graphs=graphs, decode_lora=decode_lora))
        for n, p in paths.items():
            e.add_adapter(n, p)
        sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 3, 12, 5, 7)]
        results[graphs] = [o.token_ids for o in e.generate(prompts, sps, adapters=adapters)]
        if graphs:
            assert e.runner.graphs.graphs, "decode steps ran through captured graphs"
            # (the segmented path's decode graphs hold the rows grouped by adapter, the
            # hybrid's both kernels)
            for path in ("segments", "hybrid"):
                assert ((decode_lora == path)
                        == any(k[0] == path for k in e.runner.graphs.graphs))
            # each step's graph in pieces of consecutive layers (a 2-layer model: 2)
            n = min(GRAPH_PIECES, e.model_config.num_layers)
            assert all(len(pieces) == n for pieces, _, _ in e.runner.graphs.graphs.values())
    assert results[True] == results[False]


@pytest.mark.skipif(DEVICE != "cuda", reason="the host threads are set for a GPU engine")
def test_a_gpu_engine_runs_its_host_work_on_host_threads(tiny_model_dir):
    """EngineConfig.host_threads: an engine on a GPU sets torch's intra-op threads (its host
    work is small metadata tensors); 0 leaves them as they were."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", num_pages=64,
                            cuda_graphs=False, host_threads=0))
        assert torch.get_num_threads() == 3
        Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", num_pages=64,
                            cuda_graphs=False))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graphs_share_one_working_set_and_one_logits_buffer(tiny_model_dir, adapter_factory):
    """The warm-up's graphs (decode and mixed buckets, with and without an adapter) hold one
    capture's working set between them, not one each: every capture allocates from one pool
    on one stream, so each reuses what the captures before it freed. Each graph's logits are
    rows of one shared buffer."""
    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16",
                            num_pages=64, max_num_seqs=64, mixed_graph_tokens=64))
    e.add_adapter("r8", adapter_factory(tiny_model_dir, r=8, target_modules="all-linear"))
    e.warmup()
    g = e.runner.graphs
    assert len(g.graphs) >= 20
    shared = g.logits.untyped_storage().data_ptr()
    assert all(logits.untyped_storage().data_ptr() == shared
               for _, logits, _ in g.graphs.values())
    segments = [s for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == tuple(g.mempool)]
    # A capture that could not reuse the pool's freed blocks took at least one segment of its
    # own (2 MiB, the allocator's smallest; every tensor here is under 1 MiB, so no larger
    # segment is made): the graphs' pool stays well under one a graph.
    assert sum(s["total_size"] for s in segments) < len(g.graphs) * (2 << 20) // 4


@pytest.mark.skipif(DEVICE != "cuda", reason="the copy stream is the GPU's")
@pytest.mark.parametrize("graphs", [False, True])
def test_each_piece_of_layers_waits_for_its_adapter_copies(tiny_model_dir, adapter_factory,
                                                           graphs):
    """A step's own adapter loads run on the copy stream beside its forward, each piece of
    layers waiting for its own layers' copies (HostAdapterTier.load_for_step). With the copy
    stream held up ~20 ms before every piece's copies, a piece that ran before its copies
    landed would read pages without the adapter's weights: the tokens must still be those of
    the same weights loaded before (under other names, which captured the graphs), and
    differ from the base model's."""
    paths = {"8": adapter_factory(tiny_model_dir, r=8, target_modules="all-linear", seed=3),
             "24": adapter_factory(tiny_model_dir, r=24, target_modules=["q_proj", "o_proj"],
                                   seed=4)}
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France."]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                            num_pages=96, cuda_graphs=graphs))
    for n, p in paths.items():
        e.add_adapter("a" + n, p)
        e.add_adapter("b" + n, p)
    base = [o.token_ids for o in e.generate(prompts, sp)]
    first = [o.token_ids for o in e.generate(prompts, sp, adapters=["a8", "a24", "a8"])]
    captured = dict(e.runner.graphs.graphs) if graphs else {}
    load, pieces = e.runner.host_tier.load, []

    def slow(loads, adapters, on_piece=None):
        if on_piece is None:
            return load(loads, adapters)
        torch.cuda._sleep(40_000_000)  # on the copy stream: before the first piece's copies

        def later(layer):
            on_piece(layer)
            pieces.append(layer)
            torch.cuda._sleep(40_000_000)  # and before every later piece's

        return load(loads, adapters, later)

    e.runner.host_tier.load = slow
    again = [o.token_ids for o in e.generate(prompts, sp, adapters=["b8", "b24", "b8"])]
    assert pieces == [0, 1], "the step loaded b8 and b24 itself, in the 2-layer model's pieces"
    if graphs:
        assert e.runner.graphs.graphs == captured, "the step replayed graphs captured before"
    assert again == first != base


def _staggered_run(e, paths, max_tokens=(7, 3, 9, 5, 6)):
    """Requests that arrive a step apart, so most steps mix prompts with decode rows: several
    adapters of different ranks and targets, and base-only rows."""
    for n, p in paths.items():
        e.add_adapter(n, p)
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France.", "Berlin", "I",
               list(range(3, 60))]  # the last: more tokens than the mixed graphs take (eager)
    adapters = ["r3", None, "r20", "r3", None, "r20"]
    jobs = [(p, SamplingParams(max_tokens=n, ignore_eos=True), a)
            for p, n, a in zip(prompts, max_tokens + (4,), adapters)]
    ids, done = [], {}
    for job in jobs:
        ids.append(e.add_request(*job))
        done.update({o.request_id: o for o in e.step() if o.finished})
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return [done[i].token_ids for i in ids]


def test_step_graph_buffers_match_eager(tiny_model_dir, adapter_factory):
    """The static, padded buffers the CUDA graphs replay over (slora.graphs.StepGraphs), run
    eagerly here (capture=False: on CPU there are no graphs; on a GPU too, as the same
    check), give the eager batch's tokens.
    Decode steps pad rows to a batch bucket; mixed steps pad tokens to a token bucket and
    sequences to a sequence bucket, the prefill kernels walking the prompts' work tiles. With
    decode_lora "segments" (and "auto" where rows share adapters) the decode rows of both kinds
    of step run grouped by adapter, in the bucket's segment buffers; with "hybrid" beside
    MBGMV over the rest, in the bucket's buffer of their adapter rows.
    Every host tensor a step's inputs are copied from is contiguous: on a GPU a non-contiguous
    one is first gathered into pageable memory, whose copy may wait for the running step."""
    from torch.overrides import TorchFunctionMode

    sources = []  # each host source's contiguity, in feed's copies

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_ and args[1].device.type == "cpu":
                sources.append(args[1].is_contiguous())
            return func(*args, **(kwargs or {}))

    def spied(feed):
        def run(*args, **kwargs):
            with Copies():
                return feed(*args, **kwargs)
        return run

    paths = {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
             "r20": adapter_factory(tiny_model_dir, r=20, target_modules="all-linear", seed=1)}
    results = {}
    for graphs, decode_lora in ((False, "auto"), (True, "auto"), (True, "segments"),
                                (True, "hybrid")):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                                num_pages=48, backend="triton", cuda_graphs=False,
                                decode_lora=decode_lora))
        captured = []  # the module groups of each graph, as it is made
        if graphs:
            g = e.runner.graphs = e.runner.make_graphs(e.config.max_num_seqs, mixed_tokens=48,
                                                       capture=False)
            capture = g._capture
            g._capture = lambda *args: captured.append(args[-1]) or capture(*args)
            g.feed = spied(g.feed)
        results[graphs, decode_lora] = _staggered_run(e, paths)
        if graphs:
            kinds = {key[0] for key in e.runner.graphs.graphs}
            # ("auto" groups the decode rows of the adapters that have enough of them, by the
            # table; "segments" those of every step with an adapter, "hybrid" too beside
            # MBGMV: decode steps and mixed steps, keyed apart from MBGMV's)
            by_adapter = ("segments", "hybrid")
            assert kinds <= {"decode", "mixed", *by_adapter,
                             *(f"mixed-{p}" for p in by_adapter)}, kinds
            assert {k for k in kinds if k.startswith("mixed")}, kinds
            if decode_lora != "auto":
                assert {decode_lora, f"mixed-{decode_lora}"} <= kinds, kinds
            # a mixed bucket pads both: more tokens and more sequences than any step had
            mixed = [k for k in e.runner.graphs.graphs if k[0].startswith("mixed")]
            assert all(k[1] in (16, 32, 48) and k[2] in (4, 16) for k in mixed)
            # a graph holds the LoRA kernels of its batch's module groups only: q/k/v where r3
            # (q and v) is the only adapter, all four groups beside r20 (every module)
            assert {("qkv",), ("qkv", "o", "gate_up", "down")} <= set(captured), captured
            for key, (_, _, batch) in e.runner.graphs.graphs.items():
                assert (tuple(batch.lora.groups) if batch.lora else ()) == key[-1], key
    eager = results.pop((False, "auto"))
    assert all(tokens == eager for tokens in results.values())
    assert sources and all(sources), sources


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_mixed_step_graphs_match_eager(tiny_model_dir, adapter_factory):
    """The same staggered workload with mixed steps replaying captured graphs."""
    paths = {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
             "r20": adapter_factory(tiny_model_dir, r=20, target_modules="all-linear", seed=1)}
    results = {}
    for tokens in (0, 64):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                num_pages=64, mixed_graph_tokens=tokens))
        results[tokens] = _staggered_run(e, paths)
        if tokens:
            assert any(k[0] == "mixed" for k in e.runner.graphs.graphs)
    assert results[64] == results[0]


def test_warmup_fills_every_mixed_graph_bucket(tiny_model_dir):
    """With mixed-step graphs on, `Engine.warmup` runs one prefill step per (token bucket,
    sequence bucket), so serving does not stop to capture them."""

    e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                            num_pages=48, backend="triton", cuda_graphs=False, max_num_seqs=4))
    e.runner.graphs = e.runner.make_graphs(4, mixed_tokens=32, capture=False)
    # (tokens, prompts) of each warm-up step
    assert e.runner.graphs.mixed_buckets(e.config.max_batch_tokens) == [(16, 1), (32, 1)]
    e.warmup()
    gc.unfreeze()  # (warmup froze the objects it found; the suite goes on collecting them)
    mixed = {k[1:3] for k in e.runner.graphs.graphs if k[0] == "mixed"}
    assert mixed == {(16, 4), (32, 4)}
    assert {k[1] for k in e.runner.graphs.graphs if k[0] == "decode"} == {1, 2, 4}


def test_warmup_captures_every_decode_lora_path(tiny_model_dir):
    """With decode_lora "auto" the path of a step's decode rows' LoRA is chosen per step, and
    a graph is keyed by it: the warm-up captures each adapter bucket, decode and mixed, under
    MBGMV, under the rows grouped by adapter and under both (the base model's under MBGMV: it
    has no LoRA)."""
    e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                            num_pages=64, backend="triton", cuda_graphs=False, max_num_seqs=2,
                            mixed_graph_tokens=16))
    e.add_synthetic_adapter("a", 8, ["q_proj", "v_proj"])
    e.runner.graphs = e.runner.make_graphs(2, mixed_tokens=16, capture=False)
    e.warmup()
    gc.unfreeze()
    assert e.runner.batches.decode_lora == "auto"  # (set back after the forced steps)
    keys = e.runner.graphs.graphs
    decode = {k[:3] for k in keys if not k[0].startswith("mixed")}
    assert decode == {(kind, b, r) for kind in ("decode", "segments", "hybrid") for b in (1, 2)
                      for r in (16,)} | {("decode", 1, 0), ("decode", 2, 0)}
    mixed = {(k[0], k[3]) for k in keys if k[0].startswith("mixed")}  # (kind, rank bucket)
    assert mixed == {("mixed", 0), ("mixed", 16), ("mixed-segments", 16), ("mixed-hybrid", 16)}


def test_warmup_captures_every_mixed_bucket_a_step_can_reach(tiny_model_dir):
    """Every (token, sequence) bucket a step with a prompt can take, those whose sequence
    bucket the token bucket caps included ((16, 16): 13 tokens over 6 sequences), is captured
    by the warm-up, at each rank bucket: serving never stops to capture one. (A step of t
    one-token prompts runs as decode rows, so the warm-up's steps hold a longer prompt.)"""
    from slora.config import bucket
    from slora.graphs import round_rank

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=512, cuda_graphs=False, max_num_seqs=64))
    e.add_synthetic_adapter("a", 8)
    graphs = e.runner.graphs = e.runner.make_graphs(64, mixed_tokens=64, capture=False)
    e.warmup()
    gc.unfreeze()
    captured = {k[1:4] for k in graphs.graphs if k[0] == "mixed"}
    for n_tok in range(2, 65):
        for n_seq in range(1, n_tok):  # at least one prompt of two tokens or more
            t = bucket(n_tok, graphs.token_buckets)
            for rank in (0, round_rank(8)):
                key = (t, min(bucket(n_seq, graphs.seq_buckets), t), rank)
                assert key in captured, (n_tok, n_seq, rank)


def test_warmup_captures_the_module_groups_of_the_adapters(tiny_model_dir):
    """Graphs are keyed by the module groups their batch's adapters target, so the warm-up
    captures each group set in use: the registered adapters' and those `modules` names for
    adapters to come (every group when only their ranks are known), and their union, whose
    graphs serve a batch that mixes them."""

    def warmed(register=(), **kw):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                num_pages=256, cuda_graphs=False, max_num_seqs=2))
        for i, modules in enumerate(register):
            e.add_synthetic_adapter(f"a{i}", 8, modules)
        e.runner.graphs = e.runner.make_graphs(2, capture=False)
        e.warmup(**kw)
        gc.unfreeze()
        assert not e.adapters.adapters.keys() - {f"a{i}" for i in range(len(register))}
        return {k[-1] for k in e.runner.graphs.graphs}

    every = ("qkv", "o", "gate_up", "down")
    assert warmed([["q_proj", "v_proj", "o_proj"]]) == {(), ("qkv", "o")}
    assert warmed([["q_proj"], ["down_proj"]]) == {(), ("qkv",), ("down",), ("qkv", "down")}
    assert warmed(ranks=[8], modules=[["q_proj", "k_proj", "v_proj", "o_proj"]]) == {(), ("qkv", "o")}
    assert warmed(ranks=[8]) == {(), every}
    assert warmed() == {()}


def test_a_batch_without_a_graph_of_its_groups_replays_one_holding_more(tiny_model_dir):
    """Once a batch of a q/k/v/o adapter has its graph, an adapter of o alone, and a batch
    mixing the two, replay that graph (its other groups at rank 0) with the tokens of eager
    steps: nothing more is captured."""

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    out = {}
    for graphs in (False, True):
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                                num_pages=64, backend="triton", cuda_graphs=False))
        e.add_synthetic_adapter("qkvo", 8, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
        e.add_synthetic_adapter("o", 8, ["o_proj"], seed=2)
        if graphs:
            e.runner.graphs = e.runner.make_graphs(e.config.max_num_seqs, capture=False)
        out[graphs] = [[o.token_ids for o in e.generate(prompts, sp, adapters=names)]
                       for names in (["qkvo", "qkvo"], ["o", "o"], ["o", "qkvo"])]
        if graphs:
            assert {k[-1] for k in e.runner.graphs.graphs} == {("qkv", "o")}
    assert out[True] == out[False]


def test_warmup_runs_eager_steps_past_the_mixed_graphs(tiny_model_dir):
    """Past `mixed_graph_tokens` steps run eagerly, and a Triton kernel compiles again for each
    new class of its integer arguments: the warm-up runs, at each rank bucket, a step of one
    prompt of odd length, one of two prompts (a multiple of 16 tokens) and a mixed step (a
    decode row beside a prompt), all past the graphs."""

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=256, cuda_graphs=False, max_num_seqs=8))
    e.add_synthetic_adapter("a", 8)
    graphs = e.runner.graphs = e.runner.make_graphs(8, mixed_tokens=32, capture=False)
    # The torch twins are not written for a graph's padded buffers and give NaN logits there,
    # which would fail the rows; this test counts the steps the warm-up runs, not their tokens.
    replay = graphs.replay
    graphs.replay = lambda step, ready=None: torch.nan_to_num(replay(step, ready))
    steps, launch = [], e.runner.launch

    def logged(plan, adapters, prev=None):
        if plan.seqs:
            steps.append((sum(r.num_new for r in plan.seqs), len(plan.decode),
                          {r.adapter for r in plan.seqs}))
        return launch(plan, adapters, prev)

    e.runner.launch = logged
    e.warmup()
    gc.unfreeze()
    eager = [s for s in steps if s[0] > graphs.mixed_tokens]
    for adapter in (None, "__warmup_r16_qkv_o"):
        mine = [(tokens, decode) for tokens, decode, names in eager if names == {adapter}]
        assert (33, 0) in mine and (48, 0) in mine and (34, 1) in mine, (adapter, mine)


def test_step_metadata_starts_16_byte_aligned(tiny_model_dir):
    """Triton specializes a pointer argument on 16-byte alignment, so a kernel fed an unaligned
    slice is another variant, compiled when first met while serving (an adapter's ranks'
    per-layer slices 12 bytes apart, block tables at an odd offset). Every field of the graphs'
    buffers and every layer's slice of an adapter batch's ranks starts aligned, whatever the
    batch size and adapter count."""

    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=256, cuda_graphs=False, max_num_seqs=7))
    graphs = e.runner.make_graphs(7, mixed_tokens=33, capture=False)
    twins = [(graphs.meta32, graphs.tables)] + [(h32, tables) for _, h32, _, tables in graphs._twins]
    for buf, tables in twins:
        assert all(v.data_ptr() % 16 == 0 for v in graphs._views32(buf).values())
        assert tables.data_ptr() % 16 == 0
    assert all(row.data_ptr() % 16 == 0 for row in graphs.meta64)
    assert all(ranks[layer].data_ptr() % 16 == 0 for _, _, ranks, _ in graphs.group_bufs.values()
               for layer in range(len(ranks)))
    names = []
    for n in range(1, 6):
        names.append(f"a{n}")
        e.add_synthetic_adapter(names[-1], 4 * n)
        e.adapters.adapters[names[-1]].pages = list(range(n))  # (no load needed: tensors only)
        _, groups = e.runner.batches.adapter_tensors(tuple(names), e.adapters)
        for g in groups.values():
            assert all(g.ranks[layer].data_ptr() % 16 == 0 for layer in range(len(g.ranks)))
            assert g.ranks[:, n:].eq(0).all() and g.max_rank == 32 if n > 4 else True


def test_few_rows_gemm_in_the_engine_gives_the_twins_tokens(tiny_model_dir, adapter_factory,
                                                            monkeypatch):
    """The engine with its base GEMMs of few rows through the Triton kernel (the path a GPU
    takes for decode steps; forced here for fp32 on CPU, where the interpreter runs it) gives
    the torch backend's greedy tokens."""
    from slora.kernels import gemm

    calls = []

    def forced(x, w, bias=None, *, max_rows):
        if x.shape[0] <= max_rows:
            calls.append(x.shape[0])
            return gemm.skinny_linear(x, w, bias)
        return torch.nn.functional.linear(x, w, bias)

    path = adapter_factory(tiny_model_dir, r=8, target_modules="all-linear")
    tokens = {}
    for backend in ("torch", "triton"):
        if backend == "triton":
            monkeypatch.setattr(gemm, "linear", forced)
        e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                                num_pages=48, backend=backend, cuda_graphs=False))
        e.add_adapter("a", path)
        outs = e.generate(["The quick brown fox", "Hello", "Paris is"],
                          SamplingParams(max_tokens=5, ignore_eos=True), adapters=["a", None, "a"])
        tokens[backend] = [o.token_ids for o in outs]
    assert calls, "the kernel ran"
    assert tokens["triton"] == tokens["torch"]


def test_warmup_reaches_the_mixed_buckets_past_the_chunk(tiny_model_dir):
    """A chunk beside decode rows makes a mixed step of more tokens than the chunk (here 32
    prompt tokens and one decode row); the warm-up runs its prompts whole, reaching every mixed
    graph bucket, so serving with a chunk under `mixed_graph_tokens` captures no graph."""
    e = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                            num_pages=256, cuda_graphs=False, max_num_seqs=16,
                            max_prefill_chunk=32))
    e.add_synthetic_adapter("a", 8)
    graphs = e.runner.graphs = e.runner.make_graphs(16, mixed_tokens=64, capture=False)
    replay = graphs.replay  # (the twins give NaN in padded rows: this test counts graphs)
    graphs.replay = lambda step, ready=None: torch.nan_to_num(replay(step, ready))
    e.warmup()
    gc.unfreeze()
    warmed = set(graphs.graphs)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    e.add_request([5, 6, 7], sp, "a")
    e.step()
    e.step()
    e.add_request(list(range(3, 43)), sp, "a")  # a 32-token chunk beside one decode row
    while e.has_unfinished():
        e.step()
    assert set(graphs.graphs) == warmed, set(graphs.graphs) - warmed
