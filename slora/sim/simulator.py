"""The simulator: the engine's step loop on a virtual clock, the real scheduler, a cost model.

    SimEngine.step():
        plan = Scheduler.schedule(now)          slora.core, unchanged: admission, eviction,
                                                prefetch, preemption, page accounting
        dt   = SimRunner.execute(plan)          no compute: the cost model's time for this plan,
                                                adapter copies included (host tier via
                                                AdapterManager.on_host / admit_host)
        now += dt
        Scheduler.update(plan, fake tokens, now)

`SimEngine` has the engine's `add_request / step / has_unfinished / stats` and
`add_synthetic_adapter`, so `slora.replay.replay` drives it exactly as it drives the real
engine, with the virtual clock as its clock: requests arrive at their trace times, an idle
engine jumps to the next arrival, and the records and metrics come from the same code.

With `async_scheduling` the order is the async engine's (`SimEngine._step_async`): a step is
scheduled and launched before the one before it is resolved.

Tokens are fake (id 0); replayed requests use `ignore_eos` and `max_tokens = output_len`, so
every request's length is the trace's, whatever the ids. Adapter page counts follow the
runner's layout (see `adapter_pages`), computed from the model's config.json alone.

No torch here.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

from slora.config import DTYPE_BYTES, EngineConfig, ModelConfig, max_model_len
from slora.core.adapters import AdapterInfo, AdapterLayout, AdapterManager, synthetic_identity
from slora.core.pages import KV, PageAllocator
from slora.core.policies import Policy
from slora.core.scheduler import Scheduler, SchedulerPlan
from slora.metrics import result_dict, summarize
from slora.replay import replay
from slora.request import PENDING, Request, RequestOutput, RequestStatus, SamplingParams
from slora.sim.cost import CostModel, Profile, plan_features
from slora.workload import Trace

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # Engine.add_synthetic_adapter's
FAKE_TOKEN = 0
ACTIVATION_RESERVE_BYTES = 1 << 30  # what the runner keeps free for activations when it sizes the pool


# ---------------------------------------------------------------------------------------------
# Shapes from config.json


def adapter_pages(model: ModelConfig, rank: int, block_size: int,
                  targets: Sequence[str] = DEFAULT_TARGETS) -> int:
    """Pool pages of a rank-`rank` adapter on `targets`, laid out as the engine lays it out."""
    return AdapterLayout.uniform(model, rank, tuple(targets)).num_pages(model.page_size(block_size))


def rank_shapes(model: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The shapes one rank holds of a model sharded over `tensor_parallel_size` devices (its
    page size, adapter pages, weight bytes: `slora.distributed.shapes.ShardConfig`); the model
    itself on one device."""
    if tensor_parallel_size == 1:
        return model
    from slora.distributed.shapes import ShardConfig

    return ShardConfig.of(model, tensor_parallel_size, 0)


def page_bytes(model: ModelConfig, block_size: int, dtype: str) -> int:
    """Bytes of one page id across all layers (the runner's `page_bytes`)."""
    return model.num_layers * model.page_size(block_size) * DTYPE_BYTES[dtype]


