"""Tensor parallelism on CPU: gloo, 2 and 4 processes on tiny fp32 models.

A sharded engine must give the tokens and log-probs of one device: for base rows and adapters
of different ranks on all seven modules in one batch, with heads split evenly, KV heads split
or replicated (fewer KV heads than ranks), a vocabulary that does not split evenly, o's bias,
tied embeddings, and a pool small enough that adapters are evicted and requests preempted.
A worker that dies fails the engine's requests and shuts it down; a degree the model's heads
do not split over is refused before any process starts.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.config import ConfigError, ModelConfig
from slora.core.adapters import AdapterLayout
from slora.distributed import ShardConfig, check_degree
from slora.distributed.codec import decode, encode
from slora.kernels import DecodeSegments, GroupMeta, LoraMeta
from slora.model.llama import Batch
from slora.model.loader import AdapterError, PeftAdapter
from tests.conftest import _tokenizer, make_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LlamaConfig kwargs. Every vocabulary is 23 past the tokenizer's: odd, so the last
# rank's vocabulary rows are padded.
SHAPES = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha_bias": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                     attention_bias=True),
    "mqa_tied": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                     tie_word_embeddings=True),
}
# Base rows first: admitted together, they outgrow the pool (preemptions); then adapters that
# do not fit the pool together (evictions).
PROMPTS = [[5 + 3 * i + j for j in range(5 + i % 4)] for i in range(10)]
ADAPTERS = [None] * 5 + ["r16", "r8", "r4", "r16", "r8"]
SAMPLING = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
BLOCK = 8
KV_PAGES = 10  # the pool's pages past the largest adapter's


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """shape -> (model dir, {adapter name: dir}), built on first use."""
    import transformers

    root, cache = tmp_path_factory.mktemp("tp"), {}

    def get(shape: str):
        if shape not in cache:
            path = root / shape
            path.mkdir()
            vocab = _tokenizer(path) + 23
            cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64,
                                           intermediate_size=128, num_hidden_layers=2,
                                           max_position_embeddings=256, bos_token_id=0,
                                           eos_token_id=1, initializer_range=0.2,
                                           **SHAPES[shape])
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(cfg).save_pretrained(path)
            adapters = {
                "r8": make_adapter(path, root / f"{shape}_r8", seed=1, r=8, target_modules=ALL),
                "r16": make_adapter(path, root / f"{shape}_r16", seed=2, r=16,
                                    target_modules=ALL, rank_pattern={"down_proj": 4}),
                "r4": make_adapter(path, root / f"{shape}_r4", seed=3, r=4,
                                   target_modules=["q_proj", "o_proj", "down_proj"]),
            }
            cache[shape] = (path, adapters)
        return cache[shape]

    return get


def pool_pages(model: Path, adapters: dict, n: int, kv_pages: int) -> int:
    """A pool of the largest adapter's pages on `n` ranks plus `kv_pages`: too small for every
    adapter and every request at once, whatever the degree."""
    cfg = ModelConfig.from_dir(model)
    local = cfg if n == 1 else ShardConfig.of(cfg, n, 0)
    layouts = [PeftAdapter(name, path, cfg).layout for name, path in adapters.items()]
    return kv_pages + max(AdapterLayout.build(local, [list(r) for r in lay.ranks])
                          .num_pages(local.page_size(BLOCK)) for lay in layouts)


def run(model: Path, adapters: dict, n: int, **config):
    """(outputs, stats) of the workload on `n` ranks."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 block_size=BLOCK, tensor_parallel_size=n, **config))
    try:
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        outs = engine.generate(PROMPTS, SAMPLING, adapters=ADAPTERS)
        return outs, engine.stats()
    finally:
        engine.close()


def assert_same(outs, ref) -> None:
    for o, r in zip(outs, ref):
        assert o.error is None and o.finish_reason == "length", o.error
        assert o.token_ids == r.token_ids
        for lp, lr in zip(o.logprobs, r.logprobs):
            assert lp.keys() == lr.keys()
            for t in lr:
                assert lp[t] == pytest.approx(lr[t], abs=1e-4)


