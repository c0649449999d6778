"""The scheduler arbitrates one pool between KV and adapters.

Real engine, tiny model: a pool a few requests wide serves dozens of requests over dozens of
adapters with exactly the tokens of a roomy pool; preemption leaves outputs unchanged.
Fake runner + hypothesis: invariants under random arrivals, lengths, adapters and pool sizes.
"""

import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slora import Engine, EngineConfig, SamplingParams
from slora.config import EngineConfig as Cfg
from slora.core.adapters import AdapterInfo, AdapterManager
from slora.core.pages import PageAllocator
from slora.core.scheduler import Scheduler
from slora.request import PENDING, Request

RANKS = [1, 2, 4, 8, 16, 32, 64]


def _workload(n_req, n_adapters, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world paris berlin".split()
    jobs = []
    for i in range(n_req):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        adapter = None if i % 5 == 0 else f"a{rng.randrange(n_adapters)}"
        jobs.append((prompt, adapter, rng.randint(4, 24)))
    return jobs


def _run(model_dir, num_pages, jobs, n_adapters, **cfg):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_pages=num_pages, block_size=16, prefetch_reserve=4, **cfg))
    for i in range(n_adapters):
        engine.add_synthetic_adapter(f"a{i}", RANKS[i % len(RANKS)], ["q_proj", "v_proj"], seed=i)
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for _, _, n in jobs]
    outs = engine.generate([p for p, _, _ in jobs], sps, adapters=[a for _, a, _ in jobs])
    return engine, outs


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    jobs = _workload(40, 24)
    return jobs, _run(tiny_model_dir, 4096, jobs, 24)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "cluster", "fair"])
