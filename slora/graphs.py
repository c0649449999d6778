"""CUDA graphs for engine steps, LoRA kernels inside, for any mix of adapters and base rows.

A step launches a few hundred small kernels; replaying a captured graph removes their launch
cost. Two kinds of graph, captured lazily (or by `Engine.warmup`, which runs the steps
`warmup_steps` names) over static device buffers:

- decode steps, one graph per (LoRA path, batch bucket, rank bucket, adapter-page bucket,
  DoRA groups, module groups): the path is the decode rows' LoRA, MBGMV, the rows grouped by
  adapter (`slora.kernels.segments`, whose segments and work list fill static buffers of the
  bucket's size) or both, each over its share of the rows;
- mixed steps (prompts, with or without decode rows) of at most `mixed_tokens` tokens, one per
  (decode rows' LoRA path, token bucket, sequence bucket, rank bucket, adapter-page bucket,
  DoRA groups, module groups), up to `EngineConfig.mixed_graph_tokens` (0: none). A larger
  mixed step runs eagerly: its kernels' work outweighs the host's time launching them.

A graph's key starts with its kind: "decode", "segments" and "hybrid" (decode steps: MBGMV, by
adapter, both), "mixed", "mixed-segments" and "mixed-hybrid" (the same paths for a mixed step's
decode rows).

A graph holds the LoRA kernels of the module groups its batch's adapters target (`GROUPS`:
q/k/v, o, gate/up, down), as an eager step runs them, so a batch of q/k/v/o adapters launches
no gate/up or down kernel. A batch whose groups have no graph of their own replays a captured
one holding more (its other groups at rank 0, returning at once) before a new one is captured.
The DoRA groups are those in which some adapter of the batch has DoRA rows: the graph holds
DoRA's rescale kernel there (`kernels/dora.py`), whose rows without DoRA return at once.

Each step writes its host batch into pinned twins of the buffers, copies them over in two
transfers (the adapter-side tensors only when the batch's adapters changed), and replays the
graph of the smallest bucket that holds it. A step's graph is captured as one graph per piece
of consecutive layers (`GRAPH_PIECES`, cut at `piece_starts`), each the model's forward over
that piece's layers, replayed in turn: launching a graph costs the host time in proportion to
its kernels, during which the GPU waits; in pieces, the GPU runs the first while the host
launches the rest, and a piece whose layers read adapters copied in this step waits for
those layers' copies alone.

Padding never touches a live page:
- padded tokens write their KV to the pool's scratch page and belong to no sequence, so
  attention and MBGMM never read them;
- padded decode rows are base-only (token_slot -1) and read the scratch page;
- padded sequences of a mixed step have no tokens (their q_start is the batch's end) and no
  adapter (seg_slot -1), and no work tile of the prefill kernels is theirs.

The prefill kernels (attention, MBGMM) walk work lists of (segment, token tile) items
(`slora.kernels.tiles`), copied in with the step; their grids depend only on the bucket, and
MBGMM sizes its work from the list's length on the device (its d_in split and column span),
so a bucket's empty items cost no work.

A step with prompts and decode rows runs the decode rows through the decode kernels and the
prompts through the prefill ones (`TritonBackend`). In a mixed graph, d (the decode rows:
tokens and sequences 0..d-1) varies within a bucket, so each decode kernel runs over the
bucket's first s_bucket rows (d <= sequences <= s_bucket) with the other rows switched off: the
decode attention kernel sees context length 1 past the decode rows (`Batch.dec_ctx_lens`; its
rows there are overwritten by the prefill kernel's), MBGMV adapter row -1 (`LoraMeta.dec_slot`;
by adapter, the decode rows' segments list rows below d alone);
the prefill kernels' work lists hold the prompts' tiles alone, as in an eager step. The decode
kernels never run over the prompts' tokens (t_bucket rows), only over s_bucket rows.
"""

from __future__ import annotations

import gc

import torch

from slora.config import LORA_MODULES, TOKEN_BUCKETS, bucket, buckets_up_to, cdiv
from slora.kernels import DecodeSegments, GroupMeta, LoraMeta
from slora.kernels.segments import decode_tile_rows
from slora.kernels.tiles import capacity
from slora.model.llama import ADDED_GROUP, GROUPS, VOCAB_GROUPS, Batch, LlamaModel, groups_of

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# mixed steps: sequences (coarse: a padded sequence costs programs that return); their tokens
# take slora.config.TOKEN_BUCKETS
MIXED_SEQ_BUCKETS = (4, 16, 64, 256, 512)
GRAPH_PIECES = 4  # pieces of layers a step is cut into (see the module docstring)