@pytest.fixture(autouse=True)
def no_hang():
    """A test that hangs (a collective that never completes) ends the run with tracebacks."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("shape, n", [("gqa", 2), ("gqa", 4), ("mha_bias", 2), ("mqa_tied", 2)])
def test_tokens_and_logprobs_equal_one_device(models, shape, n):
    """gqa: KV heads split over 2, replicated over 4; mha_bias: o's bias; mqa_tied: one KV
    head on every rank, tied embeddings; every vocabulary split unevenly."""
    model, adapters = models(shape)
    ref, _ = run(model, adapters, 1, num_pages=1000)
    outs, stats = run(model, adapters, n, num_pages=pool_pages(model, adapters, n, KV_PAGES))
    assert_same(outs, ref)
    assert stats["adapter_evictions"] > 0 and stats["preemptions"] > 0, stats


def test_a_dying_worker_fails_the_requests_and_shuts_the_engine_down(models):
    """(and, first, a DoRA adapter is refused under tensor parallelism)"""
    model, adapters = models("gqa")
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 block_size=BLOCK, tensor_parallel_size=2, num_pages=200))
    engine.add_adapter("r8", adapters["r8"])
    with pytest.raises(AdapterError, match="DoRA adapters are not served with tensor_parall"):
        engine.add_synthetic_adapter("dora", 8, ["q_proj", "o_proj"], dora=True)
    assert engine.list_adapters() == ["r8"]
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    ids = {engine.add_request(p, long, a) for p, a in zip(PROMPTS[:4], ["r8", None] * 2)}
    engine.step()
    tp = engine.runner.tp
    worker = tp.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    tp.check = lambda: None  # the step's own collectives find the worker gone
    ended = {}
    for _ in range(3):
        ended.update({o.request_id: o for o in engine.step() if o.finished})
    assert ended.keys() == ids and not engine.has_unfinished()
    for out in ended.values():
        assert out.finish_reason == "error"
        assert "worker rank 1" in out.error and "exited with code -9" in out.error, out.error
    with pytest.raises(RuntimeError, match="engine has shut down"):
        engine.add_request(PROMPTS[0], long)
    engine.close()


TORCHRUN_SCRIPT = """
import json, sys
from slora import Engine, EngineConfig, SamplingParams
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", block_size=8,
                             tensor_parallel_size=2, num_pages=200))
engine.add_adapter("r8", sys.argv[2])
outs = engine.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=4, ignore_eos=True),
                       adapters=["r8", None])