def test_tight_pool_gives_roomy_pool_tokens(tiny_model_dir, roomy, policy, async_scheduling):
    jobs, want = roomy
    # ranks 1..64 take 1..16 pages of 1024 elements; a request takes 1..3 pages of KV
    engine, outs = _run(tiny_model_dir, 40, jobs, 24, policy=policy,
                        async_scheduling=async_scheduling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    s = engine.stats()
    used = {a for _, a, _ in jobs if a}
    assert s["adapter_evictions"] > 0 and s["adapter_loads"] >= len(used)
    assert (s["pages_free"] + s["pages_kv"] + s["pages_adapter"] + s["pages_cached"]
            == s["pages_total"])
    assert s["pages_kv"] == 0


def test_preemption_keeps_outputs(tiny_model_dir):
    jobs = [("the quick brown fox jumps", None, 40), ("hello world paris", "a0", 40),
            ("berlin is the capital", "a1", 40), ("lazy dog", None, 40)]
    _, want = _run(tiny_model_dir, 4096, jobs, 2)
    engine, outs = _run(tiny_model_dir, 10, jobs, 2)
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_synthetic_adapters_share_host_buffers(tiny_model_dir):
    """Thousands of synthetic adapters cost one host buffer per shape, made at registration
    (the serving loop never waits to draw one), and each load copies the full adapter."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=4096))
    for i in range(200):
        engine.add_synthetic_adapter(f"a{i}", (8, 16)[i % 2])
    assert len(engine._synthetic) == 2
    a0, a2 = engine.adapters.get("a0"), engine.adapters.get("a2")
    assert a0.pack(engine.runner.page_size, engine.runner.dtype) is \
        a2.pack(engine.runner.page_size, engine.runner.dtype)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([[5, 6, 7]] * 3, sp, adapters=["a0", "a2", "a4"])
    assert engine.stats()["adapter_loads"] == 3  # three adapters, three copies into the pool


def test_warmup_leaves_the_engine_as_it_found_it(tiny_model_dir, capsys):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=512))
    engine.add_synthetic_adapter("small", 8)
    engine.add_synthetic_adapter("big", 40, ["q_proj", "down_proj"])
    buffers = dict(engine._synthetic)
    assert engine.warmup() > 0
    st = engine.stats()
    # one temporary adapter per rank bucket (16 and 64) and group set ({q/k/v, o} for
    # small, {q/k/v, down} for big, and their union for batches of both): graphs hold their
    # batch's module groups only
    assert st["adapter_loads"] == 2 * 3
    assert engine.list_adapters() == ["big", "small"] and engine._synthetic == buffers
    assert st["pages_free"] == st["pages_total"] and not engine.has_unfinished()
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), adapters="big")
    assert len(out[0].token_ids) == 2
    # ranks of adapters yet to come: one more bucket (128) beside the registered ones' two,
    # and their modules unknown, every group (now also the union) besides the registered sets
    before = engine.stats()["adapter_loads"]
    engine.warmup(ranks=[100], progress=True)
    assert "warm-up" in capsys.readouterr().err  # a progress bar over its steps
    assert engine.stats()["adapter_loads"] - before == 3 * 3
    assert engine.list_adapters() == ["big", "small"] and engine._synthetic == buffers
    # what start-up made is out of the collector's view while serving, and back after close()
    assert gc.get_freeze_count() > 0
    engine.close()
    assert gc.get_freeze_count() == 0


def test_request_bigger_than_pool_fails_alone(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=12, block_size=16))
    engine.add_synthetic_adapter("big", 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert engine.adapters.get("big").num_pages == 4
    long_prompt = list(range(2, 152))  # 10 pages of KV + 4 of the adapter > 12
    outs = engine.generate([long_prompt, "hello"], SamplingParams(max_tokens=3, ignore_eos=True),
                           adapters=["big", None])
    assert outs[0].finish_reason == "error" and "whole pool" in outs[0].error
    assert outs[1].finish_reason == "length"


# ----------------------------------------------------------------------------- fake runner

class Sim:
    """Drives the real Scheduler with a fake runner that 'samples' deterministic tokens."""

    def __init__(self, num_pages, adapters, policy="fcfs", max_num_seqs=8, max_batch_tokens=64):
        cfg = Cfg(block_size=4, num_pages=num_pages, max_num_seqs=max_num_seqs,
                  max_batch_tokens=max_batch_tokens, policy=policy, max_skips=5,
                  prefetch_reserve=2)
        self.alloc = PageAllocator(num_pages)
        self.adapters = AdapterManager(self.alloc, 1 << 30)
        for name, pages in adapters.items():
            self.adapters.register(AdapterInfo(name, pages, pages * 100, "synthetic"))
        self.sched = Scheduler(cfg, self.alloc, self.adapters)

    def step(self, now):
        before = list(self.sched.running)
        plan = self.sched.schedule(now)
        self._check(before, plan)
        toks = [(r.num_tokens * 7) % 50 + 2 for r in plan.seqs]
        self.sched.update(plan, toks, [None] * len(toks), now)
        self.alloc.check()
        return plan

    def _check(self, before, plan):
        # invariant: an adapter used by a running request is never evicted (one may be evicted
        # while idle and loaded again for a newly admitted request in the same step)
        kept = {r.adapter for r in before if r in self.sched.running and r.adapter}
        assert not kept & set(plan.evicted)
        for r in self.sched.running:
            if r.adapter:
                assert self.adapters.adapters[r.adapter].resident
            # room for the KV of what the step computes (a request the step skips because
            # its pending token ends it, under async scheduling, computes nothing more)
            assert len(r.block_table) * 4 >= (r.num_tokens if r in plan.seqs else r.num_computed)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_pages=st.integers(12, 80), n_adapters=st.integers(1, 12),
       policy=st.sampled_from(["fcfs", "cluster", "fair"]))
def test_random_workloads_keep_invariants(data, num_pages, n_adapters, policy):
    sizes = {f"a{i}": data.draw(st.integers(1, 6)) for i in range(n_adapters)}
    sim = Sim(num_pages, sizes, policy)
    n = data.draw(st.integers(1, 30))
    reqs = []
    for i in range(n):
        adapter = data.draw(st.sampled_from([None, *sizes]))
        plen = data.draw(st.integers(1, 20))
        out = data.draw(st.integers(1, 12))
        reqs.append((data.draw(st.integers(0, 20)),
                     Request(str(i), list(range(2, 2 + plen)), SamplingParams(max_tokens=out,
                             ignore_eos=True), adapter, 0.0)))
    reqs.sort(key=lambda x: x[0])
    passed_over = {}
    for t in range(2000):
        while reqs and reqs[0][0] <= t:
            sim.sched.add(reqs.pop(0)[1])
        sim.step(float(t))
        for r in sim.sched.waiting:
            passed_over[r.request_id] = r.skipped
        if not reqs and not sim.sched.has_unfinished():
            break
    assert not sim.sched.has_unfinished(), "every request finishes"
    assert sim.alloc.used["kv"] == 0
    if policy == "cluster":  # starvation bound: passed over at most max_skips (+ the step it waits to fit)
        assert max(passed_over.values(), default=0) <= 5


def test_a_step_that_preempts_admits_nothing_while_others_run():
    """A case of the async-order property test (below): at step 11 the fair policy preempts
    requests 5 and 0 for the running requests' growth; were 5 re-admitted in the same step, its
    adapter a3 would be evicted and copied back for nothing. A step that preempts admits no
    waiting request while others run (vLLM's rule); `Sim.step` checks that no running
    request's adapter is evicted, every step."""
    sizes = {"a0": 1, "a1": 5, "a2": 6, "a3": 1, "a4": 2, "a5": 6}
    # (arrival, prompt tokens, max_tokens, adapter) of requests "0".."18"
    jobs = [(3, 17, 5, "a5"), (1, 12, 6, "a4"), (1, 1, 5, None), (1, 1, 1, None),
            (1, 2, 2, "a5"), (10, 1, 2, "a3"), (0, 1, 2, None), (1, 1, 1, "a0"),
            (0, 1, 1, None), (3, 17, 9, "a0"), (1, 17, 6, "a2"), (0, 1, 1, None),
            (0, 13, 6, None), (0, 1, 2, None), (0, 1, 2, None), (0, 1, 1, None),
            (1, 1, 1, None), (3, 5, 9, "a1"), (0, 15, 6, "a1")]
    sim = Sim(40, sizes, "fair")
    todo = sorted(((arr, str(i), plen, mt, ad) for i, (arr, plen, mt, ad) in enumerate(jobs)),
                  key=lambda j: j[0])
    reqs, preempting = [], 0
    for t in range(100):
        while todo and todo[0][0] <= t:
            _, rid, plen, mt, ad = todo.pop(0)
            reqs.append(Request(rid, list(range(2, 2 + plen)),
                                SamplingParams(max_tokens=mt, ignore_eos=True), ad, float(t)))
            sim.sched.add(reqs[-1])
        plan = sim.step(float(t))
        if plan.preempted and plan.decode:  # preempted while others kept running
            preempting += 1
            assert not plan.prefill and not plan.adapter_loads
        if not todo and not sim.sched.has_unfinished():
            break
    assert preempting and not sim.sched.has_unfinished()
    assert all(r.finish_reason == "length" for r in reqs)


def _token(req, k):
    """The fake model's k-th output token of a request: fixed, whatever the schedule."""
    return (int(req.request_id) * 31 + k * 7) % 50 + 2


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_pages=st.integers(12, 60), n_adapters=st.integers(1, 8),
       policy=st.sampled_from(["fcfs", "cluster", "fair"]))
def test_async_order_of_events_keeps_invariants_and_outputs(data, num_pages, n_adapters, policy):
    """The scheduler driven as async scheduling drives it (schedule and advance step N+1
    before resolving step N), with random arrivals, lengths, stop tokens, adapters and pools
    (preemption among them): every request ends with the same tokens and reason as in the
    sync order, the page invariant holds each step, no PENDING token is left."""
    sizes = {f"a{i}": data.draw(st.integers(1, 6)) for i in range(n_adapters)}
    jobs = []
    for i in range(data.draw(st.integers(1, 20))):
        sp = SamplingParams(max_tokens=data.draw(st.integers(1, 12)), ignore_eos=True,
                            stop_token_ids=tuple(data.draw(st.lists(st.integers(2, 51), max_size=2))))
        jobs.append((data.draw(st.integers(0, 15)), str(i), data.draw(st.integers(1, 20)), sp,
                     data.draw(st.sampled_from([None, *sizes]))))
    jobs.sort(key=lambda j: j[0])
    results = {}
    for pipelined in (False, True):
        sim, todo, reqs, prev = Sim(num_pages, sizes, policy), list(jobs), [], None
        for t in range(3000):
            while todo and todo[0][0] <= t:
                _, rid, plen, sp, adapter = todo.pop(0)
                reqs.append(Request(rid, list(range(2, 2 + plen)), sp, adapter, float(t)))
                sim.sched.add(reqs[-1])
            before = list(sim.sched.running)
            plan = sim.sched.schedule(float(t))
            sim._check(before, plan)
            for r in plan.seqs:
                # no step samples past max_tokens; its inputs are known, or (async) a decode
                # row's last token, sampled by the step still running
                assert len(r.output_token_ids) < r.sampling.max_tokens
                inputs = r.token_ids_from(r.num_computed)
                fed = pipelined and prev is not None and r in prev[0].seqs and r.num_new == 1
                assert PENDING not in (inputs[:-1] if fed else inputs), r
            toks = [_token(r, len(r.output_token_ids)) for r in plan.seqs]  # at launch
            sim.sched.advance(plan)
            if pipelined:
                done, prev = prev, (plan, toks)
            else:
                done = (plan, toks)
            if done is not None:
                sim.sched.resolve(done[0], done[1], [None] * len(done[1]), float(t))
            sim.alloc.check()
            if not todo and not sim.sched.has_unfinished() and prev is None:
                break
            if pipelined and plan.empty and prev is not None and prev[0].empty:
                prev = None
        assert not sim.sched.has_unfinished() and sim.alloc.used["kv"] == 0
        assert all(r.finished and r.num_pending == 0 for r in reqs)
        results[pipelined] = {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs}
    assert results[True] == results[False]


def test_small_host_cache_rereads_adapters_and_keeps_tokens(tiny_model_dir, roomy):
    """A host tier of ~100 KB holds a few adapters: misses re-read (re-pack) them, LRU order."""
    jobs, want = roomy
    engine, outs = _run(tiny_model_dir, 40, jobs, 24, host_cache_gb=1e-4)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    s = engine.stats()
    assert s["host_evictions"] > 0 and s["host_loads"] > s["adapter_loads"] / 2
    assert engine.adapters.host_bytes <= engine.config.host_cache_bytes or len(engine.runner.host_tier.tensors) == 1
    assert set(engine.runner.host_tier.tensors) == set(engine.adapters._host)  # tensors follow the LRU state


def test_prefetch_evicts_idle_adapters_the_queue_does_not_need():
    """A pool full of idle cached adapters still prefetches for the queue: it evicts idle
    adapters (LRU) that no waiting request in the window needs, and keeps the reserve free."""
    sizes = {f"a{i}": 4 for i in range(8)}
    sim = Sim(28, sizes, max_num_seqs=1)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(6):  # six adapters used once each: 24 pages of idle adapters stay resident
        sim.sched.add(Request(f"w{i}", [2, 3, 4], sp, f"a{i}", 0.0))
    while sim.sched.has_unfinished():
        sim.step(0.0)
    assert sim.alloc.num_free < 4 + 2  # not enough free pages for a prefetch without eviction
    sim.sched.add(Request("run", [2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True), "a0", 1.0))
    sim.sched.add(Request("next", [2, 3, 4], sp, "a7", 1.0))  # waits: max_num_seqs=1
    plan = sim.step(1.0)
    assert [n for n, _ in plan.prefetch] == ["a7"]
    assert plan.evicted and "a0" not in plan.evicted  # a0 is in use
    assert sim.alloc.num_free >= 2  # the reserve
    while sim.sched.has_unfinished():
        plan = sim.step(2.0)
        assert not plan.adapter_loads  # a7 was already resident when "next" was admitted


def test_a_request_whose_tokens_are_pending_is_not_admitted():
    """Async scheduling: a request preempted while its step runs waits with a PENDING output
    token; it is admitted again only once the token is known (its prompt for the recompute)."""
    alloc = PageAllocator(16)
    sched = Scheduler(Cfg(block_size=4, num_pages=16), alloc, AdapterManager(alloc, 0))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None, 0.0)
    sched.add(req)
    req.output_token_ids.append(PENDING)
    req.num_pending = 1
    assert sched.schedule(0.0).empty and req in sched.waiting
    req.output_token_ids[-1], req.num_pending = 7, 0
    assert sched.schedule(0.0).prefill == [req]


