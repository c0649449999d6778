"""The model runner: owns the pool tensor, the weights and the host tier of adapters.

`execute(plan)` does, in order: copy the adapters the plan loads into their pool pages (on
the GPU, beside the forward: each piece of layers waits for its own layers' copies), build the
step's flat batch (token ids, positions, KV slots, block tables, LoRA metadata), run the model,
and sample one token per sequence. It is `collect(launch(plan))`: with
`EngineConfig.async_scheduling` the engine launches the next step before it collects this
one, the decode rows' input ids taken on the device from this step's sampled tokens.

    pool[num_layers, num_pages, P]     P = block_size * 2 * num_kv_heads * head_dim

is allocated once. KV pages and adapter pages are both rows of it (see kernels/reference.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from slora.config import LORA_MODULES, EngineConfig, ModelConfig, cdiv
from slora.core.adapters import AdapterInfo, AdapterLayout, AdapterManager
from slora.core.scheduler import SchedulerPlan
from slora.kernels import GroupMeta, LoraMeta, make_backend
from slora.kernels.reference import LORA_ALIGN
from slora.kernels.tiles import tile_rows, token_tiles
from slora.graphs import StepGraphs, piece_starts, round_rank
from slora.model.llama import GROUPS, Batch, LlamaModel
from slora.model.loader import load_weights, random_weights, strides
from slora.request import Request, SamplingParams

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device={name!r}: CUDA is not available on this machine; "
                         "use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@functools.lru_cache(maxsize=4096)
def _layout_tensors(layout: AdapterLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter layout as tensors (offsets [7, 2], ranks [L, 7]), built once per layout
    rather than from nested tuples every step."""
    return (torch.tensor(layout.offsets, dtype=torch.int64),
            torch.tensor(layout.ranks, dtype=torch.int32))


