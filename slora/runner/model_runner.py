"""The model runner: owns the pool tensor and the weights, launches steps and collects them.

`execute(plan)` is `collect(launch(plan))`. `launch` does, in order: build the step's batch
on the host (`BatchBuilder`), upload it (or copy it into a graph's static inputs), queue the
copies of the adapters the step loads itself (`HostAdapterTier.load_for_step`), run the
forward (replaying graphs or eagerly, each piece of layers after its own layers' copies),
take the greedy tokens, and queue the prefetch copies beside the forward. `collect` waits
for the tokens and samples the rows that need it (`Sampler`). With
`EngineConfig.async_scheduling` the engine launches the next step before it collects this
one; the decode rows' input ids are then taken on the device from this step's tokens.

    pool[num_layers, num_pages + 1, P]     P = block_size * 2 * num_kv_heads * head_dim

is allocated once. KV pages and adapter pages are both rows of it (see kernels/reference.py);
the last page is the scratch page, which the allocator never hands out.

With `EngineConfig.tensor_parallel_size` N > 1 (slora.distributed) every rank has a runner
over its shard: `model_config` is the rank's view (`ShardConfig`), the pool holds the rank's
slice of every page. Rank 0's `launch` sends each step to the workers, and every rank runs
`run` on the same batch.
"""

from __future__ import annotations

import contextlib

import torch

from slora.config import (LORA_MODULES, ConfigError, EngineConfig, ModelConfig, cdiv, max_model_len,
                          round_up)
from slora.core.adapters import AdapterManager
from slora.core.scheduler import SchedulerPlan
from slora.graphs import StepGraphs, piece_starts
from slora.kernels import make_backend
from slora.kernels import reference as ref
from slora.kernels.reference import LORA_ALIGN
from slora.kernels.tiles import tile_rows
from slora.model.llama import ADDED_GROUP, GROUPS, VOCAB_GROUPS, Batch, LlamaModel
from slora.model.loader import AdapterError, load_weights, random_weights, strides
from slora.model.quant import LINEAR_FIELDS, Fp8Weight, quantize_weights
from slora.runner.batch import BatchBuilder
from slora.runner.device import resolve_device, resolve_dtype, set_host_threads
from slora.runner.host_tier import HostAdapterTier
from slora.runner.sampling import Sampler, finite_rows, nonfinite_error