def test_prompts_whole_and_prefix_cache_off_hold_within_their_block_only():
    """The settings a warm-up and a profile run under: within the blocks a 40-token prompt runs
    in one step past the chunk of 16 and finds no cached page; after them the chunk and the
    cache are back, even when the block raised."""
    alloc = PageAllocator(64)
    cfg = Cfg(block_size=4, num_pages=64, max_batch_tokens=64, max_prefill_chunk=16)
    sched = Scheduler(cfg, alloc, AdapterManager(alloc, 0))
    cache = sched.prefix
    assert cache is not None
    with pytest.raises(RuntimeError):
        with sched.prefix_cache_off(), sched.prompts_whole():
            assert sched.prefix is None and sched.config.max_prefill_chunk == 0
            sched.add(Request("r", list(range(1, 41)), SamplingParams(max_tokens=2), None, 0.0))
            assert sched.schedule(0.0).chunks == {"r": 40}
            raise RuntimeError("left the block")
    assert sched.prefix is cache and sched.config is cfg


@pytest.mark.parametrize("graph_tokens, decode, chunk", [
    (16, 5, 11),   # the chunk leaves room for the decode rows: 16 tokens in all
    (16, 8, 8),    # half the chunk is left: still cut
    (16, 9, 16),   # under half: the chunk whole, the step past the graphs
    (0, 5, 16),    # no mixed-step graphs: the chunk whole
    (12, 2, 16),   # a chunk past the graphs: whole
])
def test_a_chunk_leaves_room_in_the_graph_for_the_decode_rows(graph_tokens, decode, chunk):
    """A chunk that fits mixed_graph_tokens is cut so that the step with its decode rows fits
    it too (a larger step runs eagerly, bound by the host's launch), unless that would halve
    it; every prompt token is still computed once."""
    alloc = PageAllocator(64)
    cfg = Cfg(block_size=4, num_pages=64, max_batch_tokens=64, max_prefill_chunk=16,
              mixed_graph_tokens=graph_tokens)
    sched = Scheduler(cfg, alloc, AdapterManager(alloc, 0))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(decode):
        sched.add(Request(f"d{i}", [2, 3], sp, None, 0.0))
    while sched.waiting or len(sched.prefilling()) or not sched.running:  # all decoding
        plan = sched.schedule(0.0)
        sched.update(plan, [5] * len(plan.seqs), [None] * len(plan.seqs), 0.0)
    sched.add(Request("p", list(range(2, 42)), sp, None, 1.0))
    plan = sched.schedule(1.0)
    assert len(plan.decode) == decode and plan.chunks == {"p": chunk}
    done = chunk
    while done < 40:  # the rest in later steps, each cut the same way
        sched.update(plan, [5] * len(plan.seqs), [None] * len(plan.seqs), 1.0)
        plan = sched.schedule(1.0)
        done += plan.chunks["p"]
    assert done == 40


