"""A step's batch and its LoRA metadata, built on the host from the scheduler's plan.

Built from plain lists, one tensor per field: this runs every step, on the CPU, while the
GPU waits. The runner moves the batch to the device, or StepGraphs copies it into the
static buffers of a graph.
"""

from __future__ import annotations

import functools

import torch

from slora.config import LORA_MODULES, VOCAB_MODULES, cdiv
from slora.core.adapters import AdapterLayout, AdapterManager
from slora.core.scheduler import SchedulerPlan
from slora.graphs import round_rank
from slora.kernels import DecodeSegments, GroupMeta, LoraMeta
from slora.kernels import segments, tuning
from slora.kernels.tiles import token_tiles
from slora.model.llama import ADDED_GROUP, GROUPS, VOCAB_GROUPS, Batch
from slora.request import Request


@functools.lru_cache(maxsize=4096)
def _layout_tensors(layout: AdapterLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An adapter layout as tensors (offsets [7 + 3, 2], ranks [L, 7 + 3], DoRA rows [7 + 3],
    -1: none): the seven modules, then VOCAB_MODULES, then the added tokens (A: their lm_head
    rows, B^T: their embedding rows; rank: their count), whose ranks stand in every layer's
    row; built once per layout rather than from nested tuples every step."""
    ranks = [list(r) + list(layout.vocab_ranks) + [layout.added_tokens] for r in layout.ranks]
    added = (layout.added_offsets[1], layout.added_offsets[0])
    offsets = layout.offsets + layout.vocab_offsets + (added,)
    dora = (layout.dora or (-1,) * len(layout.offsets)) + (-1,) * (len(offsets) - 7)
    return (torch.tensor(offsets, dtype=torch.int64), torch.tensor(ranks, dtype=torch.int32),
            torch.tensor(dora, dtype=torch.int64))


class BatchBuilder:
    """block_size: tokens per KV page; tile_rows: the prefill kernels' work-tile tokens;
    group_shapes: per LoRA module group, its row strides and output widths (fixed by the
    model); pin: pin the adapter-side tensors (on a GPU), so the graphs copy them in without
    waiting for the running step; max_added: EngineConfig.max_added_tokens, the added-token
    group's rank bucket (the logits' extra columns); decode_lora: how a step's decode rows run
    their LoRA (`EngineConfig.decode_lora`: "auto" splits them per step between MBGMV and
    the rows grouped by adapter, from `device`'s table, `slora.kernels.segments`; None: MBGMV
    always, for backends without the choice)."""

    def __init__(self, block_size: int, tile_rows: int, group_shapes: dict[str, dict],
                 pin: bool, max_added: int = 0, decode_lora: str | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.block_size = block_size
        self.max_added = max_added
        self.tile_rows = tile_rows
        self.group_shapes = group_shapes
        self.pin = pin
        self.decode_lora = decode_lora
        self.table = tuning.kind(device)
        self.decode_tile = segments.decode_tile_rows(device)
        self._adapter_side: tuple = (None, None)  # (key, tensors): see lora_meta

    def prepare(self, plan: SchedulerPlan, adapters: AdapterManager) -> Batch:
        """The step's batch as host tensors: decode rows first, then the prompts' tokens. Each
        row computes positions num_computed .. + its chunk (`SchedulerPlan.new_tokens`) and
        attends to every position before its own: a chunk's context is its cached prefix and
        itself (ctx_lens = the chunk's end). The logits rows are each sequence's last token,
        then the chunk positions that give prompt log-probs (`Request.prompt_logprob_rows`)."""
        seqs, bs = plan.seqs, self.block_size
        ids, positions, slots, q_start, ctx = [], [], [], [0], []
        prompt_rows, prompt_index = [], []
        d = len(plan.decode)  # (a decode row scores no prompt token: only prompts are read)
        for i, r in enumerate(seqs):
            start, table = r.num_computed, r.block_table
            end = start + plan.new_tokens(r)
            if i >= d and r.sampling.prompt_logprobs is not None:
                rows = r.prompt_logprob_rows(start, end)
                if rows:
                    prompt_rows.append((i, rows.start, len(rows)))
                    prompt_index += range(len(ids) + rows.start - start,
                                          len(ids) + rows.stop - start)
            ids += r.token_ids_from(start, end)
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
            q_start_list=q_start,
            q_start_tensor=torch.tensor(q_start, dtype=torch.int32),
            num_decode=d,
            logits_index=(torch.tensor(q_start[1:]) - 1 if not prompt_index
                          else torch.tensor([q - 1 for q in q_start[1:]] + prompt_index)),
            lora=None,
            prompt_rows=tuple(prompt_rows),
        )
        if d < len(seqs):  # prompts: the prefill kernel's work list; decode rows: their own
            prompts = [s >= d for s in range(len(seqs))]
            batch.tiles = torch.tensor(token_tiles(q_start, self.tile_rows, prompts),
                                       dtype=torch.int32)
            if d:
                batch.dec_ctx_lens = batch.ctx_lens[:d]
        batch.lora = self.lora_meta(seqs, batch, adapters)
        return batch

    def lora_meta(self, seqs: list[Request], batch: Batch,
                  adapters: AdapterManager) -> LoraMeta | None:
        """The batch's LoRA metadata, None when no row has an adapter. Segments (one per
        sequence: the batch's own q_start_tensor) and MBGMM's work list (the tiles of the
        prompts with an adapter) only for steps with prompts, the ones MBGMM runs."""
        names = tuple(dict.fromkeys(r.adapter for r in seqs if r.adapter))
        if not names:
            return None
        # The adapter side (pages, offsets, ranks; the adapters' bytes) changes only when the
        # batch's adapter set does or an adapter moves: in steady decode it is the same object
        # step after step (the graphs then skip copying it again).
        key = (names, adapters.loads, adapters.evictions)
        if self._adapter_side[0] != key:
            self._adapter_side = (key, (*self.adapter_tensors(names, adapters),
                                        [adapters.adapters[n].nbytes for n in names]))
        pages, groups, nbytes = self._adapter_side[1]
        slot_of = {n: i for i, n in enumerate(names)}
        seq_slot = [slot_of[r.adapter] if r.adapter else -1 for r in seqs]
        num_decode, q_start = batch.num_decode, batch.q_start_list
        token_slot = seq_slot[:num_decode]
        for i in range(num_decode, len(seqs)):
            token_slot += [seq_slot[i]] * (q_start[i + 1] - q_start[i])
        meta = LoraMeta(pages=pages, token_slot=torch.tensor(token_slot, dtype=torch.int32),
                        num_decode=num_decode, groups=groups)
        if self.decode_lora is not None:  # (in a step with prompts too: its decode rows)
            meta.dec_segments = self.decode_segments(token_slot[:num_decode], nbytes)
        if num_decode < len(seqs):  # MBGMM: the prompts with an adapter; MBGMV: decode rows
            meta.seg_start = batch.q_start_tensor
            meta.seg_slot = torch.tensor(seq_slot, dtype=torch.int32)
            keep = [i >= num_decode and s >= 0 for i, s in enumerate(seq_slot)]
            meta.tiles = torch.tensor(token_tiles(batch.q_start_list, self.tile_rows, keep),
                                      dtype=torch.int32)
            if num_decode:
                meta.dec_slot = meta.token_slot[:num_decode]
        if batch.prompt_rows:
            meta.head_slot = torch.tensor(
                seq_slot + [seq_slot[i] for i, _, count in batch.prompt_rows
                            for _ in range(count)], dtype=torch.int32)
        return meta

    def decode_segments(self, slots: list[int], nbytes: list[int]) -> DecodeSegments | None:
        """A step's decode rows (adapter rows `slots`; adapter row s of `nbytes[s]` bytes)
        grouped by adapter where their LoRA runs so (`segments.split_rows`), with the rest's
        adapter rows where MBGMV runs them beside the groups; None: MBGMV alone."""
        by_adapter, rest = segments.split_rows(self.table, self.decode_lora, slots, nbytes)
        if by_adapter is None:
            return None
        rows, seg_start, seg_slot, tiles = (
            torch.tensor(v, dtype=torch.int32)
            for v in segments.group_rows(by_adapter, self.decode_tile))
        return DecodeSegments(rows, seg_start, seg_slot, tiles, self.decode_tile,
                              rest=None if rest is None else torch.tensor(rest, dtype=torch.int32))

    def adapter_tensors(self, names: tuple[str, ...], adapters: AdapterManager):
        """Page table [n_a, max_pages] and per-group offsets/ranks of the adapters `names`."""
        pin = (lambda t: t.pin_memory()) if self.pin else (lambda t: t)
        infos = [adapters.adapters[n] for n in names]
        max_pages = max(len(i.pages) for i in infos)
        pages = pin(torch.tensor([i.pages + [0] * (max_pages - len(i.pages)) for i in infos],
                                 dtype=torch.int32))
        per_adapter = [_layout_tensors(i.layout) for i in infos]
        # Rows padded (zeros) to a multiple of 4 adapters: each layer's slice of the ranks then
        # starts 16-byte aligned, as in the graphs' buffers. Triton specializes a pointer on
        # its alignment, so an unaligned slice would compile another MBGMV variant while
        # serving.
        n_a, n_pad = len(infos), cdiv(len(infos), 4) * 4
        offsets = torch.zeros(n_pad, *per_adapter[0][0].shape, dtype=torch.int64)  # [n, 10, 2]
        offsets[:n_a] = torch.stack([o for o, _, _ in per_adapter])
        ranks = torch.zeros(len(per_adapter[0][1]), n_pad, per_adapter[0][1].shape[1],
                            dtype=torch.int32)  # [L, n, 10]
        ranks[:, :n_a] = torch.stack([r for _, r, _ in per_adapter], dim=1)
        dora = torch.full((n_pad, offsets.shape[1]), -1, dtype=torch.int64)  # [n, 10]
        dora[:n_a] = torch.stack([d for _, _, d in per_adapter])
        groups = {}
        # (a vocabulary group's ranks: one layer's row, [1, n, 1]; its slot is the layer
        # that holds it, AdapterLayout.vocab_layers)
        parts = {**{g: (list(mods), ranks) for g, mods in GROUPS.items()},
                 **{g: ([len(LORA_MODULES) + VOCAB_MODULES.index(m)], ranks[:1])
                    for g, m in VOCAB_GROUPS.items()},
                 ADDED_GROUP: ([len(LORA_MODULES) + len(VOCAB_MODULES)], ranks[:1])}
        for gname, (mods, layer_ranks) in parts.items():
            r = layer_ranks[:, :, mods].contiguous()
            if not r.any():
                continue
            d = dora[:, mods].contiguous()
            groups[gname] = GroupMeta(
                offsets_d=pin(d) if bool((d >= 0).any()) else None,
                offsets_a=pin(offsets[:, mods, 0].contiguous()),
                offsets_b=pin(offsets[:, mods, 1].contiguous()),
                ranks=pin(r),
                # the rank bucket, as graphs have it: eager steps then run the kernel
                # variants the warm-up compiled (rows keep their own ranks)
                max_rank=self.max_added if gname == ADDED_GROUP else round_rank(int(r.max())),
                **self.group_shapes[gname],
            )
        return pages, groups