def pages_for_memory(model: ModelConfig, block_size: int, dtype: str, gpu_memory_gb: float,
                     gpu_memory_fraction: float = 0.85, quantization: str | None = None) -> int:
    """Pool pages on a device of `gpu_memory_gb` GiB, sized as the runner sizes it: a fraction of
    the memory left after the weights (in `dtype`, or FP8 linear layers with `quantization`
    "fp8": `ModelConfig.weight_bytes`), less 1 GiB for activations. Approximate (the CUDA
    context and allocator slack are not counted): a replay's `stats.pages_total` is the exact
    figure."""
    weights = model.weight_bytes(DTYPE_BYTES[dtype], quantization)
    budget = (gpu_memory_gb * (1 << 30) - weights) * gpu_memory_fraction - ACTIVATION_RESERVE_BYTES
    pages = int(budget // page_bytes(model, block_size, dtype))
    if pages < 2:
        raise ValueError(f"--gpu-memory {gpu_memory_gb:g} GiB leaves no room for a pool after "
                         f"{weights / (1 << 30):.1f} GiB of weights")
    return pages


# ---------------------------------------------------------------------------------------------
# The virtual clock and the runner


class VirtualClock:
    """Seconds on the simulator's clock; `sleep` jumps ahead (an idle engine waits for arrivals)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class SimRunner:
    """The runner's timing without its work: the seconds one plan's step takes.

    Copies happen in the runner's order (`plan.adapter_loads`, then `plan.prefetch`); a copy of
    an adapter missing from the host tier first reads it (disk time) and records it there with
    `AdapterManager.admit_host`, exactly as `HostAdapterTier.host_copy` does, so the host
    tier's LRU state is the engine's.
    """

    def __init__(self, cost: CostModel, graph_tokens: int = 0) -> None:
        self.cost = cost
        self.graph_tokens = graph_tokens  # EngineConfig.mixed_graph_tokens (see plan_features)
        self.busy_s = 0.0
        self.copy_s = 0.0
        self.disk_s = 0.0

    def step_time(self, plan: SchedulerPlan, adapters: AdapterManager) -> float:
        cost, infos = self.cost, adapters.adapters
        disk = blocking = prefetch = 0.0
        for loads, is_prefetch in ((plan.adapter_loads, False), (plan.prefetch, True)):
            for name, _ in loads:
                nbytes = infos[name].nbytes
                if not adapters.on_host(name):
                    disk += cost.disk_time(nbytes)
                adapters.admit_host(name)
                if is_prefetch:
                    prefetch += cost.copy_time(nbytes)
                else:
                    blocking += cost.copy_time(nbytes)
        forward = 0.0 if plan.empty else cost.forward_time(
            plan_features(plan, adapters, self.graph_tokens))
        dt = cost.step_time(forward, blocking, prefetch, disk)
        self.busy_s += dt
        self.copy_s += blocking + prefetch
        self.disk_s += disk
        return dt


# ---------------------------------------------------------------------------------------------
# The engine-shaped simulator


class SimEngine:
    """The engine's request API and step loop over the real scheduler, on a virtual clock.

    config: the EngineConfig the simulated engine runs with; `num_pages` must be set (see
        `pages_for_memory`). Device, dtype, backend and CUDA-graph settings do not apply.
    model: the model's shapes (page size, adapter pages, context window).
    dtype: the pool's dtype, for adapter bytes.
    check: assert the page invariant (`PageAllocator.check`) after every step.
    on_step: called after every step as on_step(plan, start, seconds) (tests record decisions).
    `step()` returns outputs of the requests that *finished* (replay reads only those); the
    real engine also returns outputs of those that progressed.
    """

    def __init__(self, config: EngineConfig, model: ModelConfig, cost: CostModel,
                 dtype: str = "bfloat16", check: bool = False,
                 on_step: Callable[[SchedulerPlan, float, float], None] | None = None) -> None:
        if config.num_pages is None:
            raise ValueError("the simulator needs the pool size: set num_pages (or gpu memory)")
        self.config = config
        self.model = model
        self.dtype = dtype
        self.page_bytes = page_bytes(model, config.block_size, dtype)
        self.clock = VirtualClock()
        self.allocator = PageAllocator(config.num_pages)
        self.adapters = AdapterManager(self.allocator, config.host_cache_bytes)
        self.scheduler = Scheduler(config, self.allocator, self.adapters)
        self.runner = SimRunner(cost, config.mixed_graph_tokens)
        self.max_model_len = max_model_len(config, model, config.num_pages)
        self.check = check
        self.on_step = on_step
        self.steps = 0
        self._ids = itertools.count()
        self._failed_now: list[Request] = []
        # async scheduling: the launched step not yet collected (plan, the time it ends), and
        # when the device is free of the steps and copies launched so far
        self._flight: tuple[SchedulerPlan, float] | None = None
        self._device_free = 0.0
        self._pages_of: dict[tuple, int] = {}  # (rank, targets) -> adapter pages
        self.last_plan: SchedulerPlan | None = None  # of the last `step` (not fast_forward's)
        self._quiet: _QuietRun | None = None  # a run of quiet steps not yet settled

    # -- adapters
    def add_synthetic_adapter(self, name: str, rank: int,
                              target_modules: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> None:
        key = (rank, tuple(target_modules))
        pages = self._pages_of.get(key)
        if pages is None:  # one layout per shape: 100,000 adapters share a few
            pages = self._pages_of[key] = adapter_pages(self.model, rank, self.config.block_size,
                                                        key[1])
        self.adapters.register(AdapterInfo(name=name, num_pages=pages,
                                           nbytes=pages * self.page_bytes, source="synthetic",
                                           identity=synthetic_identity(rank, key[1], seed)))

    # -- requests
    def add_request(self, prompt: list[int], sampling: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    cache_prefix: bool = True) -> str:
        """Queue one request (token ids only). A prompt too long for the model or the pool
        fails, reported at the next step, as in the engine (`Engine.add_request`'s
        arguments)."""
        sampling = sampling or SamplingParams()
        if adapter is not None:
            self.adapters.get(adapter)
        if isinstance(prompt, str) or not prompt:
            raise ValueError("the simulator takes non-empty token-id prompts (traces with text "
                             "prompts need prompt_len instead)")
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, prompt, sampling, adapter,
                      self.clock.now if arrival_time is None else arrival_time,
                      max_len=self.max_model_len, cache_salt=cache_salt,
                      cache_prefix=cache_prefix)
        if len(prompt) >= self.max_model_len:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
            req.metrics.finish_time = req.arrival_time
            req.error = (f"request {rid}: prompt of {len(prompt)} tokens does not fit "
                         f"max_model_len={self.max_model_len} (the model's limit or the pool's size)")
            self._failed_now.append(req)
        else:
            self.scheduler.add(req)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed_now) or self._flight is not None

    # -- the loop
    def step(self) -> list[RequestOutput]:
        if self._quiet is not None:
            self._settle()
        start = self.clock.now
        plan = self.scheduler.schedule(start)
        dt = self.runner.step_time(plan, self.adapters)
        if self.config.async_scheduling:
            touched = self._step_async(plan, start, dt)
        else:
            self.clock.now = start + dt
            n = len(plan.decode) + len(plan.prefill)
            touched = self.scheduler.update(plan, [FAKE_TOKEN] * n, [None] * n, self.clock.now)
        self.steps += 1
        self.last_plan = plan
        if self.check:
            self.allocator.check()
        if self.on_step is not None:
            self.on_step(plan, start, dt)
        done = [_output(r) for r in touched if r.status is RequestStatus.FINISHED]
        if self._failed_now:
            done += [_output(r) for r in self._failed_now]
            self._failed_now = []
        return done

    def _step_async(self, plan: SchedulerPlan, start: float, dt: float) -> list[Request]:
        """`Engine._step_async`'s order of events: this step (scheduled at `start`) is
        launched and the scheduler advanced, then the step before it is collected and
        resolved. The device runs what is launched back to back: a step starts when it is
        launched or when the device is free, whichever is later, and its tokens are known
        when it ends. dt is then the time between collections, which a profile measured
        with async scheduling holds (`Profile.async_scheduling`); a sync profile's step
        times include the host's work that this order hides (`simulate` warns)."""
        self._device_free = max(start, self._device_free) + dt
        touched = []
        if plan.empty:
            touched += plan.finished
        else:
            self.scheduler.advance(plan)
        prev, self._flight = self._flight, None if plan.empty else (plan, self._device_free)
        if prev is not None:
            self.clock.now = max(self.clock.now, prev[1])
            n = len(prev[0].seqs)
            touched += self.scheduler.resolve(prev[0], [FAKE_TOKEN] * n, [None] * n, self.clock.now)
        return touched

    def fast_forward(self, limit: float) -> list[RequestOutput] | None:
        """Take the next steps at once while they are quiet and each starts before `limit` (the
        driver's promise: no request is added before it). Returns the outputs of the requests
        that finished in them, as `step` would have; None when the next step is not quiet
        (call `step`).

        A quiet step is one whose decisions are known without scheduling it: nothing waits
        (so nothing is admitted, prefetched or aborted); every running request decodes one
        token, or, at its length (a request of the simulator stops only there: ignore_eos,
        no stop tokens), is left out and finishes where its last token resolves; the pages
        its rows' new blocks take are free or cached KV pages first in the LRU order (no
        adapter is evicted, nothing preempted); and some row
        decodes. Its effects are the scheduler's, in the scheduler's order: each step's new
        blocks go to its rows in running order (`PageAllocator.alloc`), then the requests
        reaching their length finish (`Scheduler._finish`: pages freed, adapter released) in
        the order of the step's rows (`_order_decode`'s: largest adapter first, running order
        among equals); each row gets its tokens as `advance` and `resolve` leave them, its
        first token the time of its first resolve; a policy that counts service (`served`) is
        told of each token; the clock, the device and the runner's busy time advance step by
        step by the cost model's time of the step's decode-only plan. With async scheduling
        the last step stays in flight with the scheduler's plan.

        A run of quiet steps that `limit` cuts resumes at the next call if nothing happened in
        between; the running requests' tokens and the flight's plan are brought up to date
        (`_settle`) before anything reads them: `step`, `stats`. Step by step and at once give
        the same state (tests/sim/test_cluster.py checks it against `step` alone); `on_step`
        and `check` need every step, so with either this takes none.
        """
        run = self._quiet
        if (run is None or run.steps_at != self.steps or self.scheduler.waiting
                or self._failed_now):
            self._settle()
            run = self._quiet_run()
            if run is None:
                return None
        before = run.taken
        done = run.advance(self, limit)
        if run.taken == before:  # not a step: the next one is not quiet
            if run is self._quiet:
                self._settle()
            return None
        self._quiet = run
        run.steps_at = self.steps
        return done

    def _quiet_run(self) -> "_QuietRun | None":
        """A run of quiet steps from now (see `fast_forward`), or None if the next step's rows
        are not all steady decodes of requests that stop only at their length."""
        sched = self.scheduler
        running = sched.running
        if (not running or sched.waiting or self._failed_now or self.on_step is not None
                or self.check):
            return None
        asynchronous = self.config.async_scheduling
        if asynchronous and (self._flight is None or self._flight[0] is None
                             or len(self._flight[0].seqs) != len(running)):
            return None
        # async: the flight's token is pending, and a row decodes in steps 0 .. end-1 and
        # finishes at step end's resolve (a row at its length is left out of the plan);
        # sync: a row decodes in steps 0 .. end and finishes at step end's update
        pending, last = (1, 0) if asynchronous else (0, 1)
        block_size = self.config.block_size
        tokens0, end_of, fresh = [], [], []
        by_phase: list[list[int]] = [[] for _ in range(block_size)]  # rows by block phase
        first_of = []
        for row, req in enumerate(running):
            out = len(req.output_token_ids)
            tokens = len(req.prompt_token_ids) + out
            if req.num_pending != pending or tokens - req.num_computed != 1:  # (prefilling)
                return None
            sampling = req.sampling
            if sampling.stop_token_ids or not (sampling.ignore_eos or not req.eos_token_ids):
                return None
            first = block_size * len(req.block_table) + 1 - tokens  # the step needing a block
            if first < 0:
                return None  # (more than one block due: no steady decode)
            tokens0.append(tokens)
            end_of.append(req.max_output - out - last)  # (`Request.at_length`)
            first_of.append(first)
            by_phase[first % block_size].append(row)
            if out == pending:
                fresh.append(req)  # its first token resolves in step 0
        return _QuietRun(self, tokens0, end_of, first_of, by_phase, fresh, asynchronous, last)

    def _settle(self) -> None:
        """Bring the requests of a quiet run (`fast_forward`) up to date: each running row's
        tokens, its computed count and the policy's service, and the flight's plan."""
        run, self._quiet = self._quiet, None
        if run is None or run.taken == run.settled:
            return
        run.settle(self)

    def stats(self) -> dict:
        self._settle()
        s = self.scheduler.stats()
        s["page_bytes"] = self.page_bytes
        s["block_size"] = self.config.block_size
        s["sim_steps"] = self.steps
        s["sim_busy_s"] = self.runner.busy_s
        s["sim_copy_s"] = self.runner.copy_s
        s["sim_disk_s"] = self.runner.disk_s
        return s


class _QuietRun:
    """The bookkeeping of a run of quiet steps (`SimEngine.fast_forward`), per row by its index
    in the running list when the run began: context tokens then, the step it ends at, the step
    it first needs a new block; rows by their block phase (a row needs a block at the steps
    first, first + block_size, ...); rows by the step they end at, walked by a pointer as steps
    go; and the sums of the next step's decode rows."""

    def __init__(self, sim: SimEngine, tokens0, end_of, first_of, by_phase, fresh,
                 asynchronous: bool, last: int) -> None:
        self.reqs = list(sim.scheduler.running)
        self.tokens0, self.end_of, self.first_of, self.by_phase = tokens0, end_of, first_of, by_phase
        self.fresh = fresh
        self.asynchronous, self.last = asynchronous, last
        pages = sim.adapters.pages_of
        self.adapter_of = [req.adapter for req in self.reqs]
        self.page_of = list(map(pages.__getitem__, self.adapter_of))
        self.by_end = sorted(range(len(self.reqs)), key=end_of.__getitem__)
        self.next_end = 0  # by_end[:next_end]: the rows out of the sums
        self.names = Counter(self.adapter_of)
        self.ctx, self.lora, self.rows = sum(tokens0), sum(self.page_of), len(self.reqs)
        self.taken = self.settled = 0
        self.resolved = 0  # rows of the last step taken (async: resolved at the next)
        self.last_resolve = None  # when the last step taken resolved its rows' tokens
        self.steps_at = sim.steps
        self.device_free = sim._device_free
        self.flight_end = sim._flight[1] if asynchronous else None
        self.flight_rows = sim._flight[0].seqs if asynchronous else None
        # async: the rows at their length at step 0 are left out of its plan and finish at its
        # resolve; later, those leaving each step's plan finish at that step's resolve
        self.finishing = self._leave(0) if asynchronous else []

    def _leave(self, step: int) -> list[int]:
        """Take the rows that end at `step` out of the decode sums (steps ascending, each row
        once); returns them."""
        by_end, end_of, k = self.by_end, self.end_of, self.next_end
        j = k
        while j < len(by_end) and end_of[by_end[j]] <= step:
            j += 1
        if j == k:
            return []
        self.next_end = j
        names, tokens0, page_of, adapter_of = self.names, self.tokens0, self.page_of, self.adapter_of
        for r in by_end[k:j]:
            self.rows -= 1
            self.ctx -= tokens0[r]
            self.lora -= page_of[r]
            name = adapter_of[r]
            names[name] -= 1
            if not names[name]:
                del names[name]
        return by_end[k:j]

    def advance(self, sim: SimEngine, limit: float) -> list[RequestOutput]:
        """Take quiet steps while each starts before `limit` (and the next is quiet); returns
        the outputs of the requests that finished."""
        sched, allocator, runner = sim.scheduler, sim.allocator, sim.runner
        decode_time, alloc, block_size = runner.cost.decode_time, allocator.alloc, sim.config.block_size
        asynchronous, last = self.asynchronous, self.last
        end_of, first_of, reqs, by_phase = self.end_of, self.first_of, self.reqs, self.by_phase
        by_end, names = self.by_end, self.names
        now, device_free, flight_end = sim.clock.now, self.device_free, self.flight_end
        busy = runner.busy_s
        gaps, resolved = sched.token_gaps, self.resolved
        done: list[RequestOutput] = []
        before = i = self.taken
        while now < limit and self.rows:
            # schedule step i: new blocks, in running order, from free pages alone
            bucket = by_phase[i % block_size]
            if bucket:
                grow = [r for r in bucket if first_of[r] <= i and end_of[r] > i - last]
                short = len(grow) - allocator.num_free
                if short > 0 and not _cached_front(allocator, short):
                    break
                # (`Scheduler._grow`: one page each, in order; a free one, else the next
                # reclaimed, the same pages as one at a time)
                cut = len(grow) - max(short, 0)
                for r, page in zip(grow[:cut], alloc(cut, KV)):
                    reqs[r].block_table.append(page)
                if short > 0:
                    allocator.evict_for(short)
                    for r, page in zip(grow[cut:], alloc(short, KV)[::-1]):
                        reqs[r].block_table.append(page)
            rows = self.rows
            dt = decode_time(rows, self.ctx + rows * i, len(names) - (None in names), self.lora)
            busy += dt
            if asynchronous:
                device_free = max(now, device_free) + dt
                now = max(now, flight_end)  # the step before is collected
                flight_end = device_free
            else:
                now += dt
            if gaps is not None:  # (`Scheduler.resolve`'s count, step by step)
                # the rows resolved now: sync, this step's; async, the step before's (step 0:
                # the flight's, every row); a row resolved at step i >= 1 was at the step
                # before too (rows only leave a run)
                if i:
                    gaps[now - self.last_resolve] += resolved if asynchronous else rows
                else:
                    for req in self.reqs:
                        if req.metrics.last_token_time is not None:  # (not its first token)
                            gaps[now - req.metrics.last_token_time] += 1
            resolved, self.last_resolve = rows, now
            if i == 0:  # the first resolve: first tokens
                for req in self.fresh:
                    if req.metrics.first_token_time is None:
                        req.metrics.first_token_time = req.metrics.last_token_time = now
            # the rows whose last token resolves now finish, in the order of their step's rows
            # (async: those left out of step i; sync: those in it reaching their length)
            ending = self.finishing if asynchronous else (
                self._leave(i) if self.next_end < len(by_end) and end_of[by_end[self.next_end]] <= i
                else ())
            if ending:
                self._finish(sim, ending, i, now, done)
            i += 1
            if asynchronous:  # the next step's plan leaves out the rows at its length
                k = self.next_end
                self.finishing = (self._leave(i) if k < len(by_end) and end_of[by_end[k]] <= i
                                  else [])
        self.taken, self.resolved = i, resolved
        if i > before:
            runner.busy_s = busy
            sim.steps += i - before
            sim.clock.now = now
            self.device_free, self.flight_end = device_free, flight_end
            if asynchronous:
                sim._device_free = device_free
                sim._flight = (None, device_free)  # its plan: made by `settle`
        return done

    def _finish(self, sim: SimEngine, ending: list[int], step: int, now: float,
                done: list[RequestOutput]) -> None:
        """Finish the rows `ending` at `step` (their last token resolved at `now`) in the order
        of the rows of their last step: the flight's for step 0 with async scheduling, else
        `_order_decode`'s (adapter pages, largest first; running order among equals)."""
        reqs, end_of, last, asynchronous = self.reqs, self.end_of, self.last, self.asynchronous
        if asynchronous and step == 0:
            at = {id(req): r for r, req in enumerate(reqs)}
            order = [at[id(req)] for req in self.flight_rows if at[id(req)] in ending]
        else:
            page_of = self.page_of
            order = sorted(ending, key=lambda r: (-page_of[r], r))
        sched = sim.scheduler
        for r in order:
            req = reqs[r]
            decoded = end_of[r] + last  # the tokens it decoded in this run
            _settle_tokens(req, decoded, asynchronous, final=True)
            _serve(sched.policy, req, decoded)
            sched._finish(req, "length", now)
            done.append(_output(req))

    def settle(self, sim: SimEngine) -> None:
        """The running rows' tokens, computed counts and service after the steps taken, and,
        async, the flight's plan (the last step's rows: every row still running)."""
        taken = self.taken
        asynchronous = self.asynchronous
        tail = [FAKE_TOKEN] * taken + [PENDING] if asynchronous else [FAKE_TOKEN] * taken
        cut = -1 if asynchronous else 1 << 62  # async: the flight's pending token; sync: none
        running = sim.scheduler.running
        # every row still running decoded in each step taken: its computed count, one short
        # of its tokens when the run began, grows by as many as its tokens
        for req in running:
            req.output_token_ids[cut:] = tail
            req.num_computed += taken
            req.metrics.last_token_time = self.last_resolve
        policy = sim.scheduler.policy
        if type(policy).served is not Policy.served:
            for req in running:
                _serve(policy, req, taken)
        self.settled = taken
        if asynchronous:
            # the last step's rows (every row still running) in `Scheduler._order_decode`'s
            # order: by adapter pages, largest first, a stable sort of the running order
            reqs, end_of = self.reqs, self.end_of
            rows = sorted((r for r in range(len(reqs)) if end_of[r] >= taken),
                          key=self.page_of.__getitem__, reverse=True)
            sim._flight = (SchedulerPlan(decode=[reqs[r] for r in rows]), self.device_free)


def _cached_front(allocator: PageAllocator, n: int) -> bool:
    """Whether the first n holders of the pool's eviction order are cached KV pages (page
    ids), so that reclaiming them for a quiet step's new blocks evicts no adapter."""
    keys = list(itertools.islice(allocator.order(), n))
    return len(keys) == n and all(type(k) is int for k, _ in keys)


def _settle_tokens(req: Request, decoded: int, asynchronous: bool, final: bool) -> None:
    """A row's tokens after `decoded` quiet steps: async, the flight's pending token resolved
    and `decoded` more, the last pending unless the row finished; sync, `decoded` resolved."""
    out = req.output_token_ids
    if asynchronous:
        out[-1:] = [FAKE_TOKEN] * (decoded + 1) if final else [FAKE_TOKEN] * decoded + [PENDING]
        if final:
            req.num_pending = 0
    else:
        out += [FAKE_TOKEN] * decoded
    req.num_computed = len(req.prompt_token_ids) + len(out) - 1


def _serve(policy, req: Request, tokens: int) -> None:
    """Tell a policy that counts service (`Policy.served`) of `tokens` decode tokens, one a
    step, as `Scheduler.advance` does."""
    if type(policy).served is not Policy.served:
        for _ in range(tokens):
            policy.served(req, 1)


def _output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, adapter=req.adapter, prompt_token_ids=req.prompt_token_ids,
        text="", token_ids=req.output_token_ids, logprobs=None, finish_reason=req.finish_reason,
        finished=True, metrics=req.metrics, error=req.error)