def test_decode_rows_come_largest_adapter_first():
    """Decode rows are ordered by adapter size (pages), largest first, base-only rows last, and
    rows of equal size keep the running order (MBGMV's expand starts the longest rows first);
    prompts keep the admission order."""
    sizes = {"small": 1, "big": 4, "mid": 2}
    sim = Sim(64, sizes, max_num_seqs=8, max_batch_tokens=64)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    order = ["small", None, "big", "mid", "small", "big"]
    for i, a in enumerate(order):
        sim.sched.add(Request(str(i), [2, 3, 4], sp, a, 0.0))
    plan = sim.step(0.0)
    assert [r.request_id for r in plan.prefill] == [str(i) for i in range(6)]
    plan = sim.step(1.0)
    assert [r.request_id for r in plan.decode] == ["2", "5", "3", "0", "4", "1"]


# ----------------------------------------------------------------------------- chunked prefill

def _chunked_run(jobs, num_pages, sizes, max_batch_tokens, chunk, check=None, prefix=False):
    """`jobs` [(arrival, prompt tokens, max_tokens, adapter)] through the fake runner (prompts
    2, 3, 4, ...: they share prefixes); returns ({id: (tokens, reason)}, the scheduler's
    stats). `check(plan, ids running before it)` sees each plan; `prefix`: prefix caching on."""
    cfg = Cfg(block_size=4, num_pages=num_pages, max_num_seqs=6, max_batch_tokens=max_batch_tokens,
              max_prefill_chunk=chunk, prefetch_reserve=2, enable_prefix_caching=prefix)
    alloc = PageAllocator(num_pages)
    adapters = AdapterManager(alloc, 1 << 30)
    for name, pages in sizes.items():
        adapters.register(AdapterInfo(name, pages, pages * 100, "synthetic"))
    sched = Scheduler(cfg, alloc, adapters)
    todo = sorted(jobs, key=lambda job: job[0])  # by arrival (adapters may be None)
    reqs = []
    for t in range(5000):
        while todo and todo[0][0] <= t:
            arr, plen, mt, ad = todo.pop(0)
            reqs.append(Request(str(len(reqs)), list(range(2, 2 + plen)),
                                SamplingParams(max_tokens=mt, ignore_eos=True), ad, float(arr)))
            sched.add(reqs[-1])
        before = {r.request_id for r in sched.running}
        plan = sched.schedule(float(t))
        if check is not None:
            check(plan, before)
        # the fake model's token depends on the request and its length alone
        toks = [(int(r.request_id) * 31 + r.num_tokens * 7) % 50 + 2 for r in plan.seqs]
        sched.update(plan, toks, [None] * len(toks), float(t))
        alloc.check()
        # the requests still prefilling are a suffix of the running list (`prefilling`)
        assert sched.prefilling() == [r for r in sched.running if r.num_new > 1]
        if not todo and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and alloc.used["kv"] == 0
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs}, sched.stats()