print("tokens", json.dumps([o.token_ids for o in outs]))
engine.close()
"""


def test_under_torchrun_rank_0_serves_and_the_others_are_workers(models, tmp_path):
    model, adapters = models("gqa")
    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT)
    prompts = PROMPTS[:2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(model),
         str(adapters["r8"]), json.dumps(prompts)],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("tokens ")]
    assert len(lines) == 1  # rank 0 alone returns from Engine(...)
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 block_size=BLOCK, num_pages=200))
    engine.add_adapter("r8", adapters["r8"])
    ref = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True),
                          adapters=["r8", None])
    assert json.loads(lines[0].removeprefix("tokens ")) == [o.token_ids for o in ref]


@pytest.mark.parametrize("kind, targets", [
    ("qwen2_moe", (["q_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                    "shared_expert.down_proj", "layers.1.mlp.up_proj"],
                   ["q_proj", "shared_expert.up_proj"])),
    ("mixtral", (["q_proj", "v_proj", "o_proj"], ["k_proj"])),
    ("gpt_oss", (["q_proj", "k_proj", "o_proj"], ["v_proj"])),
    ("qwen3_moe", (["q_proj", "k_proj", "o_proj"], ["v_proj"]))])
def test_a_mixture_of_experts_splits_like_one_device(tiny_models, tmp_path, kind, targets):
    """A mixture of experts over 2 ranks (each expert's intermediate rows split, the router
    and a shared expert's gate whole): Qwen2-MoE (a layer of experts and a shared expert
    beside a dense layer), Mixtral (experts alone), gpt-oss (the experts' biases, each rank's
    heads' sinks) and Qwen3-MoE (each rank's heads under the q and k norms' one weight) give
    one device's tokens and log-probs, base rows and adapters (on the attention, the shared
    expert and the dense MLP) in one batch; experts whose width does not split are refused
    by name."""
    model = tiny_models(kind)
    adapters = {"r8": make_adapter(model, tmp_path / "r8", seed=1, r=8,
                                   target_modules=targets[0]),
                "r4": make_adapter(model, tmp_path / "r4", seed=2, r=4,
                                   target_modules=targets[1])}
    prompts, names = PROMPTS[:6], [None, "r8", "r4", None, "r4", "r8"]

    def outputs(n):
        engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                     block_size=BLOCK, num_pages=400, tensor_parallel_size=n))
        try:
            for name, path in adapters.items():
                engine.add_adapter(name, path)
            return engine.generate(prompts, SAMPLING, adapters=names)
        finally:
            engine.close()

    assert_same(outputs(2), outputs(1))
    cfg = ModelConfig.from_dir(model)
    assert ShardConfig.of(cfg, 2, 1).expert_intermediate_size == cfg.expert_intermediate_size // 2
    with pytest.raises(ConfigError, match=f"experts' intermediate size "
                       f"{cfg.expert_intermediate_size} is not divisible by 5"):
        check_degree(cfg, 5)


@pytest.mark.parametrize("heads, kv, n, why", [
    (6, 6, 4, "6 attention heads are not divisible by 4"),
    (6, 3, 2, "3 KV heads are neither divisible by 2 nor a divisor of it"),
    (8, 8, 3, "8 attention heads are not divisible by 3"),
])
def test_degrees_the_heads_do_not_split_over_are_refused(heads, kv, n, why):
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=100,
                                     hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=heads, num_key_value_heads=kv))
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={n}.*{why}"):
        check_degree(cfg, n)


def test_fewer_kv_heads_than_ranks_are_replicated():
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=100,
                                     hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=8, num_key_value_heads=2))
    check_degree(cfg, 4)
    views = [ShardConfig.of(cfg, 4, k) for k in range(4)]
    assert [v.kv_heads(cfg) for v in views] == [[0], [0], [1], [1]]
    assert {(v.num_heads, v.num_kv_heads, v.vocab_size) for v in views} == {(2, 1, 25)}


def test_an_engine_refuses_a_degree_before_starting_workers(models):
    model, _ = models("gqa")  # 4 heads
    with pytest.raises(ConfigError, match="4 attention heads are not divisible by 3"):
        Engine(EngineConfig(model=str(model), device="cpu", tensor_parallel_size=3))
    assert not multiprocessing.active_children()


def test_step_messages_round_trip():
    q = torch.tensor([0, 1, 4], dtype=torch.int32)
    group = GroupMeta(torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1, dtype=torch.int64),
                      torch.arange(8, dtype=torch.int32).view(2, 4, 1), 16, 64, (64,), (32,))
    lora = LoraMeta(pages=torch.tensor([[3, 4]], dtype=torch.int32),
                    token_slot=torch.tensor([0, -1, -1, 0], dtype=torch.int32), num_decode=1,
                    groups={"o": group}, seg_start=q)
    batch = Batch(torch.tensor([5, 6, 7, 8]), torch.arange(4), torch.arange(4),
                  torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32),
                  [1, 3], [0, 1, 4], q, 1, torch.tensor([0, 3]), lora,
                  dec_ctx_lens=torch.tensor([1], dtype=torch.int32))
    value = (batch, [(0, 2)], [[3, 4]], None, 8, 2.5, "o", True)
    back = decode(encode(value))
    assert back[1:] == value[1:]
    b = back[0]
    assert b.lora.seg_start is b.q_start_tensor  # one tensor, as sent
    for name in ("input_ids", "block_tables", "ctx_lens", "logits_index", "dec_ctx_lens"):
        got, want = getattr(b, name), getattr(batch, name)
        assert got.dtype == want.dtype and torch.equal(got, want)
    g = b.lora.groups["o"]
    assert torch.equal(g.ranks, group.ranks) and g.out_dims == (32,) and g.max_rank == 16
    # a decode step's rows grouped by adapter (slora.kernels.segments) travel too
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    lora.dec_segments = DecodeSegments(i32(0, 2), i32(0, 2), i32(0), i32(1, 0, 0), 16)
    seg = decode(encode(lora)).dec_segments
    assert torch.equal(seg.rows, i32(0, 2)) and torch.equal(seg.tiles, i32(1, 0, 0))
    assert seg.tile == 16 and seg.programs is None
    with pytest.raises(TypeError, match="cannot carry"):
        encode(object())


def _small_run(model: Path, adapters: dict, n: int, **config):
    """Two prompts (an adapter's, the base model's) for two tokens: a step with prompts, then
    a decode step."""
    engine = Engine(EngineConfig(model=str(model), dtype="float32", block_size=BLOCK,
                                 tensor_parallel_size=n, num_pages=200, **config))
    try:
        engine.add_adapter("r16", adapters["r16"])
        sp = SamplingParams(max_tokens=2, logprobs=1, ignore_eos=True)
        return engine.generate(PROMPTS[5:7], sp, adapters=["r16", None])
    finally:
        engine.close()


@pytest.mark.slow
def test_triton_kernels_under_tensor_parallelism(models):
    """MBGMM (prompts) and MBGMV (decode rows) expanding into a rank's hidden columns, under
    the Triton interpreter on CPU, against the torch kernels on one device."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    model, adapters = models("gqa")
    ref = _small_run(model, adapters, 1, device="cpu", backend="torch")
    assert_same(_small_run(model, adapters, 2, device="cpu", backend="triton"), ref)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_with_graphs_and_async_scheduling_equals_one_gpu(models):
    """NCCL collectives inside CUDA graphs (decode and mixed steps), async scheduling: the
    tokens and log-probs of one GPU."""
    model, adapters = models("gqa")
    ref = _small_run(model, adapters, 1, device="cuda")
    assert_same(_small_run(model, adapters, 2, device="cuda"), ref)


def _config(**shape) -> ModelConfig:
    return ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=100,
                                      num_hidden_layers=2, **shape))


