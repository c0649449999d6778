"""CUDA graphs for decode steps, LoRA kernels inside, for any mix of adapters and base rows.

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch cost. Graphs are captured lazily, one per (batch bucket, rank bucket, adapter-page
bucket), over static device buffers sized for the largest batch. Each step copies its host
batch into the first B rows of the buffers and replays the graph of the smallest bucket that
holds it. Padded rows are base-only (token_slot -1) and read and write only the pool's
scratch page, so they never touch a live page.
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
        self.mempool = torch.cuda.graph_pool_handle()
        self.max_pages = 0
        self._alloc(max_pages=1)

    def _alloc(self, max_pages: int) -> None:
        """Static buffers; growing the adapter-page width drops the graphs that used them."""
        dev, B, L = self.runner.device, self.max_batch, self.runner.cfg.num_layers
        i32 = dict(dtype=torch.int32, device=dev)
        self.graphs.clear()
        self.max_pages = max_pages
        scratch = self.runner.scratch_page
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), scratch * self.runner.block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((B, self.max_blocks), scratch, **i32)
        self.ctx = torch.ones(B, **i32)
        self.token_slot = torch.full((B,), -1, **i32)
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
            rank_bucket = _pow2(max(g.max_rank for g in lora.groups.values()), 16)
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
        scratch, bs = self.runner.scratch_page, self.runner.block_size
        self.ids[:n].copy_(b.input_ids)
        self.positions[:n].copy_(b.positions)
        self.slots[:n].copy_(b.slot_mapping)
        self.slots[n:bucket].fill_(scratch * bs)
        self.tables[:n].fill_(scratch)
        self.tables[:n, :b.block_tables.shape[1]].copy_(b.block_tables)
        self.ctx[:n].copy_(b.ctx_lens)
        self.ctx[n:bucket].fill_(1)
        self.token_slot[:bucket].fill_(-1)
        lora = b.lora
        if lora is None:
            return
        self.token_slot[:n].copy_(lora.token_slot)
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
                            num_decode=bucket,
                            seg_start=self.token_slot.new_zeros(0),
                            seg_slot=self.token_slot.new_zeros(0), groups=groups)
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
