"""CUDA graphs for decode steps, LoRA kernels inside, for any mix of adapters and base rows.

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch cost. Graphs are captured lazily (or all at once by `Engine.warmup`), one per (batch
bucket, rank bucket, adapter-page bucket), over static device buffers sized for the largest
batch. Each step writes its host batch into pinned twins of those buffers, copies them over
in two transfers (the adapter-side tensors only when the batch's adapters changed), and
replays the graph of the smallest bucket that holds it. Padded rows are base-only
(token_slot -1) and read and write only the pool's scratch page, so they never touch a live
page.
"""

from __future__ import annotations

import torch

from slora.config import cdiv
from slora.kernels import GroupMeta, LoraMeta
from slora.model.llama import GROUPS, Batch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def round_rank(max_rank: int) -> int:
    """The rank a graph is captured for: a batch's largest rank, to a power of two >= 16."""
    return _pow2(max_rank, 16)


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_num_seqs) + (max_num_seqs,)
        self.max_batch = max_num_seqs
        # the longest sequence the engine admits (model limit, capped by the pool's size)
        max_len = min(runner.config.max_model_len or runner.cfg.max_position_embeddings,
                      runner.num_pages * runner.block_size)
        self.max_blocks = cdiv(max_len, runner.block_size)
        self.graphs: dict[tuple[int, int, int], tuple] = {}  # key -> (graph, logits, batch)
        self.max_pages = 0
        self._alloc(max_pages=1)

    def _alloc(self, max_pages: int) -> None:
        """Static buffers; growing the adapter-page width drops the graphs that used them."""
        dev, B, L = self.runner.device, self.max_batch, self.runner.cfg.num_layers
        i32 = dict(dtype=torch.int32, device=dev)
        self.graphs.clear()
        # A fresh private pool: once the dropped graphs release the old one, capturing into
        # it again trips PyTorch's allocator (an internal assert, seen on the H200).
        self.mempool = torch.cuda.graph_pool_handle()
        self.max_pages = max_pages
        scratch = self.runner.scratch_page
        # Per-token and per-sequence inputs live in two device buffers (int64, int32), each
        # filled from a pinned host twin by one copy a step.
        self.meta64 = torch.zeros(3, B, dtype=torch.long, device=dev)
        self.ids, self.positions, self.slots = self.meta64
        self.meta32 = torch.full((2 * B + B * self.max_blocks,), scratch, **i32)
        self.ctx, self.token_slot = self.meta32[:B], self.meta32[B:2 * B]
        self.tables = self.meta32[2 * B:].view(B, self.max_blocks)
        self.host64 = torch.zeros(self.meta64.shape, dtype=torch.long).pin_memory()
        self.host32 = torch.full(self.meta32.shape, scratch, dtype=torch.int32).pin_memory()
        self._filled_lora = None  # the adapter-side tensors last copied in (see _fill)
        self.pages = torch.zeros(B, max_pages, **i32)
        # per module group: offsets of A and B^T rows [B, G], ranks [L, B, G]
        self.group_bufs = {
            name: (torch.zeros(B, len(mods), dtype=torch.int64, device=dev),
                   torch.zeros(B, len(mods), dtype=torch.int64, device=dev),
                   torch.zeros(L, B, len(mods), **i32))
            for name, mods in GROUPS.items()}

    def fits(self, b: Batch) -> bool:
        return (b.input_ids.shape[0] <= self.max_batch
                and b.block_tables.shape[1] <= self.max_blocks)

    def run(self, b: Batch) -> torch.Tensor:
        """Logits [B, vocab] for a decode-only host batch, through a captured graph."""
        n = b.input_ids.shape[0]
        lora = b.lora
        rank_bucket = 0
        if lora is not None:
            rank_bucket = round_rank(max(g.max_rank for g in lora.groups.values()))
            if lora.pages.shape[1] > self.max_pages:
                self._alloc(_pow2(lora.pages.shape[1], 8))
        bucket = _bucket(n, self.buckets)
        self._fill(b, n, bucket)
        key = (bucket, rank_bucket, self.max_pages)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, rank_bucket)
        graph, logits, _ = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _fill(self, b: Batch, n: int, bucket: int) -> None:
        B, bs, scratch = self.max_batch, self.runner.block_size, self.runner.scratch_page
        h64, h32 = self.host64, self.host32
        ids, positions, slots = h64
        ids[:n], positions[:n], slots[:n] = b.input_ids, b.positions, b.slot_mapping
        slots[n:bucket] = scratch * bs  # padded rows write their KV to the scratch page
        ctx, token_slot = h32[:B], h32[B:2 * B]
        ctx[:n] = b.ctx_lens
        ctx[n:bucket] = 1
        token_slot[:bucket] = -1
        if b.lora is not None:
            token_slot[:n] = b.lora.token_slot
        tables = h32[2 * B:].view(B, self.max_blocks)
        width = b.block_tables.shape[1]
        tables[:n, :width] = b.block_tables
        tables[:n, width:] = scratch
        self.meta64[:, :bucket].copy_(h64[:, :bucket], non_blocking=True)
        self.meta32[:2 * B + n * self.max_blocks].copy_(h32[:2 * B + n * self.max_blocks],
                                                        non_blocking=True)
        # (The host twins are rewritten only after this step's sample has synchronised.)
        lora = b.lora
        if lora is None or lora.groups is self._filled_lora:
            return  # steady decode: the same adapters in the same pages as last step
        self._filled_lora = lora.groups
        n_a, width = lora.pages.shape
        self.pages[:n_a, :width].copy_(lora.pages)
        for gname, (off_a, off_b, ranks) in self.group_bufs.items():
            g = lora.groups.get(gname)
            if g is None:  # no adapter of this batch targets the group: rank 0 skips it
                ranks[:, :n_a].zero_()
                continue
            off_a[:n_a].copy_(g.offsets_a)
            off_b[:n_a].copy_(g.offsets_b)
            ranks[:, :n_a].copy_(g.ranks)

    def _static_batch(self, bucket: int, rank_bucket: int) -> Batch:
        lora = None
        if rank_bucket:
            groups = {}
            for gname in GROUPS:
                off_a, off_b, ranks = self.group_bufs[gname]
                groups[gname] = GroupMeta(
                    offsets_a=off_a[:bucket],
                    offsets_b=off_b[:bucket],
                    ranks=ranks[:, :bucket],
                    max_rank=rank_bucket,
                    **self.runner.group_shapes[gname])
            lora = LoraMeta(pages=self.pages[:bucket], token_slot=self.token_slot[:bucket],
                            num_decode=bucket, groups=groups)
        return Batch(input_ids=self.ids[:bucket], positions=self.positions[:bucket],
                     slot_mapping=self.slots[:bucket], block_tables=self.tables[:bucket],
                     ctx_lens=self.ctx[:bucket], ctx_lens_list=[1] * bucket,
                     q_start=list(range(bucket + 1)), q_start_t=self.token_slot.new_zeros(0),
                     num_decode=bucket,
                     logits_index=torch.arange(bucket, device=self.ids.device), lora=lora)

    def _capture(self, bucket: int, rank_bucket: int):
        batch = self._static_batch(bucket, rank_bucket)
        model, pool = self.runner.model, self.runner.pool
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels for these shapes
            model.forward(batch, pool)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = model.forward(batch, pool)
        # NOTE: the graph reads every tensor of `batch` by address: keep them all alive.
        return graph, logits, batch
