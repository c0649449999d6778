"""Continuous batching with coordinated memory: KV pages and adapter pages share one pool.

Each step, `schedule(now)` returns a `SchedulerPlan`; the runner executes it; `update(plan,
tokens, logprobs, now)` advances the requests: `advance` (each sequence's new token PENDING)
then `resolve` (the token in its place, stops checked). Async scheduling calls the two apart,
scheduling the next step in between: a request whose pending tokens reach its length is not
scheduled again, and one preempted while its step runs waits until its token is known. The
order within `schedule`:

1. Running requests decode first (they already hold memory). A request whose next token
   starts a new block needs a page: take a free one, else evict idle adapters (LRU), else
   preempt the lowest-priority running request (the latest admitted; under the priority
   policy, the highest Request.priority, then the latest admitted): free its pages, put
   it at the front of the queue, and recompute it later. Nothing runs out of memory.
2. Chunked prefill (`EngineConfig.max_prefill_chunk`): the step's prompt tokens, at most
   max_prefill_chunk and what max_batch_tokens leaves after the decode rows, go first to the
   next chunks of running requests still prefilling (admission order), then to new prompts.
   A chunk that fits the largest mixed-step CUDA graph (`mixed_graph_tokens`) leaves room
   in it for the decode rows, unless that would leave under half of it.
   A chunk that does not reach the end of its request's known tokens samples nothing
   (`SchedulerPlan.partial`); each request's chunk this step is `SchedulerPlan.chunks`.
3. Waiting requests are admitted in the policy's order within `max_num_seqs` and that
   budget. Admission needs pages for the request's KV and, if its adapter is not resident,
   for the adapter; idle adapters are evicted (LRU) to make room, but an adapter a running
   request uses never is. A prompt that can never fit fails alone, with the reason. A step
   that preempted in 1 admits nothing while other requests still run (as vLLM).
   With prefix caching a request first looks its prefix up (`slora.core.prefix`): the pages
   found are its first pages, not computed again, and only the rest count against the budget
   and take pages. Room comes from one eviction order over idle adapters and cached KV
   pages no request holds (`PageAllocator.evict_for`: cached pages never found again first,
   then least recently used first), in 1 and 4 too.
4. Prefetch: adapters of the next waiting requests are loaded ahead of admission, evicting
   idle adapters the window does not need if it must, while at least `prefetch_reserve`
   pages stay free; their copy overlaps this step's compute.
5. The decode rows are ordered by adapter size, largest first, for the LoRA kernels' sake.

Pure Python over ints: no torch. The simulator drives this class unchanged.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import compress, count, islice, repeat
from operator import attrgetter, is_

from slora.config import EngineConfig, cdiv
from slora.core.adapters import AdapterManager
from slora.core.pages import CACHED, KV, PageAllocator
from slora.core.policies import Policy, make_policy
from slora.core.prefix import PrefixCache, prefix_stats
from slora.request import PENDING, Request, RequestStatus


@dataclass
class SchedulerPlan:
    """One step's work. `seqs` = decode rows first (largest adapter first), then prefill
    segments: the batch order. A prefill row computes `chunks[request_id]` tokens from its
    `num_computed` on (its whole `num_new` unless chunked); a decode row one. A prefill row
    in `partial` stops short of its known tokens: its logits row is not used and it samples
    no token (`samples`)."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[Request] = field(default_factory=list)
    chunks: dict[str, int] = field(default_factory=dict)  # prefill row's id -> its tokens
    partial: set[str] = field(default_factory=set)  # prefill rows that sample nothing
    adapter_loads: list[tuple[str, list[int]]] = field(default_factory=list)  # before forward
    prefetch: list[tuple[str, list[int]]] = field(default_factory=list)  # may overlap forward
    evicted: list[str] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # failed or aborted while scheduling

    @property
    def seqs(self) -> list[Request]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(self.chunks[r.request_id] for r in self.prefill)

    def new_tokens(self, req: Request) -> int:
        """The tokens `req`, a row of this plan, computes in its step."""
        return self.chunks.get(req.request_id, 1)

    @property
    def samples(self) -> list[bool]:
        """Per row of `seqs`: whether it samples a token (decode rows and last chunks)."""
        partial = self.partial
        return [True] * len(self.decode) + [r.request_id not in partial for r in self.prefill]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator,
                 adapters: AdapterManager) -> None:
        self.config = config
        self.block_size = config.block_size
        self.allocator = allocator
        self.adapters = adapters
        self.policy = make_policy(config.policy, config.max_skips, config.slo_ttft_s)
        self.waiting: deque[Request] = deque()
        # admission order = the order preemption spares them in (under the priority policy,
        # Request.priority order, admission order among equals)
        self.running: list[Request] = []
        self.preemptions = 0
        self.failed = 0
        self.prefix = (PrefixCache(allocator, self.block_size) if config.enable_prefix_caching
                       else None)
        # Inter-token latency, when a caller counts it (`count_token_gaps`): seconds between a
        # request's successive tokens -> how many tokens came after such a gap. None: not
        # counted (a server's engine keeps no per-step record).
        self.token_gaps: Counter[float] | None = None

    # -- requests
    def add(self, req: Request) -> None:
        """Queue a request. One that could never fit the pool is failed at once (see update)."""
        adapter_pages = self.adapters.adapters[req.adapter].num_pages if req.adapter else 0
        pool_tokens = (self.allocator.total - adapter_pages) * self.block_size
        req.cap_length(pool_tokens)
        self.waiting.append(req)

    @contextmanager
    def prompts_whole(self):
        """Within the block, prompts run whole (`max_prefill_chunk` 0): each step's prompts are
        the shape its requests make, not cut to the chunk. The config is restored after."""
        config = self.config
        self.config = config.replace(max_prefill_chunk=0)
        try:
            yield
        finally:
            self.config = config

    @contextmanager
    def count_token_gaps(self):
        """Within the block, every resolved token after a request's first counts its gap (the
        time since that request's token before it, preemption and recompute included) in the
        Counter the block yields: the inter-token latencies of the steps run inside it."""
        gaps, self.token_gaps = self.token_gaps, Counter()
        try:
            yield self.token_gaps
        finally:
            self.token_gaps = gaps

    @contextmanager
    def prefix_cache_off(self):
        """Within the block, no request looks up or offers prefix-cache pages; the cache keeps
        what it held, for after."""
        prefix, self.prefix = self.prefix, None
        try:
            yield
        finally:
            self.prefix = prefix

    def abort(self, req: Request, reason: str = "abort", now: float = 0.0) -> None:
        if not req.finished:
            self._finish(req, reason, now)

    def fail(self, reqs: list[Request], error: str, now: float) -> list[Request]:
        """End `reqs` with finish_reason "error" and the message `error`, freeing their pages;
        returns those that were not finished yet. A request in a step still running drops the
        token it gets there (see `resolve`)."""
        failed = []
        for req in reqs:  # (a request listed twice fails once)
            if not req.finished:
                self._finish(req, "error", now, error)
                failed.append(req)
        return failed

    def requests_of(self, adapter: str) -> list[Request]:
        """The waiting and running requests on `adapter`."""
        return [r for r in (*self.waiting, *self.running) if r.adapter == adapter]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step
    def schedule(self, now: float) -> SchedulerPlan:
        plan = SchedulerPlan()
        self._schedule_running(plan, now)
        budget = self._schedule_chunks(plan)
        # A step that had to preempt a running request admits none while others still run
        # (as vLLM does): the pages it freed are the running requests' next ones, and a
        # request admitted into them, the one just preempted among them, would be preempted
        # again, its prompt recomputed and its adapter copied for nothing.
        if not (plan.preempted and self.running):
            self._admit(plan, now, budget)
        self._prefetch(plan)
        self._order_decode(plan)
        return plan

    def _order_decode(self, plan: SchedulerPlan) -> None:
        """The decode rows by their adapter's size, largest first (base-only rows last; a
        stable sort, so equal rows keep the running order). The batch's row order is free, and
        a row's MBGMV expand programs take time in proportion to its rank, which an adapter's
        pages grow with: in this order the GPU starts the longest first
        (`slora.kernels.mbgmv.mbgmv_expand`)."""
        decode = plan.decode
        if len(decode) < 2:
            return
        # the keys made in one pass and the rows sorted by index on them (no Python-level
        # call or loop per row)
        pages = list(map(self.adapters.pages_of.__getitem__, map(_adapter_of, decode)))
        order = sorted(range(len(decode)), key=pages.__getitem__, reverse=True)
        decode[:] = map(decode.__getitem__, order)

    def _schedule_running(self, plan: SchedulerPlan, now: float) -> None:
        # Runs once per step over every running request: kept lean (no call when no page is
        # needed). A victim is the running list's last request, so it is `req` or behind it in
        # `queue`; removing it from `queue` during the loop skips it.
        block_size, decode = self.block_size, plan.decode
        queue = list(self.running)
        for req in queue:
            if req.num_pending and req.at_length():
                continue  # ends once its running step is collected: no room for another token
            tokens = len(req.prompt_token_ids) + len(req.output_token_ids)  # req.num_tokens
            if tokens - req.num_computed > 1:
                continue  # still prefilling: its pages are held (`_reserve`), its chunk is next
            if tokens > block_size * len(req.block_table):  # a page is needed
                need = cdiv(tokens, block_size) - len(req.block_table)
                while not self._grow(req, need, plan):
                    victim = self.running[-1]
                    self._preempt(victim, plan)
                    if victim is req:
                        break
                    _remove(queue, victim)
                else:
                    decode.append(req)
            else:
                decode.append(req)

    def _schedule_chunks(self, plan: SchedulerPlan) -> int:
        """The next chunks of the running requests still prefilling, in admission order,
        within the step's prompt budget; returns the budget left for new prompts (without
        chunking: max_batch_tokens less the decode rows, and no request is mid-prefill).
        They run after `_schedule_running`, so a request it preempted is not among them."""
        cfg = self.config
        budget = cfg.max_batch_tokens - len(plan.decode)
        if not cfg.max_prefill_chunk:
            return budget
        budget = min(budget, cfg.max_prefill_chunk)
        # A chunk that fits the largest mixed-step graph (mixed_graph_tokens) is cut so that
        # the step, decode rows and all, fits it too: a step past it runs eagerly, its launch
        # bound by the host. Not below half a chunk: past that the chunk stays whole and the
        # step runs eagerly.
        fit = cfg.mixed_graph_tokens - len(plan.decode)
        if cfg.max_prefill_chunk <= cfg.mixed_graph_tokens and 2 * fit >= cfg.max_prefill_chunk:
            budget = min(budget, fit)
        for req in self.prefilling():
            if budget <= 0:
                break
            budget -= self._add_prefill(plan, req, budget)
        return budget

    def prefilling(self) -> list[Request]:
        """The running requests still prefilling (more than one token to compute; a decode
        row, or a request pending its token, has one), in admission order. They are a suffix
        of `running`: chunks go to them in admission order, and a request is admitted only
        with the budget that all of them left, so none finishes its prompt before one admitted
        earlier; preemption takes the last. Found from the end, in time of their number."""
        running = self.running
        i = len(running)
        while i and running[i - 1].num_new > 1:
            i -= 1
        return running[i:]

    def _add_prefill(self, plan: SchedulerPlan, req: Request, budget: int) -> int:
        """Put `req`'s next chunk, at most `budget` tokens, in the plan; returns its size. The
        chunk ending at its last known token samples; an earlier one is `partial`."""
        n = min(req.num_new, budget)
        plan.prefill.append(req)
        plan.chunks[req.request_id] = n
        if n < req.num_new:
            plan.partial.add(req.request_id)
        return n

    def _grow(self, req: Request, need: int, plan: SchedulerPlan) -> bool:
        if need <= 0:
            return True
        evicted = self.adapters.evict_for(need)
        if evicted is None:
            return False
        plan.evicted += evicted
        req.block_table += self.allocator.alloc(need, KV)
        return True

    def _preempt(self, req: Request, plan: SchedulerPlan) -> None:
        """Free a running request's KV and requeue it at the front; it is recomputed later."""
        _remove(self.running, req)
        self._free_kv(req, keep=True)
        req.num_computed = 0
        if req.adapter:
            self.adapters.release(req.adapter)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)
        self.preemptions += 1

    def _admit(self, plan: SchedulerPlan, now: float, budget: int) -> None:
        """Admit waiting requests within `budget` prompt tokens (`_schedule_chunks`)."""
        cfg = self.config
        chunked = cfg.max_prefill_chunk > 0
        if not self.waiting or (chunked and budget <= 0):
            return  # (no policy's order has effects on an empty queue)
        # a copy of the resident set (hundreds of names) only for a policy that reads it
        resident = self.adapters.resident | {None} if self.policy.reads_resident else frozenset()
        admitted = []
        passed_over = []
        for req in self.policy.order(self.waiting, resident):
            if req.num_pending:
                continue  # preempted while its last step runs: its prompt is not known yet
            if len(self.running) + len(admitted) >= cfg.max_num_seqs:
                break
            if self.policy.expired(req, now):
                self._finish(req, "abort", now, "aborted: the first token can no longer meet the "
                             f"{cfg.slo_ttft_s:g} s SLO (early-abort policy)")
                plan.finished.append(req)
                continue
            hits = self._match(req)
            new = req.num_tokens - len(hits) * self.block_size
            # Chunked, a prompt takes what is left of the budget and goes on in later steps;
            # whole, a prompt longer than the budget still runs, alone, rather than never.
            fits_budget = chunked or new <= budget or (not plan.seqs and not admitted)
            if fits_budget and self._reserve(req, plan, hits):
                n = min(new, budget) if chunked else new
                admitted.append((req, n))
                budget -= n
                if budget <= 0:
                    break
            elif self._never_fits(req):
                self._finish(req, "error", now, self._too_big(req))
                plan.finished.append(req)
            else:
                passed_over.append(req)
                # A starving request (passed over max_skips times) blocks the queue until
                # it fits: that bounds how often any request can be overtaken.
                if self.policy.blocking or req.skipped >= cfg.max_skips:
                    break
        for req, n in admitted:
            _remove(self.waiting, req)
            if self.policy.ranks_running:  # after its equals: the latest admitted goes first
                bisect.insort_right(self.running, req, key=_priority_of)
            else:
                self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.metrics.scheduled_time is None:
                req.metrics.scheduled_time = now
            # one token to compute (a one-token prompt, or one cached up to its last token):
            # a decode row from the start
            if req.num_new == 1:
                plan.decode.append(req)
            else:
                self._add_prefill(plan, req, n)
        # Overtaken = a later arrival was admitted while this request keeps waiting.
        latest = max((r.arrival_time for r, _ in admitted), default=None)
        for req in passed_over:
            if latest is not None and latest > req.arrival_time:
                req.skipped += 1

    def _reserve(self, req: Request, plan: SchedulerPlan, hits: list[int]) -> bool:
        """Take the pages `req` needs (its adapter if not resident, the cached pages `hits`
        of its prefix, new pages for the rest of its KV) or nothing.

        NOTE: the KV pages of every known token are taken here, the whole prompt's even when
        it runs in chunks. Invariant: a running request holds pages for all its known tokens
        (`_schedule_running` adds one as a decode row's token needs it). So a chunk never
        allocates, and an admitted prompt is never stalled half-way waiting for pages of its
        own (nor holds a part of the pool it cannot finish in); it gives them back only when
        preempted (the latest arrival, for a decode row's next page), and starts over."""
        kv = cdiv(req.num_tokens, self.block_size) - len(hits)
        name = req.adapter
        adapter = self.adapters.pages_needed(name)
        keep = {name} if name else set()
        if hits:  # (reclaimable while no request holds them: not for this one's room)
            keep.update(hits)
        evicted = self.adapters.evict_for(kv + adapter, keep=keep)
        if evicted is None:
            return False
        plan.evicted += evicted
        if adapter:
            plan.adapter_loads.append((name, self.adapters.load(name)))
        if name:
            self.adapters.acquire(name)
        if self._caches(req):
            self.prefix.take(req, hits)
        req.block_table = hits + self.allocator.alloc(kv, KV)
        req.num_computed = len(hits) * self.block_size
        return True

    # -- prefix caching
    def _root(self, req: Request) -> bytes:
        info = self.adapters.adapters[req.adapter] if req.adapter else None
        identity = "base" if info is None else info.identity or f"name:{info.name}"
        return self.prefix.root(identity, req.cache_salt)

    def _caches(self, req: Request) -> bool:
        """Whether `req` uses the prefix cache."""
        return self.prefix is not None and req.cache_prefix

    def _match(self, req: Request) -> list[int]:
        """The cached pages of `req`'s prefix ([] without prefix caching)."""
        if not self._caches(req):
            return []
        return self.prefix.match(req, self._root(req))

    def _free_kv(self, req: Request, keep: bool) -> None:
        """Give a running request's KV pages back. With prefix caching, `keep` first caches
        its computed full pages of known tokens; otherwise (it failed: its KV may be wrong)
        the pages it computed leave the cache."""
        prefix, table = self.prefix, req.block_table
        if not self._caches(req):
            self.allocator.free(table)
        else:
            if keep:
                known = min(req.num_computed, req.num_tokens - req.num_pending)
                prefix.commit(req, self._root(req), known)
            else:
                prefix.forget(table[req.num_cached_tokens // self.block_size:])
            prefix.release(table)
            req.num_cached_pages = 0
        req.block_table = []

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (`PrefixCache.reset`); returns the pages freed now."""
        return 0 if self.prefix is None else self.prefix.reset()

    def _never_fits(self, req: Request) -> bool:
        adapter = self.adapters.adapters[req.adapter].num_pages if req.adapter else 0
        return cdiv(req.num_tokens, self.block_size) + adapter > self.allocator.total

    def _too_big(self, req: Request) -> str:
        return (f"request {req.request_id}: {req.num_tokens} tokens"
                f"{' plus adapter ' + repr(req.adapter) if req.adapter else ''} need more pages "
                f"than the whole pool holds ({self.allocator.total} pages of {self.block_size} "
                "tokens); shorten the prompt or raise num_pages")

    def _prefetch(self, plan: SchedulerPlan) -> None:
        """Load the adapters of the next waiting requests. Room comes from free pages, then
        from idle adapters (LRU) that no request in the window needs: a queued request's
        adapter is needed soon, an idle one only maybe. Taking free pages alone would stop
        prefetching for good once idle adapters fill the pool, as they do in steady serving."""
        window = list(islice(self.waiting, self.config.prefetch_window))
        keep = {r.adapter for r in window if r.adapter}
        for req in window:
            name = req.adapter
            if name is None:
                continue
            info = self.adapters.adapters[name]
            if info.resident:
                self.adapters.touch(name)
                continue
            evicted = self.adapters.evict_for(info.num_pages + self.config.prefetch_reserve, keep)
            if evicted is None:
                break
            plan.evicted += evicted
            plan.prefetch.append((name, self.adapters.load(name)))

    # -- after the forward
    def update(self, plan: SchedulerPlan, tokens: list[int],
               logprobs: list[dict[int, float] | None], now: float,
               errors: dict[int, str] | None = None) -> list[Request]:
        """Append each sequence's sampled token; finish requests that stop. Returns them all."""
        self.advance(plan)
        return self.resolve(plan, tokens, logprobs, now, errors)

    def advance(self, plan: SchedulerPlan) -> None:
        """The plan's step is running: its sequences' new tokens count as computed and each
        holds a place (PENDING) for the token it samples. With `async_scheduling` the engine
        schedules the next step here, before those tokens are known; `resolve` fills them."""
        # once per step over every row: the policy's `served` is called only if it counts
        # service (the base policy's is a no-op), and num_tokens is taken inline
        served = self.policy.served if type(self.policy).served is not Policy.served else None
        for req in plan.decode:
            out = req.output_token_ids
            if served is not None:
                served(req, 1)
            req.num_computed = len(req.prompt_token_ids) + len(out)
            out.append(PENDING)
            req.num_pending += 1
        chunks, partial, block_size = plan.chunks, plan.partial, self.block_size
        prefix = self.prefix
        for req in plan.prefill:
            n = chunks[req.request_id]
            if served is not None:
                served(req, n)
            assert req.num_pending == 0 and 0 < n <= req.num_new, (req, n)
            req.num_computed += n
            assert req.num_computed <= block_size * len(req.block_table) or req.finished, req
            if self._caches(req):  # its full pages so far: queued on the device, found from now
                prefix.commit(req, self._root(req), req.num_computed)
            if req.request_id in partial:
                continue  # mid-prompt: samples nothing, the next chunk follows
            req.output_token_ids.append(PENDING)
            req.num_pending += 1

    def resolve(self, plan: SchedulerPlan, tokens: list[int],
                logprobs: list[dict[int, float] | None], now: float,
                errors: dict[int, str] | None = None) -> list[Request]:
        """The plan's tokens are known: put each in its place and finish the requests that
        stop. A request that ended while the step ran (a stop found in the step before, an
        abort) drops its token; a row in `errors` ({row: message}) fails with that message.
        Returns the requests it changed and those that failed while the plan was made."""
        touched = []
        finished = RequestStatus.FINISHED
        partial = plan.partial
        gaps = self.token_gaps
        for i, (req, tok, lp) in enumerate(zip(plan.seqs, tokens, logprobs)):
            if req.status is finished:  # req.finished
                continue
            if partial and req.request_id in partial:
                continue  # a chunk short of its prompt's end: no token (its row is not used)
            if errors and i in errors:
                self._finish(req, "error", now, errors[i])
                touched.append(req)
                continue
            out = req.output_token_ids
            out[len(out) - req.num_pending] = tok
            req.num_pending -= 1
            if lp is not None:
                req.logprobs.append(lp)
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            elif gaps is not None:
                gaps[now - metrics.last_token_time] += 1
            metrics.last_token_time = now
            reason = req.check_stop()
            if reason:  # (it may be waiting: preempted while its step ran)
                self._finish(req, reason, now)
            touched.append(req)
        return touched + plan.finished

    def _finish(self, req: Request, reason: str, now: float, error: str | None = None) -> None:
        if req.num_pending:  # tokens of steps still running: never to be known
            del req.output_token_ids[-req.num_pending:]
            req.num_pending = 0
        if req.status is RequestStatus.WAITING and any(r is req for r in self.waiting):
            _remove(self.waiting, req)
        elif req.status is RequestStatus.RUNNING:
            _remove(self.running, req)
            self._free_kv(req, keep=reason != "error")
            if req.adapter:
                self.adapters.release(req.adapter)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.metrics.finish_time = now
        if reason == "error":
            self.failed += 1

    def stats(self) -> dict:
        a = self.adapters
        return {
            "pages_total": self.allocator.total,
            "pages_free": self.allocator.num_free,
            "pages_kv": self.allocator.used[KV],
            "pages_adapter": self.allocator.used["adapter"],
            "pages_cached": self.allocator.used[CACHED],
            **prefix_stats(self.prefix),
            "adapter_loads": a.loads,
            "adapter_evictions": a.evictions,
            "host_loads": a.host_loads,
            "host_evictions": a.host_evictions,
            "adapters_registered": len(a.adapters),
            "adapters_resident": sum(1 for x in a.adapters.values() if x.resident),
            "preemptions": self.preemptions,
            "failed": self.failed,
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "policy": self.policy.name,
            **self.policy.stats(),
        }


_adapter_of = attrgetter("adapter")  # a request's adapter name
_priority_of = attrgetter("priority")


def _remove(items, item) -> None:
    """Remove `item` from a list or deque by identity. (`list.remove` compares by ==, and a
    Request's dataclass __eq__ builds and compares tuples of all its fields for every request
    before the one sought: costly over a batch of hundreds, once a step.) The first index
    where `x is item`, found by C iterators (no Python-level loop)."""
    i = next(compress(count(), map(is_, items, repeat(item))), None)
    if i is None:
        raise ValueError(f"{item!r} is not in the list")
    del items[i]