def _check_chunked_plan(budget_of):
    def check(plan, before):
        decode = len(plan.decode)
        budget = budget_of(decode)
        prompt_tokens = sum(plan.chunks.values())
        assert prompt_tokens <= max(budget, 0)  # decode rows first, prompts in what is left
        assert set(plan.chunks) == {r.request_id for r in plan.prefill}
        assert plan.partial <= set(plan.chunks)
        running_first = True  # running requests' next chunks come before new prompts
        for r in plan.prefill:
            n = plan.chunks[r.request_id]
            assert 0 < n <= r.num_new and len(r.block_table) * 4 >= r.num_tokens
            assert (r.request_id in plan.partial) == (n < r.num_new)
            if r.request_id not in before:
                running_first = False
            else:
                assert running_first, "a chunk of a running prompt after a new one"
        for r in plan.decode:
            assert r.num_new == 1
    return check


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_pages=st.integers(40, 120), n_adapters=st.integers(1, 4),
       max_batch_tokens=st.integers(8, 40), chunk=st.integers(1, 48), prefix=st.booleans())
def test_chunked_prefill_keeps_invariants_and_outputs(data, num_pages, n_adapters,
                                                      max_batch_tokens, chunk, prefix):
    """Prompts several times the step's budget, random arrivals, adapters and pools
    (preemption among them), with prefix caching on or off: each step's prompt tokens stay
    within min(max_prefill_chunk, max_batch_tokens - decode rows), running prompts' chunks go
    before new prompts, a chunk samples only at its prompt's end, pages and counters balance,
    and every request ends with the tokens of an unchunked run in a roomy pool."""
    sizes = {f"a{i}": data.draw(st.integers(1, 4)) for i in range(n_adapters)}
    jobs = [(data.draw(st.integers(0, 30)), data.draw(st.integers(1, 100)),
             data.draw(st.integers(1, 8)), data.draw(st.sampled_from([None, *sizes])))
            for _ in range(data.draw(st.integers(1, 10)))]
    want, _ = _chunked_run(jobs, 400, sizes, 4096, 0)
    budget = lambda decode: min(max_batch_tokens - decode, chunk)  # noqa: E731
    got, _ = _chunked_run(jobs, num_pages, sizes, max_batch_tokens, chunk,
                          _check_chunked_plan(budget), prefix)
    assert got == want


def test_a_prompt_preempted_mid_prefill_starts_over():
    """A request preempted between its chunks (the latest arrival, when a decode row needs a
    page) gives its pages back, waits at the front and is prefilled again from its first
    token; it ends with the tokens of a run without preemption."""
    jobs = [(0, 10, 30, None), (1, 60, 3, None)]
    seen = []

    def check(plan, before):
        seen.append(({r.request_id: r.num_computed for r in plan.prefill},
                     [r.request_id for r in plan.preempted]))

    got, stats = _chunked_run(jobs, 19, {}, 12, 8, check)
    want, _ = _chunked_run(jobs, 400, {}, 4096, 0)
    assert got == want and stats["preemptions"] >= 1
    at = next(i for i, (_, pre) in enumerate(seen) if "1" in pre)
    assert any(seen[i][0].get("1", 0) > 0 for i in range(at))  # preempted after some chunks
    assert any(seen[i][0].get("1") == 0 for i in range(at + 1, len(seen)))  # starts over