class Flight:
    """A launched step: its plan and its sampled tokens, on the device and, once `done`, on
    the host. Steps whose rows all decode greedily without logprobs or logit changes
    (penalties, logit_bias, min_tokens) copy back the tokens alone (`pipelined`: into pinned
    memory, without waiting); others keep their logits for the sampler. A graph's logits are
    its static output, which the next replay overwrites: the argmax (or the copy) is taken at
    launch. `prompt_rows`: the batch's prompt log-prob rows (`Batch.prompt_rows`), the
    logits rows after the sequences'."""

    def __init__(self, plan: SchedulerPlan, logits: torch.Tensor, pipelined: bool,
                 vocab: int | None = None, prompt_rows: tuple = ()) -> None:
        self.plan = plan
        self.prompt_rows = prompt_rows
        self.tokens = logits.argmax(dim=-1)
        # (a chunk short of its prompt's end samples nothing: its row is not looked at)
        tokens_only = not prompt_rows and all(
            r.sampling.greedy and r.sampling.logprobs is None and not r.sampling.changes_logits
            for r, s in zip(plan.seqs, plan.samples) if s)
        # (collected at once unless pipelined: no later replay can overwrite the logits)
        self.logits = None if tokens_only else logits.clone() if pipelined else logits
        self.host, self.done = None, None
        if tokens_only:
            # A row whose logits are not all finite comes back as -1 and fails alone. The
            # next step's decode rows read `tokens` (a valid id) on the device, not this.
            host = torch.where(finite_rows(logits, vocab), self.tokens, -1)
            self.host = host
            if pipelined and host.is_cuda:
                self.host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                self.host.copy_(host, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record()

    @property
    def tokens_only(self) -> bool:
        """Whether only the greedy tokens come back (nothing to sample on the host): the next
        step may launch before this one is collected."""
        return self.logits is None


class ModelRunner:
    """Owns the pool and the weights and runs steps: `launch` queues one, `collect` waits
    for its tokens. Its parts: `batches` (BatchBuilder), `host_tier` (HostAdapterTier),
    `sampler` (Sampler) and `graphs` (StepGraphs, None without CUDA graphs)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: str,
                 tp=None) -> None:
        """tp: this rank's `TensorParallel` (slora.distributed.worker.launch's on rank 0),
        required when config.tensor_parallel_size > 1."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # EngineConfig.host_threads for the step's host work; adapter reads keep the count
        # torch had (`HostAdapterTier.host_copy`; 0 on CPU: the threads as they are)
        read_threads = set_host_threads(config.host_threads) if self.device.type == "cuda" else 0
        full_config = model_config
        if (tp is None) != (config.tensor_parallel_size == 1):
            raise ValueError(f"ModelRunner: tensor_parallel_size="
                             f"{config.tensor_parallel_size} needs a TensorParallel group "
                             "(slora.distributed.worker.launch), and 1 none")
        self.tp = tp
        if tp is not None:
            from slora.distributed import ShardConfig

            self.device = tp.device
            model_config = ShardConfig.of(model_config, tp.size, tp.rank)
        self.model_config = model_config
        self.full_config = full_config
        self.block_size = config.block_size
        self.page_size = model_config.page_size(config.block_size)
        if self.page_size % LORA_ALIGN:
            raise ValueError(f"page size {self.page_size} (block_size x 2 x kv_heads x head_dim) "
                             f"must be a multiple of {LORA_ALIGN}; raise EngineConfig.block_size")
        if config.load_format == "dummy":
            weights = random_weights(full_config, self.dtype, self.device, config.seed)
        else:
            weights = load_weights(model_dir, full_config, self.dtype, self.device)
        # FP8 base weights: quantized here, on the device, from what was loaded (a
        # pre-quantized checkpoint's Fp8Weights stay as they are; its other linear weights are
        # quantized too). The freed 16-bit weights leave the allocator's cache, so the pool
        # sized below from the device's free memory takes their place.
        prequantized = any(isinstance(getattr(lw, f), Fp8Weight)
                           for lw in weights.layers for f in LINEAR_FIELDS)
        if config.quantization == "fp8" and full_config.num_experts:
            raise ConfigError("EngineConfig.quantization='fp8' is not supported with a "
                              "mixture-of-experts model (its experts are served in the model "
                              "dtype); leave quantization None")
        if config.quantization == "fp8" or prequantized:
            weights = quantize_weights(weights)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if tp is not None:  # (after quantizing: each rank keeps the full model's scales)
            from slora.distributed import shard_weights, vocab_shard

            weights = shard_weights(weights, full_config, model_config)
            tp.vocab = vocab_shard(model_config)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.backend = make_backend(config.backend, self.device, config.gemm_max_rows)
        self.backend.tp = tp
        self.model = LlamaModel(model_config, weights, self.backend, config.block_size, tp,
                                max_added=config.max_added_tokens, experts=config.moe_experts)
        self.num_pages = self._pool_pages() if tp is None else tp.agree(self._pool_pages())
        # One page more than the allocator hands out: padded rows of a captured batch write
        # their KV there (`scratch_page`), never into a live page.
        self.pool = torch.zeros(model_config.num_layers, self.num_pages + 1, self.page_size,
                                dtype=self.dtype, device=self.device)
        self.scratch_page = self.num_pages
        self.max_model_len = max_model_len(config, model_config, self.num_pages)
        self.cuda = self.device.type == "cuda"
        # the first layer of each piece a step is cut into: its CUDA graphs, and the copies of
        # the adapters it loads itself, each piece waited for before its layers run
        self.piece_starts = piece_starts(model_config.num_layers)
        if tp is None:
            self.host_tier = HostAdapterTier(self.pool, self.dtype, self.piece_starts, read_threads)
        else:
            from slora.distributed import ShardedHostTier, WorkerHostTier

            tier = ShardedHostTier if tp.rank == 0 else WorkerHostTier
            self.host_tier = tier(tp, self.pool, self.dtype, self.piece_starts, read_threads)
        self._norm_stream = None  # DoRA's norms (`weight_norms`), on a GPU
        self.tile_rows = tile_rows(self.device, self.dtype)  # prefill kernels' work-tile tokens
        # row strides and output widths of each LoRA module group: fixed by the model
        self.group_shapes = {
            g: dict(stride_in=strides(model_config, mods[0])[0],
                    strides_out=tuple(strides(model_config, m)[1] for m in mods),
                    out_dims=tuple(model_config.module_dims(m)[1] for m in mods))
            for g, mods in [(g, [LORA_MODULES[i] for i in mods]) for g, mods in GROUPS.items()]
            + [(g, [m]) for g, m in VOCAB_GROUPS.items()]}
        # added tokens: rows of hidden, their lm_head rows as A and embedding rows as B^T
        h = model_config.hidden_size
        self.group_shapes[ADDED_GROUP] = dict(stride_in=round_up(h, LORA_ALIGN),
                                              strides_out=(round_up(h, LORA_ALIGN),),
                                              out_dims=(h,))
        self.batches = BatchBuilder(
            self.block_size, self.tile_rows, self.group_shapes, pin=self.cuda,
            max_added=config.max_added_tokens,
            decode_lora=config.decode_lora if self.backend.name != "torch" else None,
            device=self.device)
        self.sampler = Sampler(config.seed, model_config.vocab_size)
        graphed = self.cuda and config.cuda_graphs and self.backend.name != "torch"
        self.graphs = (self.make_graphs(config.max_num_seqs, config.mixed_graph_tokens)
                       if graphed else None)

    def make_graphs(self, max_num_seqs: int, mixed_tokens: int = 0,
                    capture: bool = True) -> StepGraphs:
        """The CUDA graphs of this runner's model and pool (see StepGraphs)."""
        return StepGraphs(
            self.model, self.pool, scratch_page=self.scratch_page, block_size=self.block_size,
            piece_starts=self.piece_starts, group_shapes=self.group_shapes,
            tile_rows=self.tile_rows, max_blocks=cdiv(self.max_model_len, self.block_size),
            max_num_seqs=max_num_seqs, mixed_tokens=mixed_tokens, capture=capture)

    def weight_norms(self, items) -> list[torch.Tensor]:
        """DoRA's norms: for each (layer, module, A [r, d_in], B [d_out, r] already scaled),
        ||W + B A|| over each output row of the module's served base weight W (its rows of
        the fused q|k|v or gate|up weight; an FP8 weight dequantized to the model dtype, as
        the twin's GEMM uses it), in float32 (`reference.dora_norms`), on the host.

        Computed here, on the device that holds the weights, once per host-tier miss of a DoRA
        adapter (the host copy keeps the result), rather than on the host, which would need a
        copy of the base weights. On a GPU it runs on a stream of its own and waits only for
        itself: the weights are read-only, so it may run beside a step."""
        if self.cuda and self._norm_stream is None:
            self._norm_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._norm_stream) if self.cuda else contextlib.nullcontext():
            norms = [ref.dora_norms(self._module_weight(layer, module), A.to(self.device),
                                    B.to(self.device)) for layer, module, A, B in items]
            # one copy back (one wait for this stream), split on the host
            return list(torch.cat(norms).cpu().split([n.shape[0] for n in norms]))

    def _module_weight(self, layer: int, module: str) -> torch.Tensor:
        """One LoRA module's rows of layer `layer`'s served base weight, in the model dtype."""
        cfg, lw = self.model_config, self.model.w.layers[layer]
        q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        field, start, end = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv),
                             "v_proj": ("qkv", q + kv, q + 2 * kv), "o_proj": ("o", 0, None),
                             "gate_proj": ("gate_up", 0, i), "up_proj": ("gate_up", i, 2 * i),
                             "down_proj": ("down", 0, None)}[module]
        w = getattr(lw, field)
        if isinstance(w, Fp8Weight):
            return Fp8Weight(w.weight[start:end], w.scale[start:end]).dequantize(self.dtype)
        return w[start:end]

    @property
    def mixed_graph_tokens(self) -> int:
        """The setting in effect: steps with prompts run eagerly where there are no graphs."""
        return self.graphs.mixed_tokens if self.graphs is not None else 0

    @property
    def page_bytes(self) -> int:
        """Bytes of one page id across all layers (on each rank)."""
        return self.model_config.num_layers * self.page_size * self.pool.element_size()

    @property
    def host_page_bytes(self) -> int:
        """Host-tier bytes of one adapter page id: every rank's shard, on rank 0."""
        return self.page_bytes * (1 if self.tp is None else self.tp.size)

    def adapter_view(self, name: str, layout, pack):
        """(layout, pack) of adapter `name` as this runner's pool and host tier hold it, from
        its full-model `layout` and `pack`: as they are on one device; under tensor
        parallelism the rank's layout and a pack of every rank's shard (slora.distributed).
        AdapterError under tensor parallelism for a DoRA adapter (its per-channel norms are
        over the whole weight) and for LoRA on embed_tokens / lm_head or added tokens (their
        rows are not sharded)."""
        if self.tp is None:
            return layout, pack
        if layout.dora_modules:
            raise AdapterError(f"adapter {name!r}: DoRA adapters are not served with "
                               f"tensor_parallel_size={self.tp.size} (supported: LoRA "
                               "adapters; DoRA with tensor_parallel_size=1)", adapter=name)
        if any(layout.vocab_ranks) or layout.added_tokens:
            raise AdapterError(f"adapter {name!r}: LoRA on embed_tokens / lm_head and added "
                               f"tokens are not served with tensor_parallel_size={self.tp.size} "
                               "(supported: LoRA on the linear modules; the vocabulary modules "
                               "with tensor_parallel_size=1)", adapter=name)
        from slora.core.adapters import AdapterLayout
        from slora.distributed import ShardConfig, sharded_pack

        full, n = self.full_config, self.tp.size
        shards = [ShardConfig.of(full, n, k) for k in range(n)]
        return (AdapterLayout.build(self.model_config, [list(r) for r in layout.ranks]),
                sharded_pack(pack, full, layout, shards))

    @property
    def dead(self) -> str | None:
        """Why the tensor-parallel group cannot serve (a worker died); None while it can."""
        return None if self.tp is None else self.tp.dead

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing on one device)."""
        if self.tp is not None:
            self.tp.close()

    def _pool_pages(self) -> int:
        """The pool's pages: `num_pages`, or as many as the memory budget holds."""
        c = self.config
        if c.num_pages is not None:
            return c.num_pages
        page_bytes = (self.model_config.num_layers * self.page_size
                      * torch.empty((), dtype=self.dtype).element_size())
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

    # -- the step
    def execute(self, plan: SchedulerPlan, adapters: AdapterManager):
        """Run the plan's step and sample it: (tokens, logprobs, errors), see `collect`."""
        return self.collect(self.launch(plan, adapters))

    def launch(self, plan: SchedulerPlan, adapters: AdapterManager,
               prev: Flight | None = None) -> Flight | None:
        """Queue the plan's step on the device (None when it has no sequences). `prev`: the
        step still running, not yet collected (async scheduling); the decode rows whose
        last token it samples take their input ids from its tokens on the device.
        Under tensor parallelism the step goes to the workers first; any failure then leaves
        the ranks out of step, so it ends the group (`TensorParallel.fail`)."""
        batch = None if plan.empty else self.batches.prepare(plan, adapters)
        pairs = self._prev_pairs(plan, prev)
        loads, prefetch = plan.adapter_loads, plan.prefetch
        tokens = prev.tokens if prev is not None else None
        if self.tp is None:
            logits = self.run(batch, pairs, tokens, loads, prefetch, adapters)
        else:
            self.tp.check()
            try:
                if batch is not None or loads or prefetch:
                    width = self.graphs.max_pages if self.graphs is not None else 0
                    self.tp.send_step((batch, pairs, [p for _, p in loads],
                                       [p for _, p in prefetch], width))
                logits = self.run(batch, pairs, tokens, loads, prefetch, adapters)
            except Exception as e:
                raise self.tp.fail(e) from e
        return None if logits is None else Flight(
            plan, logits, self.config.async_scheduling, self.model_config.vocab_size,
            batch.prompt_rows if batch is not None else ())

    def run(self, batch: Batch | None, pairs, prev_tokens, loads, prefetch,
            adapters: AdapterManager | None) -> torch.Tensor | None:
        """Every rank's part of a step: the adapter copies (`loads` before the forward,
        `prefetch` beside it), the forward over `batch` (None: copies only), the logits.
        `pairs`: (row, index into `prev_tokens`) of the decode rows whose input id is a token
        of the step still running (None: no such row)."""
        tier = self.host_tier
        tier.wait_for_copies()
        if batch is None:
            ready = tier.load_for_step(loads, adapters)
            for event in ready.values():  # (the next step waits for the copy stream)
                torch.cuda.current_stream().wait_event(event)
            tier.prefetch(prefetch, adapters, self._mark())
            return None
        ids_from_prev = self._ids_from_prev(pairs, prev_tokens)
        graphed = self.graphs is not None and self.graphs.fits(batch)
        if graphed:
            step = self.graphs.feed(batch, ids_from_prev)
        else:
            batch = batch.to(self.device)
            if ids_from_prev is not None:
                batch.input_ids.index_copy_(0, *ids_from_prev)
        # The adapter copies queue after this step's inputs: the copy engine serves copies in
        # the order they are queued, so an adapter copy queued first would delay the small
        # uploads the forward waits for.
        inputs = self._mark()
        ready = tier.load_for_step(loads, adapters)
        logits = self.graphs.replay(step, ready) if graphed else self._forward(batch, ready)
        tier.prefetch(prefetch, adapters, inputs)  # overlaps the forward
        return logits

    def _mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the compute stream (None on a CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _forward(self, batch: Batch, ready: dict[int, torch.cuda.Event]) -> torch.Tensor:
        """The eager forward, each piece of layers after its adapter copies (`ready`: {a
        piece's first layer: the event after its layers' copies})."""
        model, pool = self.model, self.pool
        if not ready:
            return model.forward(batch, pool)
        hidden = None
        for start, end in zip(self.piece_starts, self.piece_starts[1:] + [model.num_layers]):
            if start in ready:
                torch.cuda.current_stream().wait_event(ready[start])
            if start == 0:  # (after layer 0's copies: they hold the embedding LoRA)
                hidden = model.embed(batch, pool)
            hidden = model.layers(batch, pool, hidden, start, end)
        return model.head(batch, hidden, pool)

    @staticmethod
    def _prev_pairs(plan: SchedulerPlan, prev: Flight | None) -> list[tuple[int, int]] | None:
        """(row, row of `prev`) of the decode rows whose last token `prev` samples (None: no
        such row)."""
        if prev is None:
            return None
        where = {r.request_id: i for i, r in enumerate(prev.plan.seqs)}
        pairs = [(i, where[r.request_id]) for i, r in enumerate(plan.decode) if r.num_pending]
        return pairs or None

    def _ids_from_prev(self, pairs, prev_tokens: torch.Tensor | None):
        """(rows, ids) on the device: the rows of `pairs` and the tokens of the step before
        that replace their input ids (None: no such row)."""
        if not pairs:
            return None
        # (pinned and non-blocking: a pageable copy would wait for the running step)
        idx = torch.tensor(list(zip(*pairs)), pin_memory=self.cuda)
        rows, src = idx.to(self.device, non_blocking=True)
        return rows, prev_tokens[src]

    def collect(self, flight: Flight | None):
        """(tokens, logprobs, errors) of a launched step (waits for it); `errors`: {row:
        message} for the rows that failed alone (see `Sampler.sample`). Prompt log-probs go
        straight onto their requests (`Request.prompt_logprobs`)."""
        if flight is None:
            return [], [], {}
        if flight.tokens_only:
            if flight.done is not None:
                flight.done.synchronize()
            tokens = flight.host.tolist()
            seqs, samples = flight.plan.seqs, flight.plan.samples
            errors = {i: nonfinite_error(seqs[i]) for i, t in enumerate(tokens)
                      if t < 0 and samples[i]}
            return tokens, [None] * len(seqs), errors
        seqs, logits = flight.plan.seqs, flight.logits
        if flight.prompt_rows:
            self.sampler.prompt_logprobs(logits[len(seqs):], seqs, flight.prompt_rows)
            logits = logits[:len(seqs)]
        return self.sampler.sample(logits, seqs, flight.tokens[:len(seqs)], flight.plan.samples)