# ---------------------------------------------------------------------------------------------
# Running a trace


class ProfileOrderWarning(UserWarning):
    """The simulation runs in another order of events than the profile's steps were timed in."""


class ProfileWeightsWarning(UserWarning):
    """The simulated base weights are in another format than the profiled engine's."""


def order_warning(profile: Profile, async_scheduling: bool) -> str | None:
    """Why `profile`'s step times do not fit a simulation with(out) async scheduling, or None."""
    if bool(profile.async_scheduling) == bool(async_scheduling):
        return None
    if async_scheduling:
        return (f"the profile of {profile.model} on {profile.gpu} timed its steps without async "
                "scheduling (each with the host's work, which async scheduling hides), but this "
                "simulation runs with it; re-profile with `slora profile --async-scheduling`")
    return (f"the profile of {profile.model} on {profile.gpu} timed its steps with async "
            "scheduling (between collections, the host's work hidden), but this simulation runs "
            "without it; re-profile without --async-scheduling, or simulate with it")


def resolve_pages(profile: Profile, model: ModelConfig, block_size: int, dtype: str,
                  num_pages: int | None, gpu_memory_gb: float | None,
                  gpu_memory_fraction: float = 0.85, quantization: str | None = None) -> int:
    """The simulated pool: `num_pages` if given, else sized for `gpu_memory_gb`, else the pool the
    engine sized on the profiled device, rescaled if the page size differs and grown (shrunk)
    by the runner's share of the weight bytes the simulated base weights save (take) against
    the profiled ones (FP8 against bf16: 0.85 x 6.0 GiB more pool for a 7B)."""
    if num_pages is not None and gpu_memory_gb is not None:
        raise ValueError("give the pool as num_pages or as gpu memory, not both")
    if num_pages is not None:
        return num_pages
    if gpu_memory_gb is not None:
        return pages_for_memory(model, block_size, dtype, gpu_memory_gb, gpu_memory_fraction,
                                quantization)
    if profile.num_pages is None:
        raise ValueError("the profile records no pool size: give --num-pages or --gpu-memory")
    profiled = rank_shapes(ModelConfig.from_dict(profile.model_config),
                           profile.tensor_parallel_size)
    pool = profile.num_pages * page_bytes(profiled, profile.block_size, profile.dtype)
    saved = (profiled.weight_bytes(DTYPE_BYTES[profile.dtype], profile.quantization)
             - model.weight_bytes(DTYPE_BYTES[dtype], quantization))
    return max(2, int(pool + saved * gpu_memory_fraction) // page_bytes(model, block_size, dtype))


def register_trace_adapters(sim: SimEngine, trace, default_rank: int | None = None,
                            targets: Sequence[str] = DEFAULT_TARGETS) -> None:
    """Register the trace header's adapters with their ranks (as `replay --synthetic-adapters`
    does); adapters the requests use without a rank get `default_rank`, or raise."""
    for name, rank in trace.adapters.items():
        sim.add_synthetic_adapter(name, rank, targets)
    unranked = [n for n in trace.adapter_names() if n not in trace.adapters]
    if unranked and default_rank is None:
        raise ValueError(f"the trace header gives no rank for {len(unranked)} adapter(s) the "
                         f"requests use (e.g. {unranked[0]!r}): add them to its \"adapters\" map, "
                         "or give a default rank (--adapter-rank)")
    for name in unranked:
        sim.add_synthetic_adapter(name, default_rank, targets)


@dataclass
class SimRun:
    """A finished simulation: the result dict (`slora replay`'s keys, source "simulate"), the
    per-request records it summarises, and the simulated engine (its scheduler's final state)."""

    result: dict
    records: list
    engine: SimEngine


def engine_config(profile: Profile, engine_options: dict | None = None,
                  num_pages: int | None = None, gpu_memory_gb: float | None = None,
                  model: ModelConfig | None = None) -> tuple[EngineConfig, ModelConfig]:
    """The EngineConfig a simulation of `profile` runs with, and the model's shapes.

    engine_options: EngineConfig fields; dtype, quantization, block_size, mixed_graph_tokens and
    tensor_parallel_size default to the profile's, async_scheduling to the order the profile
    was timed in. The model's shapes are one rank's (`rank_shapes`). The pool:
    see `resolve_pages`. Warns (`ProfileOrderWarning`) when async_scheduling is not the
    profile's, and (`ProfileWeightsWarning`) when quantization is not.
    """
    options = {k: v for k, v in (engine_options or {}).items() if v is not None}
    model = model or ModelConfig.from_dict(profile.model_config, source="profile model_config")
    dtype = options.get("dtype") or "auto"
    dtype = profile.dtype if dtype == "auto" else dtype
    options["dtype"] = dtype
    options.setdefault("quantization", profile.quantization)
    if options["quantization"] != profile.quantization:
        warnings.warn(f"the profile of {profile.model} on {profile.gpu} timed its steps with "
                      f"{profile.quantization or profile.dtype} base weights, this simulation "
                      f"runs {options['quantization'] or dtype} ones: its pool is sized for them, "
                      "its step times are the profile's; profile the engine with "
                      f"`slora profile --quantization {options['quantization']}` for theirs",
                      ProfileWeightsWarning, stacklevel=3)
    options.setdefault("block_size", profile.block_size)
    options.setdefault("mixed_graph_tokens", profile.mixed_graph_tokens)
    options.setdefault("tensor_parallel_size", profile.tensor_parallel_size)
    if options["tensor_parallel_size"] != profile.tensor_parallel_size:
        raise ValueError(f"the profile of {profile.model} on {profile.gpu} timed the model "
                         f"sharded over {profile.tensor_parallel_size} device(s); a simulation "
                         f"over {options['tensor_parallel_size']} needs a profile of that degree "
                         "(`slora profile --tensor-parallel-size N`)")
    model = rank_shapes(model, options["tensor_parallel_size"])
    options.pop("num_pages", None)
    options.pop("model", None)
    fraction = options.get("gpu_memory_fraction", 0.85)
    pages = resolve_pages(profile, model, options["block_size"], dtype, num_pages, gpu_memory_gb,
                          fraction, options["quantization"])
    if options.get("async_scheduling") is None:  # auto: the order the profile was timed in
        options["async_scheduling"] = profile.async_scheduling
    config = EngineConfig(model=profile.model, num_pages=pages, **options)
    mismatch = order_warning(profile, config.async_scheduling)
    if mismatch:
        warnings.warn(mismatch, ProfileOrderWarning, stacklevel=3)
    return config, model


def result_config(trace, profile: Profile, config: EngineConfig, *, trace_path: str | None,
                  seed: int, gpu_memory_gb: float | None, extra: dict | None = None) -> dict:
    """The "config" of a simulation's result: what was simulated, with what."""
    return {"trace": trace_path, "workload": dict(trace.params), "engine": asdict(config),
            "adapters": "synthetic", "seed": seed,
            "profile": {"model": profile.model, "gpu": profile.gpu, "dtype": profile.dtype,
                        "quantization": profile.quantization,
                        "async_scheduling": profile.async_scheduling,
                        "tensor_parallel_size": profile.tensor_parallel_size,
                        "cost": profile.cost.to_dict()},
            "gpu_memory_gb": gpu_memory_gb, **(extra or {})}


def simulate(trace, profile: Profile, *, engine_options: dict | None = None,
             num_pages: int | None = None, gpu_memory_gb: float | None = None,
             model: ModelConfig | None = None, default_rank: int | None = None,
             trace_path: str | None = None, seed: int = 0, check: bool = False,
             progress: bool = False, on_step=None, extra_config: dict | None = None) -> SimRun:
    """Simulate `trace` with `profile`'s cost model on one engine.

    engine_options: EngineConfig fields (policy, max_num_seqs, max_batch_tokens, slo_ttft_s,
        host_cache_gb, prefetch_window, ...); dtype, block_size and mixed_graph_tokens default
        to the profile's (the engine it measured).
    num_pages / gpu_memory_gb: the pool (see `resolve_pages`).
    model: the model's shapes; default: the profile's config.json.
    seed: of the random prompt token ids (as replay's; they do not change the timing).
    Warns (`ProfileOrderWarning`) when the engine's `async_scheduling` is not the profile's.
    `slora.sim.cluster.simulate_cluster` runs replicas of this engine behind a router.
    """
    config, model = engine_config(profile, engine_options, num_pages, gpu_memory_gb, model)
    sim = SimEngine(config, model, profile.cost, config.dtype, check=check, on_step=on_step)
    register_trace_adapters(sim, trace, default_rank)
    wall = time.perf_counter()
    run = replay(sim, trace, vocab_size=model.vocab_size, seed=seed, progress=progress,
                 label="simulate", clock=sim.clock, sleep=sim.clock.sleep)
    wall = time.perf_counter() - wall
    summary = summarize(run.records, slo_ttft_s=config.slo_ttft_s, duration_s=run.duration_s,
                        token_gaps=run.token_gaps)
    stats = {**sim.stats(), "sim_wall_s": wall}
    config_out = result_config(trace, profile, config, trace_path=trace_path, seed=seed,
                               gpu_memory_gb=gpu_memory_gb, extra=extra_config)
    return SimRun(result_dict(summary, source="simulate", config=config_out, stats=stats,
                              records=run.records, token_gaps=run.token_gaps), run.records, sim)


# ---------------------------------------------------------------------------------------------
# Sweeps

# Swept keys besides EngineConfig fields: the trace's request rate, the device's memory, the
# cost model's what-if `prompt_overlap`, and the cluster's replicas and router
# (`slora.sim.cluster`).
SWEEP_KEYS = ("rate", "gpu_memory", "num_pages", "max_num_seqs", "max_batch_tokens",
              "max_prefill_chunk", "prompt_overlap", "policy",
              "slo_ttft_s", "host_cache_gb", "prefetch_window", "prefetch_reserve", "block_size",
              "max_skips", "replicas", "router")
_STR_KEYS = ("policy", "router")
_INT_KEYS = ("num_pages", "max_num_seqs", "max_batch_tokens", "max_prefill_chunk",
             "prefetch_window",
             "prefetch_reserve", "block_size", "max_skips", "replicas")
CLUSTER_KEYS = ("replicas", "router")  # swept keys that make a point a cluster simulation


def parse_sweep(specs: Sequence[str]) -> list[dict]:
    """["rate=1,2,4", "policy=fcfs,cluster"] -> the grid's points, as dicts (product order)."""
    axes = {}
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SWEEP_KEYS or not text:
            raise ValueError(f"--sweep {spec!r}: expected KEY=V1,V2,... with KEY one of "
                             f"{', '.join(SWEEP_KEYS)}")
        if key in axes:
            raise ValueError(f"--sweep {key} given twice")
        values = []
        for v in text.split(","):
            try:
                values.append(v if key in _STR_KEYS else int(v) if key in _INT_KEYS else float(v))
            except ValueError:
                raise ValueError(f"--sweep {key}: {v!r} is not a number") from None
        axes[key] = values
    return [dict(zip(axes, vs)) for vs in itertools.product(*axes.values())]


def trace_rate(trace) -> float:
    """The trace's mean request rate: its synthesis parameter, else requests over its span."""
    rate = trace.params.get("rate")
    if rate:
        return float(rate)
    if trace.duration <= 0:
        raise ValueError("cannot rescale the rate of a trace whose requests all arrive at time 0")
    return len(trace) / trace.duration


def rescale_rate(trace, rate: float):
    """The same requests with arrival times scaled so that the mean rate becomes `rate`."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be positive")
    factor = trace_rate(trace) / rate
    params = {**trace.params, "rate": rate}
    if "duration" in params:
        params["duration"] = params["duration"] * factor
    reqs = [replace(r, arrival_time=r.arrival_time * factor) for r in trace.requests]
    return Trace(reqs, dict(trace.adapters), params)


def point_name(point: dict) -> str:
    return "_".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in point.items()) or "default"


def simulate_point(trace, profile: Profile, point: dict, *, engine_options: dict | None = None,
                   num_pages: int | None = None, gpu_memory_gb: float | None = None,
                   run: Callable | None = None, **kwargs):
    """`simulate` at one sweep point: rate rescales the trace, gpu_memory / num_pages size the
    pool, prompt_overlap sets the cost model's (`CostModel.prompt_overlap`), the other keys are
    EngineConfig fields. replicas and router (CLUSTER_KEYS) go to `run`
    (`slora.sim.cluster.simulate_point` passes `simulate_cluster`), which replaces `simulate`."""
    options = dict(engine_options or {})
    swept, point = dict(point), dict(point)
    fleet = {k: point.pop(k) for k in CLUSTER_KEYS if k in point}
    if fleet and run is None:
        raise ValueError(f"{', '.join(fleet)} are settings of replicas: sweep them with "
                         "slora.sim.cluster.simulate_point")
    if "rate" in point:
        trace = rescale_rate(trace, point["rate"])
    if "gpu_memory" in point:
        gpu_memory_gb, num_pages = point.pop("gpu_memory"), None
    if "num_pages" in point:
        num_pages, gpu_memory_gb = point.pop("num_pages"), None
    if "prompt_overlap" in point:
        profile = profile.with_prompt_overlap(point.pop("prompt_overlap"))
    options.update({k: v for k, v in point.items() if k != "rate"})
    extra = {**(kwargs.pop("extra_config", None) or {}), "sweep": swept}
    return (run or simulate)(trace, profile, engine_options=options, num_pages=num_pages,
                             gpu_memory_gb=gpu_memory_gb, extra_config=extra, **fleet, **kwargs)


def best_point(results: list[tuple[dict, dict]], slo_target: float, key: str = "rate"):
    """The point with the largest `key` whose SLO attainment is at least `slo_target`, or None."""
    ok = [(p, r) for p, r in results if key in p and r["slo_attainment"] >= slo_target]
    return max(ok, key=lambda pr: pr[0][key], default=None)