def piece_starts(num_layers: int) -> list[int]:
    """The first layer of each piece a step is cut into: its graphs' pieces, and the pieces
    of layers in which the runner copies the step's own adapters (waited for piece by piece)."""
    return sorted({num_layers * i // GRAPH_PIECES for i in range(GRAPH_PIECES)})


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def round_rank(max_rank: int) -> int:
    """The rank a graph is captured for: a batch's largest rank, to a power of two >= 16."""
    return _pow2(max_rank, 16)


class StepGraphs:
    """The graphs of one model over one pool, and the static buffers they replay over.

    model, pool: what the graphs run; scratch_page: the pool page padded tokens write to
    (never handed out); block_size: tokens per KV page; piece_starts: the first layer of each
    piece a step is captured in; group_shapes: per LoRA module group, its row strides and
    output widths (GroupMeta's); tile_rows: the prefill kernels' work-tile tokens;
    max_blocks: the widest block table (the longest sequence the engine admits);
    max_num_seqs: the most sequences a step has; mixed_tokens: the most tokens of a mixed
    step that replays a graph (0: decode steps only); capture: False runs the static
    buffers' forward eagerly instead of capturing it (on CPU, where there are no graphs: the
    tests check the padded buffers give the eager batch's tokens)."""

    def __init__(self, model: LlamaModel, pool: torch.Tensor, *, scratch_page: int,
                 block_size: int, piece_starts: list[int], group_shapes: dict[str, dict],
                 tile_rows: int, max_blocks: int, max_num_seqs: int, mixed_tokens: int = 0,
                 capture: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.scratch_page = scratch_page
        self.block_size = block_size
        self.piece_starts = piece_starts
        self.group_shapes = group_shapes
        self.tile_rows = tile_rows
        self.decode_tile = decode_tile_rows(self.device)  # (the decode rows' segments' tile)
        self.max_blocks = max_blocks
        self.capture = capture
        self.buckets = buckets_up_to(BATCH_BUCKETS, max_num_seqs)
        self.max_batch = max_num_seqs
        self.mixed_tokens = mixed_tokens
        self.token_buckets = buckets_up_to(TOKEN_BUCKETS, mixed_tokens) if mixed_tokens else ()
        self.seq_buckets = buckets_up_to(MIXED_SEQ_BUCKETS, max_num_seqs)
        self.max_tokens = max(max_num_seqs, mixed_tokens)
        self.graphs: dict[tuple, tuple] = {}  # key -> (pieces or None, logits, batch)
        self.max_pages = 0
        self._alloc(max_pages=1)

    def mixed_buckets(self, max_tokens: int) -> list[tuple[int, int]]:
        """(t, n) for every mixed-step graph bucket of at most `max_tokens` tokens a step can
        fill: a step of t tokens over n sequences, one of them a prompt of several tokens,
        fills it.

        A step's sequence bucket is capped by its token bucket (`feed`), so 13 tokens over 6
        sequences take the (16, 16) graph; n is the fewest sequences that reach each bucket,
        and stays under t: a step of t one-token sequences runs as decode rows (the decode
        graph), so it would capture no mixed graph."""
        out = []
        for t in self.token_buckets:
            if t > max_tokens:
                continue
            reach = {}  # sequence bucket -> the fewest sequences that reach it
            for n in range(1, min(t, self.max_batch + 1)):
                reach.setdefault(min(bucket(n, self.seq_buckets), t), n)
            out += [(t, reach[s]) for s in sorted(reach)]
        return out

    def _alloc(self, max_pages: int) -> None:
        """Static buffers; growing the adapter-page width drops the graphs that used them."""
        dev, B, T, L = self.device, self.max_batch, self.max_tokens, self.pool.shape[0]
        i32 = dict(dtype=torch.int32, device=dev)
        self.graphs.clear()
        self._superset_of: dict[tuple, tuple | None] = {}  # key -> the captured key it replays
        # A fresh private pool: once the dropped graphs release the old one, capturing into
        # it again trips an internal assert of PyTorch's allocator.
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        # One stream for every capture: the allocator hands a freed block of the pool only to
        # allocations on the stream that freed it, so captures on streams of their own would
        # each add their whole working set to the pool.
        self._capture_stream = torch.cuda.Stream(self.device) if self.capture else None
        self.max_pages = max_pages
        scratch = self.scratch_page
        # Per-token and per-sequence inputs live in two device buffers (int64, int32), each
        # filled from a pinned host twin by one copy a step. int64: token ids, positions, KV
        # slots [T], logits rows [B] (mixed steps; decode rows are their own). int32, in this
        # order: context lengths [B], then for mixed steps the decode kernel's context lengths
        # [B] (Batch.dec_ctx_lens), token adapter rows [T], decode rows' adapter rows [T]
        # (LoraMeta.dec_slot), segment starts [B + 1], segment adapter rows [B], the prompts'
        # work tiles of prefill attention and of MBGMM (slora.kernels.tiles), and for steps
        # whose decode rows run by adapter (LoraMeta.dec_segments) their rows [B], segment
        # starts [B + 1], adapter rows [B], work tiles and the rest's adapter rows for MBGMV
        # [B] (DecodeSegments.rest); then the block tables [B, blocks].
        # Every field starts 16-byte aligned: Triton specializes a pointer on it, and a graph's
        # kernels should be the variants eager steps run (aligned tensors of their own), or an
        # eager step compiles again while serving.
        self.meta64 = torch.zeros(4, cdiv(T, 2) * 2, dtype=torch.long, device=dev)
        self.ids, self.positions, self.slots, self.logits_index = self.meta64
        n_tiles = 1 + 2 * capacity(T, B, self.tile_rows)
        self._sizes32 = {"ctx": B, "dec_ctx": B, "token_slot": T, "dec_slot": T,
                         "q_start": B + 1, "seg_slot": B, "att_tiles": n_tiles,
                         "lora_tiles": n_tiles, "dec_rows": B, "dec_seg_start": B + 1,
                         "dec_seg_slot": B, "dec_tiles": 1 + 2 * capacity(B, B, self.decode_tile),
                         "dec_rest": B}
        self._at32, at = {}, 0  # each field's offset in meta32, a multiple of 4 int32s
        for name, size in self._sizes32.items():
            self._at32[name] = at
            at += cdiv(size, 4) * 4
        self._tables_at = at  # where the tables start
        self.meta32 = torch.full((self._tables_at + B * self.max_blocks,), scratch, **i32)
        for name, view in self._views32(self.meta32).items():
            setattr(self, name, view)
        self.tables = self.meta32[self._tables_at:].view(B, self.max_blocks)
        # Two pinned twins, used in turn: with async scheduling a step is filled while the one
        # before it may not have run its copy yet; the one before that has been collected.
        pin = dev.type == "cuda"
        self._twins = []
        for _ in range(2):
            h64 = torch.zeros(self.meta64.shape, dtype=torch.long, pin_memory=pin)
            h32 = torch.full(self.meta32.shape, scratch, dtype=torch.int32, pin_memory=pin)
            self._twins.append((h64, h32, self._views32(h32),
                                h32[self._tables_at:].view(B, self.max_blocks)))
        self._turn = 0
        self._arange = torch.arange(B, device=dev)  # a decode batch's logits rows
        # Every graph's logits, in one buffer: a graph's output stays allocated in the graphs'
        # memory pool for as long as the graph lives, so per-graph logits would hold
        # (graphs x rows x vocabulary) floats; a step's logits are used before the next replay.
        self.logits = torch.empty(B, self.model.logits_width, dtype=torch.float32, device=dev)
        self._filled_lora = None  # the adapter-side tensors last copied in (see _fill)
        self.pages = torch.zeros(B, max_pages, **i32)
        # per module group: offsets of A and B^T rows [B, G], ranks [L, B, G], DoRA rows [B, G]
        # (a vocabulary group: ranks [1, B, 1], the one layer's slot that holds it)
        shapes = [(name, L, len(mods)) for name, mods in GROUPS.items()]
        shapes += [(name, 1, 1) for name in (*VOCAB_GROUPS, ADDED_GROUP)]
        self.group_bufs = {
            name: (torch.zeros(B, G, dtype=torch.int64, device=dev),
                   torch.zeros(B, G, dtype=torch.int64, device=dev),
                   torch.zeros(layers, cdiv(B, 4) * 4, G, **i32),  # (layers 16-byte aligned)
                   torch.full((B, G), -1, dtype=torch.int64, device=dev))
            for name, layers, G in shapes}

    def _views32(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named int32 fields of meta32 (or of its host twin) before the block tables."""
        return {name: buf[at:at + self._sizes32[name]] for name, at in self._at32.items()}

    def fits(self, b: Batch) -> bool:
        n_tok, n_seq = b.input_ids.shape[0], len(b.q_start_list) - 1
        if n_seq > self.max_batch or b.block_tables.shape[1] > self.max_blocks or b.prompt_rows:
            return False  # (prompt log-prob rows: more logits rows than a graph's output has)
        return n_tok == b.num_decode or n_tok <= self.mixed_tokens

    def feed(self, b: Batch, ids_from_prev: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Copy a host batch that `fits` into the static inputs of its captured graph
        (capturing it on first use); returns the step for `replay`. `ids_from_prev`: (rows,
        ids) on the device that replace those rows' input ids (async scheduling: the tokens
        of a step still running). The runner queues its adapter copies between `feed` and
        `replay`, so that they do not hold up these uploads (see ModelRunner.launch)."""
        n_tok, n_seq = b.input_ids.shape[0], len(b.q_start_list) - 1
        lora = b.lora
        rank_bucket, groups, dora = 0, (), ()
        if lora is not None:
            # (the added tokens' group is sized max_added_tokens in every graph)
            rank_bucket = round_rank(max((g.max_rank for n, g in lora.groups.items()
                                          if n != ADDED_GROUP), default=0))
            # (with max_added_tokens every LoRA graph holds the added tokens' group, at rank
            # 0 for adapters that add none: a batch with one does not capture its own)
            groups = tuple(g for g in (*GROUPS, *VOCAB_GROUPS, ADDED_GROUP) if g in lora.groups
                           or (g == ADDED_GROUP and self.model.max_added))
            dora = tuple(g for g in groups
                         if g in lora.groups and lora.groups[g].offsets_d is not None)
            self.reserve_pages(lora.pages.shape[1])
        seg = None if lora is None else lora.dec_segments
        path = "" if seg is None else "segments" if seg.rest is None else "hybrid"
        if n_tok == b.num_decode:
            t_bucket = s_bucket = bucket(n_tok, self.buckets)
            key = (path or "decode", t_bucket, rank_bucket, self.max_pages, dora, groups)
        else:
            t_bucket = bucket(n_tok, self.token_buckets)
            s_bucket = min(bucket(n_seq, self.seq_buckets), t_bucket)
            key = ("mixed-" + path if path else "mixed", t_bucket, s_bucket, rank_bucket,
                   self.max_pages, dora, groups)
        self._fill(b, n_tok, n_seq, t_bucket, s_bucket)
        if ids_from_prev is not None:
            self.ids.index_copy_(0, *ids_from_prev)
        if key not in self.graphs:
            if key not in self._superset_of:  # (looked up once, not at every step)
                self._superset_of[key] = self._superset(key)
            key = self._superset_of[key] or key
            if key not in self.graphs:
                self.graphs[key] = self._capture(key[0], t_bucket, s_bucket, rank_bucket, dora,
                                                 groups)
        return self.graphs[key], n_seq

    def reserve_pages(self, width: int) -> None:
        """Make the adapter page table at least `width` pages wide (a power of two >= 8);
        growing it drops every graph, so the warm-up sets it first."""
        if width > self.max_pages:
            self._alloc(_pow2(width, 8))

    def _superset(self, key: tuple) -> tuple | None:
        """The captured graph of `key`'s bucket with the fewest DoRA groups, then module
        groups, that include all of `key`'s (None: none): the groups its batch lacks run at
        rank 0 and its rows without DoRA skip the rescale, returning at once, so a batch
        mixing adapters of two warmed group sets replays their union's graph rather than
        stopping to capture its own."""
        dora, want = set(key[-2]), set(key[-1])
        found = [k for k in self.graphs
                 if k[:-2] == key[:-2] and dora <= set(k[-2]) and want <= set(k[-1])]
        return min(found, key=lambda k: (len(k[-2]), len(k[-1]))) if found else None

    def replay(self, step, ready: dict[int, torch.cuda.Event] | None = None) -> torch.Tensor:
        """Logits [S, vocab] of a step `feed` returned. `ready`: {a piece's first layer: the
        event after which its layers' adapter pages hold their weights}, waited for before
        that piece."""
        (pieces, logits, batch), n_seq = step
        ready = ready or {}
        if pieces is None:  # capture=False
            for event in ready.values():
                torch.cuda.current_stream().wait_event(event)
            logits = self.model.forward(batch, self.pool)
        for start, graph in zip(self.piece_starts, pieces or ()):
            if start in ready:
                torch.cuda.current_stream().wait_event(ready[start])
            graph.replay()
        return logits[:n_seq]

    def _fill(self, b: Batch, n_tok: int, n_seq: int, t_bucket: int, s_bucket: int) -> None:
        bs, scratch = self.block_size, self.scratch_page
        h64, h32, h, tables = self._twins[self._turn]
        self._turn ^= 1
        ids, positions, slots, logits_index = h64
        ids[:n_tok], positions[:n_tok], slots[:n_tok] = b.input_ids, b.positions, b.slot_mapping
        ids[n_tok:t_bucket] = positions[n_tok:t_bucket] = 0
        slots[n_tok:t_bucket] = scratch * bs  # padded tokens write their KV to the scratch page
        h["ctx"][:n_seq] = b.ctx_lens
        h["ctx"][n_seq:s_bucket] = 1
        h["token_slot"][:t_bucket] = -1
        if b.lora is not None:
            h["token_slot"][:n_tok] = b.lora.token_slot
            seg = b.lora.dec_segments
            if seg is not None:  # (padded rows are base-only: in no segment, -1 in the rest)
                for name, t in (("dec_rows", seg.rows), ("dec_seg_start", seg.seg_start),
                                ("dec_seg_slot", seg.seg_slot), ("dec_tiles", seg.tiles)):
                    h[name][:t.shape[0]] = t
                if seg.rest is not None:
                    h["dec_rest"][:s_bucket] = -1
                    h["dec_rest"][:seg.rest.shape[0]] = seg.rest
        d = b.num_decode
        if n_tok != d:  # a mixed step's split (see the module docstring)
            logits_index[:n_seq] = b.logits_index
            logits_index[n_seq:s_bucket] = 0
            h["dec_ctx"][:s_bucket] = 1
            h["dec_ctx"][:d] = b.ctx_lens[:d]
            h["q_start"][:n_seq + 1] = b.q_start_tensor
            h["q_start"][n_seq + 1:s_bucket + 1] = n_tok  # padded sequences: no tokens
            h["dec_slot"][:t_bucket] = -1
            h["seg_slot"][:s_bucket] = -1
            h["att_tiles"][:b.tiles.shape[0]] = b.tiles  # the prompts' work tiles
            if b.lora is not None:
                h["dec_slot"][:d] = b.lora.token_slot[:d]
                h["seg_slot"][:n_seq] = b.lora.seg_slot
                h["lora_tiles"][:b.lora.tiles.shape[0]] = b.lora.tiles
        width = b.block_tables.shape[1]
        tables[:n_seq, :width] = b.block_tables
        tables[:n_seq, width:] = scratch
        # the whole int64 twin: one contiguous pinned copy (a slice of its rows, not being
        # contiguous, would first be gathered into pageable memory on the host)
        self.meta64.copy_(h64, non_blocking=True)
        end = self._tables_at + n_seq * self.max_blocks
        self.meta32[:end].copy_(h32[:end], non_blocking=True)
        lora = b.lora
        if lora is None or lora.groups is self._filled_lora:
            return  # steady decode: the same adapters in the same pages as last step
        self._filled_lora = lora.groups
        n_a, width = lora.pages.shape
        self.pages[:n_a, :width].copy_(lora.pages, non_blocking=True)  # (pinned: lora_meta)
        for gname, (off_a, off_b, ranks, off_d) in self.group_bufs.items():
            g = lora.groups.get(gname)
            if g is None or g.offsets_d is None:  # no DoRA row: the rescale skips the rows
                off_d[:n_a].fill_(-1)
            else:
                off_d[:n_a].copy_(g.offsets_d[:n_a], non_blocking=True)
            if g is None:  # no adapter of this batch targets the group: rank 0 skips it
                ranks[:, :n_a].zero_()
                continue
            off_a[:n_a].copy_(g.offsets_a[:n_a], non_blocking=True)
            off_b[:n_a].copy_(g.offsets_b[:n_a], non_blocking=True)
            # all of its rows, padded to a multiple of 4 adapters: a contiguous pinned source
            ranks[:, :g.ranks.shape[1]].copy_(g.ranks, non_blocking=True)

    def _static_batch(self, kind: str, t_bucket: int, s_bucket: int, rank_bucket: int,
                      dora: tuple[str, ...], groups: tuple[str, ...]) -> Batch:
        """The static buffers' batch of a graph: LoRA on `groups`, DoRA's rescale on `dora`
        (a subset of them); `kind` one of the keys' kinds (see the module docstring)."""
        mixed = kind.startswith("mixed")
        num_decode = 0 if mixed else t_bucket
        # Programs walking the work lists: enough for a bucket of long prompts at one tile
        # each; many short prompts' tiles take turns.
        programs = min(capacity(t_bucket, s_bucket, self.tile_rows),
                       cdiv(t_bucket, self.tile_rows) + 16)
        lora = None
        if rank_bucket:
            metas = {}
            for gname in groups:
                off_a, off_b, ranks, off_d = self.group_bufs[gname]
                metas[gname] = GroupMeta(
                    offsets_a=off_a[:s_bucket],
                    offsets_b=off_b[:s_bucket],
                    ranks=ranks[:, :s_bucket],
                    max_rank=self.model.max_added if gname == ADDED_GROUP else rank_bucket,
                    offsets_d=off_d[:s_bucket] if gname in dora else None,
                    **self.group_shapes[gname])
            lora = LoraMeta(pages=self.pages[:s_bucket], token_slot=self.token_slot[:t_bucket],
                            num_decode=num_decode, groups=metas)
            # the decode rows by adapter (a mixed step's decode rows are its sequences)
            if kind.endswith(("segments", "hybrid")):
                tile = self.decode_tile
                lora.dec_segments = DecodeSegments(
                    rows=self.dec_rows[:s_bucket], seg_start=self.dec_seg_start[:s_bucket + 1],
                    seg_slot=self.dec_seg_slot[:s_bucket], tiles=self.dec_tiles, tile=tile,
                    programs=min(capacity(s_bucket, s_bucket, tile), cdiv(s_bucket, tile) + 16),
                    rest=self.dec_rest[:s_bucket] if kind.endswith("hybrid") else None)
            if mixed:
                lora.seg_start, lora.seg_slot = self.q_start[:s_bucket + 1], self.seg_slot[:s_bucket]
                lora.tiles, lora.tile_programs = self.lora_tiles, programs
                lora.dec_slot = self.dec_slot[:s_bucket]  # (decode rows are sequences)
        common = dict(input_ids=self.ids[:t_bucket], positions=self.positions[:t_bucket],
                      slot_mapping=self.slots[:t_bucket], block_tables=self.tables[:s_bucket],
                      ctx_lens=self.ctx[:s_bucket], ctx_lens_list=[1] * s_bucket,
                      num_decode=num_decode, lora=lora)
        if not mixed:
            return Batch(**common, q_start_list=list(range(s_bucket + 1)),
                         q_start_tensor=self.q_start[:0], logits_index=self._arange[:s_bucket])
        # (A mixed batch's q_start_list is read by no kernel: its segments are in
        # q_start_tensor, its work in the tiles.)
        return Batch(**common, q_start_list=[0] + [t_bucket] * s_bucket,
                     q_start_tensor=self.q_start[:s_bucket + 1],
                     logits_index=self.logits_index[:s_bucket],
                     tiles=self.att_tiles, tile_programs=programs,
                     dec_ctx_lens=self.dec_ctx[:s_bucket])

    def _capture(self, kind: str, t_bucket: int, s_bucket: int, rank_bucket: int,
                 dora: tuple[str, ...], groups: tuple[str, ...]):
        batch = self._static_batch(kind, t_bucket, s_bucket, rank_bucket, dora, groups)
        model, pool = self.model, self.pool
        if not self.capture:
            return None, None, batch
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels for these shapes
            model.forward(batch, pool)
        torch.cuda.current_stream().wait_stream(stream)
        # as torch.cuda.graph does: give back the cached blocks of the warm-up forward (the
        # side stream's: nothing else can reuse them), or the captures can run out of memory
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        # One graph per piece of layers, sharing one memory pool: a piece's outputs are the
        # next one's inputs, so they must replay in capture order. The first piece holds the
        # embedding, the last the head.
        ends = self.piece_starts[1:] + [model.num_layers]
        pieces = []
        with torch.cuda.stream(stream):
            for start, end in zip(self.piece_starts, ends):
                pieces.append(torch.cuda.CUDAGraph())
                pieces[-1].capture_begin(pool=self.mempool)
                try:
                    if start == 0:
                        hidden = model.embed(batch, pool)
                    hidden = model.layers(batch, pool, hidden, start, end)
                    if end == model.num_layers:
                        logits = model.head(batch, hidden, pool,
                                            out=self.logits[:len(batch.logits_index)])
                finally:
                    pieces[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        # NOTE: the graphs read every tensor of `batch` by address: keep them all alive.
        return pieces, logits, batch


# -- the warm-up plan: the steps that compile every kernel variant and capture every graph

Prompts = list[list[int]]
WarmupStep = tuple[Prompts, Prompts]  # (prompts, prompts that join one step later)


def warmup_adapters(layouts, ranks=(), modules=()) -> list[tuple[int, tuple[str, ...], bool]]:
    """(rank, module groups, DoRA) of the temporary adapters a warm-up runs its steps with:
    one per rank bucket of the registered adapters' `layouts` and of `ranks` (adapters to come)
    and per set of module groups they target, with DoRA on every targeted module or none,
    since graphs are keyed by all three. The sets: the registered adapters', those of
    `modules` (one list of target modules per kind of adapter to come; every module when
    `ranks` come without them), and their union, which the batches that mix them replay
    (`StepGraphs._superset`): with DoRA too where a registered adapter has DoRA, which the
    batches mixing DoRA and plain adapters replay. Largest rank first; within a rank, plain
    before DoRA, fewest groups first, so a set captures its own graphs before a superset's
    exist."""
    sets = {(groups_of(lo.modules), bool(lo.dora)) for lo in layouts}
    sets |= {(groups_of(m), False) for m in modules}
    if ranks and not modules:  # adapters to come, of any modules
        sets.add((groups_of(LORA_MODULES), False))
    union = tuple(g for g in (*GROUPS, *VOCAB_GROUPS) if any(g in s for s, _ in sets))
    if sets:
        sets.add((union, False))
    if any(d for _, d in sets):
        sets.add((union, True))
    rank_buckets = sorted({round_rank(r) for r in [lo.max_rank for lo in layouts] + list(ranks)},
                          reverse=True)
    return [(r, groups, dora) for r in rank_buckets
            for groups, dora in sorted(sets, key=lambda s: (s[1], len(s[0]), s[0]))]


def warmup_steps(graphs: StepGraphs | None,
                 max_tokens: int) -> tuple[list[WarmupStep], list[WarmupStep]]:
    """The steps a warm-up runs with each of its adapters and the base model, as
    (graphed, eager) lists of at most `max_tokens` tokens a step.

    graphed: a decode batch at every batch bucket, then one prefill step per mixed-step graph
    bucket (`mixed_buckets`); without graphs, one decode batch. eager: the steps past the
    mixed graphs, which run eagerly; Triton compiles a kernel again for each new class of its
    integer arguments (1, a multiple of 16, other), so one sequence of t tokens (odd), two of
    a multiple of 16, and a mixed step (a decode row, then a prompt joins)."""
    if graphs is None:
        return [([[1] * 8], [])], []
    graphed = [([[1] * 8] * b, []) for b in graphs.buckets]
    graphed += [([[1] * (t - n + 1)] + [[1]] * (n - 1), [])
                for t, n in graphs.mixed_buckets(max_tokens)]
    t = graphs.mixed_tokens + 1
    if t + 16 > max_tokens:
        return graphed, []
    return graphed, [([[1] * t], []), ([[1] * (t // 2 + 8)] * 2, []), ([[1] * 8], [[1] * t])]
