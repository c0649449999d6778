"""Prefix caching in the scheduler: shared pages, one eviction order over cached KV and idle
adapters (cached pages never found again first, then least recently used first).

A fake runner keeps a shadow of the pool: each KV slot it writes holds what determines that
token's KV (the adapter's identity, the request's salt, every token up to it), and each step
checks that every context token a request reads (cached pages included) holds its own.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slora.config import EngineConfig as Cfg
from slora.core.adapters import AdapterInfo, AdapterManager
from slora.core.pages import CACHED, KV, PageAllocator
from slora.core.prefix import PrefixCache
from slora.core.scheduler import Scheduler
from slora.request import Request, SamplingParams

BS = 4


class Sim:
    """The real Scheduler and a fake runner with a shadow pool (see the module docstring)."""

    def __init__(self, num_pages, adapters, max_num_seqs=8, max_batch_tokens=64, **cfg):
        self.alloc = PageAllocator(num_pages)
        self.adapters = AdapterManager(self.alloc, 1 << 30)
        for name, pages in adapters.items():
            self.register(name, pages, identity=name)
        self.sched = Scheduler(Cfg(block_size=BS, num_pages=num_pages, max_num_seqs=max_num_seqs,
                                   max_batch_tokens=max_batch_tokens, prefetch_reserve=1, **cfg),
                               self.alloc, self.adapters)
        self.kv: dict[tuple[int, int], tuple] = {}  # (page, row) -> what its KV depends on
        self.computed = 0  # tokens the fake runner computed

    def register(self, name, pages, identity):
        self.adapters.register(AdapterInfo(name, pages, pages * 100, "synthetic",
                                           identity=identity))

    def _key(self, req, pos):
        info = self.adapters.adapters.get(req.adapter) if req.adapter else None
        tokens = req.prompt_token_ids + req.output_token_ids
        return (info and info.identity, req.cache_salt, tuple(tokens[:pos + 1]))

    def step(self, now=0.0):
        idle_before = not self.sched.running
        head = self.sched.waiting[0] if self.sched.waiting else None
        need = head and (-(-head.num_tokens // BS)
                         + self.adapters.pages_needed(head.adapter))
        held = dict(self.alloc.order()).get(head and head.adapter, 0)
        room = self.alloc.num_free + self.alloc.lru_pages - held
        plan = self.sched.schedule(now)
        if idle_before and head is not None and need <= room:
            # admission never fails while reclaimable pages make room (fcfs: the head first)
            assert head in plan.seqs, (need, room)
        for r in plan.seqs:
            table = r.block_table
            for pos in range(r.num_computed):  # the context it reads, cached pages included
                assert self.kv.get((table[pos // BS], pos % BS)) == self._key(r, pos), (r, pos)
            for pos in range(r.num_computed, r.num_tokens):
                self.kv[(table[pos // BS], pos % BS)] = self._key(r, pos)
                self.computed += 1
        toks = [(r.num_tokens * 7 + len(r.prompt_token_ids)) % 50 + 2 for r in plan.seqs]
        self.sched.update(plan, toks, [None] * len(toks), now)
        self.check()
        return plan

    def check(self):
        self.alloc.check()
        if self.sched.prefix is not None:
            self.sched.prefix.check()
        held = [p for r in self.sched.running for p in r.block_table]
        assert self.alloc.used[KV] == len(set(held))

    def run(self, reqs, limit=2000):
        for r in reqs:
            self.sched.add(r)
        for _ in range(limit):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("requests left unfinished")


def _req(rid, tokens, adapter=None, salt=None, max_tokens=3):
    return Request(str(rid), list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   adapter, 0.0, cache_salt=salt)


def test_a_cached_prefix_is_not_computed_again_and_hits_are_exact():
    sim = Sim(64, {"a": 2, "b": 2})
    system = list(range(2, 2 + 13))  # 3 full pages of 4 and one token more
    sim.run([_req(0, system + [40], "a")])
    before = sim.computed
    # same adapter: 3 pages found; another adapter, another salt, the base: none
    sim.run([_req(1, system + [41, 42], "a"), _req(2, system + [41], "b"),
             _req(3, system + [41], "a", salt="t"), _req(4, system, None)])
    stats = sim.sched.stats()
    assert stats["prefix_hit_tokens"] == 12
    assert stats["prefix_query_tokens"] == 14 + 15 + 14 + 14 + 13
    assert sim.computed - before == (15 - 12 + 2) + (14 + 2) + (14 + 2) + (13 + 2)
    # the last prompt token is always computed: a prompt of whole cached pages leaves one
    sim.run([_req(5, system[:12], None)])  # base: pages of req 4
    assert sim.sched.stats()["prefix_hit_tokens"] == 12 + 8


def test_readding_a_name_with_other_content_misses():
    sim = Sim(64, {})
    sim.register("x", 2, identity="weights-v1")
    prompt = list(range(2, 2 + 9))
    sim.run([_req(0, prompt, "x")])
    sim.alloc.free(sim.adapters.unregister("x"))
    sim.register("x", 2, identity="weights-v2")
    sim.run([_req(1, prompt, "x")])
    assert sim.sched.stats()["prefix_hit_tokens"] == 0
    sim.alloc.free(sim.adapters.unregister("x"))
    sim.register("x", 2, identity="weights-v1")  # the same content again: its KV is valid
    sim.run([_req(2, prompt, "x")])
    assert sim.sched.stats()["prefix_hit_tokens"] == 8


def test_unshared_pages_go_first_then_cached_pages_and_adapters_by_recency():
    """Tight pool: cached KV pages no second request found are reclaimed first (as if caching
    were off, no idle adapter leaves for them); pages found again and idle adapters are then
    reclaimed strictly least recently used first, whichever kind they are; every request
    ends."""
    sim = Sim(12, {"a": 3, "b": 3})
    sim.run([_req(0, range(2, 11), "a", max_tokens=1)])  # 2 cached pages, then idle "a"
    sim.run([_req(1, range(20, 25), "b", max_tokens=1)])  # 1 cached page, then idle "b"
    # a request releases its pages tail first, then its adapter; nothing found yet
    probation, protected = list(sim.alloc.probation), list(sim.alloc.lru)
    assert all(isinstance(k, int) for k in probation) and len(probation) == 3
    assert protected == ["a", "b"]
    assert sim.alloc.num_free == 12 - 2 - 3 - 1 - 3 == 3
    # request 2 finds request 1's page: protected from then on, released before its adapter
    sim.run([_req(2, range(20, 25), "b", max_tokens=1)])
    assert sim.sched.stats()["prefix_hit_tokens"] == 4
    found = probation[2]
    assert list(sim.alloc.lru) == ["a", found, "b"]
    assert list(sim.alloc.probation) == probation[:2]
    # a base prompt of 6 pages, 3 free: request 0's 2 unshared pages go before any adapter,
    # then "a", the least recently used protected holder
    sim.run([_req(3, range(30, 54), None, max_tokens=1)])
    assert not sim.adapters.adapters["a"].resident and sim.adapters.adapters["b"].resident
    assert sim.adapters.evictions == 1
    assert list(sim.alloc.lru)[:2] == [found, "b"]
    # request 0's pages are gone, request 1's page is still found
    sim.run([_req(5, range(20, 25), "b"), _req(4, range(2, 11), "a")])
    assert sim.sched.stats()["prefix_hit_tokens"] == 8
    sim = Sim(32, {}, enable_prefix_caching=False)
    sim.run([_req(0, range(2, 11)), _req(1, range(2, 11))])
    sim.run([_req(2, range(2, 11))])
    assert sim.sched.prefix is None and sim.alloc.num_free == 32
    assert sim.sched.stats()["prefix_query_tokens"] == 0


def test_page_states_unit():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, BS)
    a = _req("a", range(2, 11))
    a.block_table = alloc.alloc(3, KV)
    root = cache.root("base", None)
    cache.commit(a, root, 9)
    b = _req("b", range(2, 11))
    hits = cache.match(b, root)
    assert hits == a.block_table[:2]
    cache.take(b, hits)
    cache.release(a.block_table)  # b still holds the two full pages; a's last page is freed
    assert (alloc.used[KV], alloc.used[CACHED], alloc.num_free) == (2, 0, 6)
    cache.release(hits)
    assert (alloc.used[KV], alloc.used[CACHED]) == (0, 2)
    # found again (taken by b): protected, tail first: evicted before the head
    assert list(alloc.lru) == hits[::-1] and not alloc.probation
    assert alloc.evict_for(7) == [hits[1]]
    cache.check()
    alloc.check()
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([hits[1]])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_pages=st.integers(10, 48), n_adapters=st.integers(0, 4))
def test_random_sharing_keeps_invariants_and_reads_only_own_kv(data, num_pages, n_adapters):
    """Random prompts drawn from a few shared prefixes, adapters (re-registered with new
    content now and then), salts, pool sizes (eviction and preemption among them): every
    context token a request reads is its own KV, the page accounting (free + kv + adapter +
    cached == total) holds after every step, and every request ends."""
    sizes = {f"a{i}": data.draw(st.integers(1, 4)) for i in range(n_adapters)}
    sim = Sim(num_pages, sizes, max_num_seqs=data.draw(st.integers(1, 6)),
              max_batch_tokens=data.draw(st.integers(8, 64)))
    stems = [list(range(2 + 10 * i, 2 + 10 * i + data.draw(st.integers(0, 13)))) for i in range(3)]
    version, ended = {}, []
    for i in range(data.draw(st.integers(1, 24))):
        stem = data.draw(st.sampled_from(stems))
        tail = data.draw(st.lists(st.integers(2, 9), min_size=0 if stem else 1, max_size=6))
        adapter = data.draw(st.sampled_from([None, *sizes]))
        salt = data.draw(st.sampled_from([None, None, "t1", "t2"]))
        req = _req(i, stem + tail, adapter, salt, max_tokens=data.draw(st.integers(1, 8)))
        sim.sched.add(req)
        ended.append(req)
        for _ in range(data.draw(st.integers(0, 3))):
            sim.step()
        name = data.draw(st.sampled_from([None, *sizes]))
        if name and not sim.sched.requests_of(name):  # new weights under the same name
            version[name] = version.get(name, 0) + 1
            sim.alloc.free(sim.adapters.unregister(name))
            sim.register(name, sizes[name], identity=f"{name}-v{version[name]}")
            sim.check()
    sim.run([])
    assert all(r.finished and r.finish_reason == "length" for r in ended)
    assert sim.alloc.used[KV] == 0
    stats = sim.sched.stats()
    assert stats["prefix_hit_tokens"] <= stats["prefix_query_tokens"]


def test_a_request_that_skips_the_cache_neither_finds_nor_offers_pages():
    sim = Sim(64, {})
    prompt = list(range(2, 2 + 9))
    skip = _req(1, prompt)
    skip.cache_prefix = False
    sim.run([skip])  # offers nothing: its pages are freed at its end
    assert sim.sched.stats()["prefix_cached_pages"] == 0 and sim.alloc.num_free == 64
    sim.run([_req(2, prompt)])  # cached now
    skip = _req(3, prompt)
    skip.cache_prefix = False
    sim.run([skip, _req(4, prompt)])
    stats = sim.sched.stats()
    assert stats["prefix_hit_tokens"] == 8  # request 4 only
    assert stats["prefix_query_tokens"] == len(prompt) * 2  # requests 2 and 4