class Flight:
    """A launched step: its plan and its sampled tokens, on the device and, once `done`, on
    the host. Steps whose rows all decode greedily without logprobs copy back the tokens
    alone (`pipelined`: into pinned memory, without waiting); others keep their logits for
    `ModelRunner.sample`. A graph's logits are its static output, which the next replay
    overwrites: the argmax (or the copy) is taken at launch."""

    def __init__(self, plan: SchedulerPlan, logits: torch.Tensor, pipelined: bool) -> None:
        self.plan = plan
        self.tokens = logits.argmax(dim=-1)
        simple = all(r.sampling.greedy and r.sampling.logprobs is None for r in plan.seqs)
        # (collected at once unless pipelined: no later replay can overwrite the logits)
        self.logits = None if simple else logits.clone() if pipelined else logits
        self.host, self.done = self.tokens, None
        if simple and pipelined and self.tokens.is_cuda:
            self.host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self.host.copy_(self.tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    @property
    def simple(self) -> bool:
        """Whether the next step may launch before this one is collected."""
        return self.logits is None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: str) -> None:
        self.config = config
        self.cfg = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tile = tile_rows(self.device, self.dtype)  # prefill kernels' work-tile tokens
        self.block_size = config.block_size
        self.page_size = model_config.page_size(config.block_size)
        if self.page_size % LORA_ALIGN:
            raise ValueError(f"page size {self.page_size} (block_size x 2 x kv_heads x head_dim) "
                             f"must be a multiple of {LORA_ALIGN}; raise EngineConfig.block_size")
        if config.load_format == "dummy":
            weights = random_weights(model_config, self.dtype, self.device, config.seed)
        else:
            weights = load_weights(model_dir, model_config, self.dtype, self.device)
        self.backend = make_backend(config.backend, self.device, config.gemm_max_rows)
        self.model = LlamaModel(model_config, weights, self.backend, config.block_size)
        self.num_pages = self._pool_pages()
        # One page more than the allocator hands out: padded rows of a captured decode batch
        # write their KV there (`scratch_page`), never into a live page.
        self.pool = torch.zeros(model_config.num_layers, self.num_pages + 1, self.page_size,
                                dtype=self.dtype, device=self.device)
        self.scratch_page = self.num_pages
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # the first layer of each piece a step is cut into: its CUDA graphs, and the copies of
        # the adapters it loads itself, each piece waited for before its layers run
        self.piece_starts = piece_starts(model_config.num_layers)
        self.graphs = (StepGraphs(self, config.max_num_seqs, config.mixed_graph_tokens)
                       if cuda and config.cuda_graphs and self.backend.name != "torch" else None)
        # the setting in effect: steps with prompts run eagerly where there are no graphs
        self.mixed_graph_tokens = self.graphs.mixed_tokens if self.graphs is not None else 0
        # row strides and output widths of each LoRA module group: fixed by the model
        self.group_shapes = {
            g: dict(stride_in=strides(model_config, LORA_MODULES[mods[0]])[0],
                    strides_out=tuple(strides(model_config, LORA_MODULES[m])[1] for m in mods),
                    out_dims=tuple(model_config.module_dims(LORA_MODULES[m])[1] for m in mods))
            for g, mods in GROUPS.items()}
        self._adapter_side: tuple = (None, None)  # (key, tensors): see lora_meta
        self.host: dict[str, torch.Tensor] = {}  # the host tier's tensors
        self.generators: dict[str, torch.Generator] = {}  # per request, for sampling
        self.rng = torch.Generator().manual_seed(config.seed)  # seeds unseeded requests

    @property
    def page_bytes(self) -> int:
        """Bytes of one page id across all layers."""
        return self.cfg.num_layers * self.page_size * self.pool.element_size()

    def _pool_pages(self) -> int:
        c = self.config
        if c.num_pages is not None:
            return c.num_pages
        page_bytes = self.cfg.num_layers * self.page_size * torch.empty((), dtype=self.dtype).element_size()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * c.gpu_memory_fraction - (1 << 30)  # 1 GiB for activations
        else:
            budget = c.cpu_pool_gb * (1 << 30)
        pages = int(budget // page_bytes)
        if pages < 2:
            raise ValueError(f"no room for a KV pool: one page needs {page_bytes} bytes; "
                             "set EngineConfig.num_pages or free memory")
        return pages

    # -- adapters
    def adapter_host_copy(self, info: AdapterInfo, adapters: AdapterManager) -> torch.Tensor:
        """The adapter's packed weights from the host tier, reading them from disk on a miss."""
        host = self.host.get(info.name)
        if host is None:
            host = info.pack(self.page_size, self.dtype)
            if self.device.type == "cuda" and not host.is_pinned():
                host = host.pin_memory()
            self.host[info.name] = host
        for dropped in adapters.admit_host(info.name):
            self.host.pop(dropped, None)
        return host

    def _load_adapters(self, loads: list[tuple[str, list[int]]], adapters: AdapterManager,
                       on_piece: Callable[[int], None] | None = None) -> None:
        """Copy adapters into their pool pages: per adapter one host -> device copy of its
        layers, then one `index_copy_` into the pool's (layer, page) rows, wherever its pages
        lie. With `on_piece`, a piece of layers at a time (`self.piece_starts`), on_piece(its
        first layer) called after each piece's copies.

        The rows' ids travel to the device once, for the whole call, in one pinned tensor
        (the caching host allocator reuses its block once the copy is done; a pageable one
        would block the host until the stream drains, which serialised prefetch copies with
        the forward on the H200). A copy of each run of consecutive pages into the pool's
        [layers, pages, page] view instead launched one kernel per layer and run (the pool
        is too large for 32-bit indexing, so torch split each copy by layer): ~6,000 launches
        in each of S2's first steps, ~30 ms of host time before the forward could start."""
        L, P, ps = self.pool.shape
        hosts = [self.adapter_host_copy(adapters.adapters[name], adapters).view(L, len(pages), ps)
                 for name, pages in loads]
        starts = self.piece_starts if on_piece is not None else [0]
        pieces = list(zip(starts, starts[1:] + [L]))
        # pool rows in the order the copies read them: by piece, adapter, layer, page
        layer_rows = torch.arange(L)[:, None] * P
        page_ids = [torch.tensor(pages) for _, pages in loads]
        rows = torch.cat([(layer_rows[l0:l1] + ids).flatten() for l0, l1 in pieces for ids in page_ids])
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        pool, at = self.pool.view(L * P, ps), 0
        for l0, l1 in pieces:
            for host in hosts:
                src = host[l0:l1].to(self.device, non_blocking=True).view(-1, ps)
                pool.index_copy_(0, rows[at:at + len(src)], src)
                at += len(src)
            if on_piece is not None:
                on_piece(l0)

    def _load_for_step(self, loads: list[tuple[str, list[int]]],
                       adapters: AdapterManager) -> dict[int, torch.cuda.Event]:
        """The adapters this step reads and no prefetch brought: {a piece's first layer: the
        event after its layers' copies}, for the forward to wait for piece by piece (empty
        when there is nothing to wait for). On the GPU the copies run on the copy stream, a
        piece of layers at a time, so the forward's first layers run while the later
        layers' weights are still arriving: the step waits for its first piece's copies,
        not all of them (H200, replayed 60 s traces of 1,000 / 2,000 adapters: steps with
        prompts and copies 15.86 / 16.62 -> 14.42 / 15.28 ms, as fast as those without).
        They wait for everything queued before them: their pages may be ones an earlier
        step read or wrote (a finished request's KV, an evicted adapter)."""
        if not loads:
            return {}
        if self.copy_stream is None:
            self._load_adapters(loads, adapters)
            return {}
        ready: dict[int, torch.cuda.Event] = {}

        def mark(layer: int) -> None:
            ready[layer] = torch.cuda.Event()
            ready[layer].record()

        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self._load_adapters(loads, adapters, mark)
        return ready

    # -- the step
    def execute(self, plan: SchedulerPlan, adapters: AdapterManager):
        """Run the plan's step and sample it: (tokens, logprobs), one per sequence."""
        return self.collect(self.launch(plan, adapters))

    def launch(self, plan: SchedulerPlan, adapters: AdapterManager,
               prev: Flight | None = None) -> Flight | None:
        """Queue the plan's step on the device (None when it has no sequences). `prev`: the
        step still running, not yet collected (async scheduling); the decode rows whose
        last token it samples take their input ids from its tokens on the device."""
        if self.copy_stream is not None:  # prefetches of the last step land before we read
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        if plan.empty:
            ready = self._load_for_step(plan.adapter_loads, adapters)
            for event in ready.values():  # (the next step waits for the copy stream)
                torch.cuda.current_stream().wait_event(event)
            self._prefetch(plan.prefetch, adapters, self._mark())
            return None
        batch = self.prepare(plan, adapters)
        fed = self._fed_ids(plan, prev)
        graphed = self.graphs is not None and self.graphs.fits(batch)
        if graphed:
            step = self.graphs.feed(batch, fed)
        else:
            batch = batch.to(self.device)
            if fed is not None:
                batch.input_ids.index_copy_(0, *fed)
        # The adapter copies are queued after this step's inputs: the copy engine serves an
        # adapter copy ready first before small uploads queued behind it, and the GPU idled
        # for each prefetch in turn (H200, S2 with 2,000 adapters: 5.9 ms a rank-64 adapter
        # of all seven modules; the copies ran beside compute 0.6 ms of 231).
        inputs = self._mark()
        ready = self._load_for_step(plan.adapter_loads, adapters)
        logits = self.graphs.replay(step, ready) if graphed else self._forward(batch, ready)
        flight = Flight(plan, logits, self.config.async_scheduling)
        self._prefetch(plan.prefetch, adapters, inputs)  # overlaps the forward
        return flight

    def _mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the compute stream (None on a CPU)."""
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _forward(self, batch: Batch, ready: dict[int, torch.cuda.Event]) -> torch.Tensor:
        """The eager forward, each piece of layers after its adapter copies (`ready`)."""
        if not ready:
            return self.model.forward(batch, self.pool)

        def wait(layer: int) -> None:
            if layer in ready:
                torch.cuda.current_stream().wait_event(ready[layer])

        self.model.layer_hook = wait
        try:
            return self.model.forward(batch, self.pool)
        finally:
            self.model.layer_hook = None

    def _fed_ids(self, plan: SchedulerPlan, prev: Flight | None):
        """(rows, ids) on the device: the decode rows whose last token `prev` samples."""
        if prev is None:
            return None
        where = {r.request_id: i for i, r in enumerate(prev.plan.seqs)}
        pairs = [(i, where[r.request_id]) for i, r in enumerate(plan.decode) if r.num_pending]
        if not pairs:
            return None
        # (pinned and non-blocking: a pageable copy would wait for the running step)
        idx = torch.tensor(list(zip(*pairs)), pin_memory=self.device.type == "cuda")
        rows, src = idx.to(self.device, non_blocking=True)
        return rows, prev.tokens[src]

    def collect(self, flight: Flight | None):
        """The tokens and logprobs of a launched step (waits for it)."""
        if flight is None:
            return [], []
        if flight.logits is None:  # greedy, no logprobs: only the tokens come back
            if flight.done is not None:
                flight.done.synchronize()
            return flight.host.tolist(), [None] * len(flight.plan.seqs)
        return self.sample(flight.logits, flight.plan.seqs, flight.tokens)

    def _prefetch(self, loads, adapters: AdapterManager, after: torch.cuda.Event | None = None) -> None:
        """Copy prefetched adapters on a side stream, issued once the forward is queued, so
        the copies run beside it. Their pages were free (or held idle adapters) at scheduling
        time: this step's forward never reads them, so the side stream need not wait for it.
        `after`: an event after this step's inputs were uploaded, which waits in turn for a
        step still running (async scheduling), whose pages the copies may overwrite (a
        request that ended or was preempted meanwhile). The next step's compute waits for
        these copies. (The H200 showed the cost of doing
        otherwise: with the copies issued first, and a pageable page-index copy that blocked
        the host until the side stream drained, a decode step with 8 prefetches took 18.6
        ms, not 6.3.)"""
        if not loads:
            return
        if self.copy_stream is None:
            return self._load_adapters(loads, adapters)
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            self._load_adapters(loads, adapters)

    def prepare(self, plan: SchedulerPlan, adapters: AdapterManager) -> Batch:
        """The step's batch as host tensors (the caller moves it, or copies it into graphs).
        Built from plain lists, one tensor per field: this runs every step, on the CPU,
        while the GPU waits."""
        seqs, bs = plan.seqs, self.block_size
        ids, positions, slots, q_start, ctx = [], [], [], [0], []
        for r in seqs:
            start, end, table = r.num_computed, r.num_tokens, r.block_table
            ids += r.token_ids_from(start)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            q_start.append(len(ids))
            ctx.append(end)
        width = max(len(r.block_table) for r in seqs)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in seqs]
        batch = Batch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            ctx_lens=torch.tensor(ctx, dtype=torch.int32),
            ctx_lens_list=ctx,
            q_start=q_start,
            q_start_t=torch.tensor(q_start, dtype=torch.int32),
            num_decode=len(plan.decode),
            logits_index=torch.tensor(q_start[1:]) - 1,
            lora=None,
        )
        d = batch.num_decode
        if d < len(seqs):  # prompts: the prefill kernel's work list; decode rows: their own
            prompts = [s >= d for s in range(len(seqs))]
            batch.tiles = torch.tensor(token_tiles(q_start, self.tile, prompts), dtype=torch.int32)
            if d:
                batch.dec_ctx_lens = batch.ctx_lens[:d]
        batch.lora = self.lora_meta(seqs, batch, adapters)
        return batch

    def lora_meta(self, seqs: list[Request], batch: Batch, adapters: AdapterManager) -> LoraMeta | None:
        """The batch's LoRA metadata, None when no row has an adapter. Segments (one per
        sequence: the batch's own q_start) and MBGMM's work list (the tiles of the prompts
        with an adapter) only for steps with prompts, the ones MBGMM runs."""
        names = tuple(dict.fromkeys(r.adapter for r in seqs if r.adapter))
        if not names:
            return None
        # The adapter side (pages, offsets, ranks) changes only when the batch's adapter set
        # does or an adapter moves: in steady decode it is the same object step after step
        # (the graphs then skip copying it again).
        key = (names, adapters.loads, adapters.evictions)
        if self._adapter_side[0] != key:
            self._adapter_side = (key, self._adapter_tensors(names, adapters))
        pages, groups = self._adapter_side[1]
        slot_of = {n: i for i, n in enumerate(names)}
        seq_slot = [slot_of[r.adapter] if r.adapter else -1 for r in seqs]
        num_decode = batch.num_decode
        token_slot = seq_slot[:num_decode]
        for s, r in zip(seq_slot[num_decode:], seqs[num_decode:]):
            token_slot += [s] * r.num_new
        meta = LoraMeta(pages=pages, token_slot=torch.tensor(token_slot, dtype=torch.int32),
                        num_decode=num_decode, groups=groups)
        if num_decode < len(seqs):  # MBGMM: the prompts with an adapter; MBGMV: decode rows
            meta.seg_start, meta.seg_slot = batch.q_start_t, torch.tensor(seq_slot, dtype=torch.int32)
            keep = [i >= num_decode and s >= 0 for i, s in enumerate(seq_slot)]
            meta.tiles = torch.tensor(token_tiles(batch.q_start, self.tile, keep), dtype=torch.int32)
            if num_decode:
                meta.dec_slot = meta.token_slot[:num_decode]
        return meta

    def _adapter_tensors(self, names: tuple[str, ...], adapters: AdapterManager):
        """Page table [n_a, max_pages] and per-group offsets/ranks of the adapters `names`;
        pinned on CUDA, so the graphs copy them in without waiting for the running step."""
        pin = (lambda t: t.pin_memory()) if self.device.type == "cuda" else (lambda t: t)
        infos = [adapters.adapters[n] for n in names]
        max_pages = max(len(i.pages) for i in infos)
        pages = pin(torch.tensor([i.pages + [0] * (max_pages - len(i.pages)) for i in infos],
                                 dtype=torch.int32))
        per_adapter = [_layout_tensors(i.layout) for i in infos]
        # Rows padded (zeros) to a multiple of 4 adapters: each layer's slice of the ranks then
        # starts 16-byte aligned, as in the graphs' buffers. Triton specializes a pointer on
        # it, and one adapter's layer slices, 12 bytes apart, compiled MBGMV again while
        # serving (H200: 0.3-0.6 s steps).
        n_a, n_pad = len(infos), cdiv(len(infos), 4) * 4
        offsets = torch.zeros(n_pad, *per_adapter[0][0].shape, dtype=torch.int64)  # [n, 7, 2]
        offsets[:n_a] = torch.stack([o for o, _ in per_adapter])
        ranks = torch.zeros(len(per_adapter[0][1]), n_pad, per_adapter[0][1].shape[1],
                            dtype=torch.int32)  # [L, n, 7]
        ranks[:, :n_a] = torch.stack([r for _, r in per_adapter], dim=1)
        groups = {}
        for gname, mods in GROUPS.items():
            r = ranks[:, :, list(mods)].contiguous()
            if not r.any():
                continue
            groups[gname] = GroupMeta(
                offsets_a=pin(offsets[:, list(mods), 0].contiguous()),
                offsets_b=pin(offsets[:, list(mods), 1].contiguous()),
                ranks=pin(r),
                # the rank bucket, as graphs have it: eager steps then run the kernel
                # variants the warm-up compiled (rows keep their own ranks)
                max_rank=round_rank(int(r.max())),
                **self.group_shapes[gname],
            )
        return pages, groups

    # -- sampling
    def sample(self, logits: torch.Tensor, seqs: list[Request], greedy: torch.Tensor):
        """One token per sequence (`greedy`: the logits' argmax, taken at launch, for the
        greedy rows); vLLM-shaped logprobs of the raw distribution when asked."""
        tokens = greedy.tolist()
        want_lp = any(r.sampling.logprobs is not None for r in seqs)
        logp = torch.log_softmax(logits, dim=-1) if want_lp else None
        out_lp = []
        for i, r in enumerate(seqs):
            sp = r.sampling
            if not sp.greedy:
                tokens[i] = self._sample_row(logits[i], sp, r.request_id)
            if sp.logprobs is None:
                out_lp.append(None)
                continue
            row = logp[i]
            entry = {}
            if sp.logprobs:
                top = torch.topk(row, sp.logprobs)
                entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[tokens[i]] = float(row[tokens[i]])
            out_lp.append(entry)
        return tokens, out_lp

    def _sample_row(self, logits: torch.Tensor, sp: SamplingParams, request_id: str) -> int:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=logits.device)
            seed = sp.seed if sp.seed is not None else int(torch.randint(1 << 62, (), generator=self.rng))
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        x = logits / sp.temperature
        if sp.top_k and sp.top_k < x.shape[-1]:
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= sp.top_p
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