# Llama-2-7B's and Llama-3-8B's shapes (GQA: 8 KV heads), and a small one none of whose
# per-rank widths is a multiple of LORA_ALIGN
PAGE_SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
               num_key_value_heads=32),
    "8b_gqa": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8),
    "unaligned": dict(hidden_size=96, intermediate_size=160, num_attention_heads=4,
                      num_key_value_heads=4),
}


@pytest.mark.parametrize("shape", PAGE_SHAPES)
@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_holds_one_nth_of_an_adapter(shape, n):
    """A rank-16 adapter on all seven modules, per layer, in elements (pages x the pool's
    page size, both per rank). Bound: each of the 14 A and B row strides is
    round_up(d / N, LORA_ALIGN) < d / N + LORA_ALIGN, so a rank's rows hold at most
    elems(1) / N + 14 r LORA_ALIGN elements, and its pages at most one page more:
        pages(N) P(N) <= elems(1) / N + 14 r LORA_ALIGN + P(N)
    and exactly pages(1) P(1) / N when every split width is a multiple of LORA_ALIGN and N
    divides the KV heads (then P(N) = P(1) / N)."""
    from slora.config import LORA_ALIGN

    cfg, r = _config(**PAGE_SHAPES[shape]), 16
    ranks = [[r] * len(ALL)] * cfg.num_layers
    full = AdapterLayout.build(cfg, ranks)
    views = [ShardConfig.of(cfg, n, k) for k in range(n)]
    mine = [AdapterLayout.build(v, ranks) for v in views]
    assert len({lay.elems for lay in mine}) == 1  # one page id, one page on every rank
    local, lay = views[0], mine[0]
    held = lay.num_pages(local.page_size(BLOCK)) * local.page_size(BLOCK)
    one = full.num_pages(cfg.page_size(BLOCK)) * cfg.page_size(BLOCK)
    assert lay.elems <= full.elems / n + 14 * r * LORA_ALIGN
    assert held <= full.elems / n + 14 * r * LORA_ALIGN + local.page_size(BLOCK)
    if shape != "unaligned":
        assert lay.elems * n == full.elems and held * n == one
    for name in ALL:  # every module's A and B split: neither held whole
        d_in, d_out = cfg.module_dims(name)
        assert local.module_dims(name) == (d_in // n, d_out // n)


@pytest.mark.parametrize("n", [2, 4])
def test_the_ranks_shards_partition_every_a_and_b(n):
    """Each rank's pages hold its slices of A and B (`module_slices`); together the ranks
    hold every element of every A and B exactly once (KV heads split, not replicated)."""
    from slora.distributed.sharding import module_slices, shard_packed
    from slora.model.loader import strides, synthetic_pack

    cfg = _config(**PAGE_SHAPES["unaligned"])
    ranks = [[8, 4, 8, 16, 8, 4, 8], [8, 4, 8, 16, 8, 4, 0]]
    layout = AdapterLayout.build(cfg, ranks)
    P = cfg.page_size(BLOCK)
    packed = synthetic_pack(cfg, layout, P, torch.float32, seed=0)
    L = cfg.num_layers
    for m, name in enumerate(ALL):
        r = max(layer[m] for layer in ranks)
        (fa, fb), (s_in, s_out) = layout.offsets[m], strides(cfg, name)
        d_in, d_out = cfg.module_dims(name)
        want_a = packed[:, fa:fa + r * s_in].view(L, r, s_in)[:, :, :d_in]
        want_b = packed[:, fb:fb + r * s_out].view(L, r, s_out)[:, :, :d_out]
        got_a, got_b = torch.full_like(want_a, float("nan")), torch.full_like(want_b, float("nan"))
        for k in range(n):
            local = ShardConfig.of(cfg, n, k)
            mine = AdapterLayout.build(local, ranks)
            shard = shard_packed(packed, cfg, layout, local, local.page_size(BLOCK))
            assert shard.shape == (L, mine.num_pages(local.page_size(BLOCK))
                                   * local.page_size(BLOCK))
            cols_a, cols_b = module_slices(cfg, local)[name]
            (ma, mb), (l_in, l_out) = mine.offsets[m], strides(local, name)
            l_d_in, l_d_out = local.module_dims(name)
            assert (len(cols_a), len(cols_b)) == (l_d_in, l_d_out) == (d_in // n, d_out // n)
            assert got_a[:, :, cols_a].isnan().all() and got_b[:, :, cols_b].isnan().all()
            got_a[:, :, cols_a] = shard[:, ma:ma + r * l_in].view(L, r, l_in)[:, :, :l_d_in]
            got_b[:, :, cols_b] = shard[:, mb:mb + r * l_out].view(L, r, l_out)[:, :, :l_d_out]
        assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b), name
