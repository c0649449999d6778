"""MBGMV / MBGMM Triton kernels against their torch twins (reference.lora_shrink / lora_expand).

Without CUDA the kernels run under the Triton interpreter on small shapes; with CUDA the same
tests run on the GPU (bf16 included). Adapters are laid out in scattered, shuffled pool pages
exactly as reference.py's docstring says, with NaN in every element no adapter row owns (row
padding, unused pages, page-table slack), so a kernel that reads outside a row's rank or
width fails loudly.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from slora.kernels import reference as ref  # noqa: E402
from slora.kernels import segments, tuning  # noqa: E402
from slora.kernels.tiles import tile_rows, token_tiles  # noqa: E402
from slora.kernels.mbgmm import mbgmm_expand, mbgmm_shrink  # noqa: E402
from slora.kernels.mbgmv import mbgmv_expand, mbgmv_shrink  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALIGN = ref.LORA_ALIGN
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (d_in, out_dims): one module, a pair like gate/up, a q/k/v-like triple with GQA-sized k/v;
# widths that are not multiples of 64 exercise the padded row tails.
GROUPS = {
    "one": (64, (96,)),
    "pair": (96, (128, 64)),
    "qkv": (128, (128, 32, 32)),
}
RANKS = (1, 12, 20, 80)  # 1, non-powers of two, one above 64


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Group:
    """A random pool with n_a adapters for one module group, laid out per reference.py (ranks
    drawn from RANKS, or all `rank`; the second adapter lacks the group's last module)."""

    def __init__(self, n_a, d_in, out_dims, dtype, gen, page_size=256, extra_pages=7,
                 rank=None):
        G = len(out_dims)
        self.d_in, self.out_dims = d_in, tuple(out_dims)
        self.stride, self.strides = pad(d_in), tuple(pad(d) for d in out_dims)
        pick = torch.randint(len(RANKS), (n_a, G), generator=gen)
        ranks = torch.tensor([[rank or RANKS[int(i)] for i in row] for row in pick],
                             dtype=torch.int32)
        if n_a > 1 and G > 1:
            ranks[1, G - 1] = 0  # an adapter without the group's last module
        self.max_rank = int(ranks.max())
        offsets = torch.zeros(n_a, G, 2, dtype=torch.int64)
        buffers = []
        for a in range(n_a):
            # A gap of a few aligned chunks before the group: other modules in the real layout.
            off = ALIGN * int(torch.randint(0, 3, (1,), generator=gen))
            for g in range(G):
                r = int(ranks[a, g])
                offsets[a, g, 0] = off
                off += r * self.stride
                offsets[a, g, 1] = off
                off += r * self.strides[g]
            buffers.append(off)
        need = [-(-n // page_size) for n in buffers]
        num_pages = sum(need) + extra_pages
        self.pool = torch.full((num_pages, page_size), float("nan"), dtype=dtype)
        perm = torch.randperm(num_pages, generator=gen)
        max_pages = max(need) + 2
        # Slack entries point at real (NaN-filled or foreign) pages: reading them is an error
        # the results show, not a crash.
        self.pages = perm[torch.randint(num_pages, (n_a, max_pages), generator=gen)].to(torch.int32)
        used = 0
        for a in range(n_a):
            self.pages[a, :need[a]] = perm[used:used + need[a]].to(torch.int32)
            used += need[a]
            virt = torch.full((need[a] * page_size,), float("nan"), dtype=dtype)
            for g in range(G):
                r = int(ranks[a, g])
                for start, width, stride in ((offsets[a, g, 0], d_in, self.stride),
                                             (offsets[a, g, 1], out_dims[g], self.strides[g])):
                    w = torch.randn(r, width, generator=gen) * 0.3
                    for i in range(r):
                        s = int(start) + i * stride
                        virt[s:s + width] = w[i].to(dtype)
            self.pool[self.pages[a, :need[a]].long()] = virt.view(need[a], page_size)
        self.ranks, self.offsets = ranks, offsets
        self.to(DEVICE)

    def to(self, device):
        for k in ("pool", "pages", "ranks", "offsets"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    @property
    def offsets_a(self):
        return self.offsets[:, :, 0]  # a strided view, as the runner's [n_a, 7, 2] slices are

    @property
    def offsets_b(self):
        return self.offsets[:, :, 1]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def random_slots(T, n_a, gen):
    slots = torch.randint(-1, n_a, (T,), generator=gen, dtype=torch.int32)
    if T >= 3:
        slots[0] = -1  # at least one base-only row
        slots[1] = 0
    return slots


def check_shrink(xa, xa_ref, slots, grp, dtype):
    assert xa.shape == xa_ref.shape and xa.dtype == torch.float32
    assert not torch.isnan(xa).any()
    assert rel_err(xa, xa_ref) < tol(dtype)
    # Exact zeros past each row's rank and on base-only rows (the twin's contract).
    for t, s in enumerate(slots.tolist()):
        for g in range(xa.shape[1]):
            r = 0 if s < 0 else int(grp.ranks[s, g])
            assert (xa[t, g, r:] == 0).all()


def check_expand(out, out_ref, out0, slots, dtype):
    assert not torch.isnan(out).any()
    assert rel_err(out - out0.to(out.dtype), out_ref - out0.to(out.dtype)) < tol(dtype) * 2
    base = slots < 0
    assert torch.equal(out[base], out0[base])  # base-only rows untouched


@pytest.mark.parametrize("start,rows,stride,width", [
    (64, 3, 64, 48),  # inside one page
    (128, 3, 128, 64),  # the last row ends at the page's end: still one page
    (192, 5, 128, 96),  # across three pages
    (0, 1, 64, 64), (448, 2, 192, 130),  # one row; a row across a page boundary
])
def test_gather_rows_reads_the_virtual_buffer(start, rows, stride, width):
    """The twin's row gather equals the layout's definition: virtual element v of an adapter
    is pool_l[pages[v // P], v % P], i.e. its pages concatenated in the adapter's order."""
    gen = torch.Generator().manual_seed(0)
    P = 256
    pool_l = torch.randn(12, P, generator=gen)
    pages = torch.randperm(12, generator=gen)[:5].to(torch.int32)
    virtual = pool_l[pages.long()].reshape(-1)
    want = torch.stack([virtual[start + i * stride:start + i * stride + width]
                        for i in range(rows)])
    assert torch.equal(ref.gather_rows(pool_l, pages, start, rows, stride, width), want)


def _mbgmv_impls():
    """The Triton MBGMV, and the csrc CUDA one where a GPU and cupy are present."""
    impls = {"triton": (mbgmv_shrink, mbgmv_expand)}
    if DEVICE == "cuda":
        try:
            import cupy  # noqa: F401

            from slora.kernels import cuda as cuda_kernels
            impls["cuda"] = (cuda_kernels.mbgmv_shrink, cuda_kernels.mbgmv_expand)
        except ImportError:
            pass
    return impls


MBGMV_IMPLS = _mbgmv_impls()


@pytest.mark.parametrize("impl", list(MBGMV_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_mbgmv_matches_twin(T, group, dtype, impl):
    mbgmv_shrink, mbgmv_expand = MBGMV_IMPLS[impl]
    gen = torch.Generator().manual_seed(1000 * T + len(group) + DTYPES.index(dtype))
    d_in, out_dims = GROUPS[group]
    n_a = min(T, 3)
    grp = Group(n_a, d_in, out_dims, dtype, gen)
    slots = random_slots(T, n_a, gen).to(DEVICE)
    x = (torch.randn(T, d_in, generator=gen)).to(dtype).to(DEVICE)

    xa = mbgmv_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride,
                      grp.max_rank)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots,
                             grp.stride, grp.max_rank)
    check_shrink(xa, xa_ref, slots.cpu(), grp, dtype)

    out0 = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmv_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                 out_dims, grp.strides)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, slots, dtype)


def random_segments(n_a, gen, n_seg=4, max_len=11, long=0):
    """Segments of 1..max_len tokens (the first `long` when given), the second base-only."""
    lens = torch.randint(1, max_len + 1, (n_seg,), generator=gen)
    if long:
        lens[0] = long
    seg_slot = torch.randint(0, n_a, (n_seg,), generator=gen, dtype=torch.int32)
    seg_slot[1] = -1  # a base-only segment
    seg_start = torch.zeros(n_seg + 1, dtype=torch.int32)
    seg_start[1:] = lens.cumsum(0)
    token_slot = torch.repeat_interleave(seg_slot, lens)
    return seg_start, seg_slot, token_slot, int(lens.max())


# every dtype with rows inside two pages; one with pages of 64 elements, which rows cross
@pytest.mark.parametrize("dtype,page_size", [(d, 256) for d in DTYPES] + [(torch.float32, 64)],
                         ids=str)
@pytest.mark.parametrize("group", list(GROUPS))
def test_mbgmm_matches_twin(group, dtype, page_size):
    gen = torch.Generator().manual_seed(7 + len(group) + DTYPES.index(dtype))
    d_in, out_dims = GROUPS[group]
    n_a = 3
    grp = Group(n_a, d_in, out_dims, dtype, gen, page_size=page_size)
    tile = tile_rows(torch.device(DEVICE), dtype)
    seg_start, seg_slot, token_slot, max_len = random_segments(n_a, gen, long=tile + 3)
    T = int(seg_start[-1])
    seg_start, seg_slot, token_slot = (t.to(DEVICE) for t in (seg_start, seg_slot, token_slot))
    x = torch.randn(T, d_in, generator=gen).to(dtype).to(DEVICE)

    xa = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                      grp.stride, grp.max_rank)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, token_slot,
                             grp.stride, grp.max_rank)
    check_shrink(xa, xa_ref, token_slot.cpu(), grp, dtype)
    # Two programs taking the work tiles in turn (as a graph's bounded grid does): the same.
    tiles = torch.tensor(token_tiles(seg_start.tolist(), tile, (seg_slot >= 0).tolist()),
                         dtype=torch.int32, device=DEVICE)
    assert int(tiles[0]) > 2 and tile < max_len  # a segment of several tiles
    xa2 = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                       grp.stride, grp.max_rank, tiles, programs=2)
    assert torch.equal(xa, xa2)
    # d_in split across programs (as on the GPU for small batches): partial sums added atomically
    xa3 = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                       grp.stride, grp.max_rank, tiles, split_k=2)
    torch.testing.assert_close(xa3, xa, rtol=1e-5, atol=1e-5)

    out0 = torch.randn(T, sum(out_dims), generator=gen).to(dtype).to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmm_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, seg_start, seg_slot,
                 out_dims, grp.strides, tiles, programs=2)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, token_slot,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, token_slot, dtype)
    # programs covering 128 columns each, 64 at a time: the same
    out2 = out0.clone()
    mbgmm_expand(xa_ref, out2, grp.pool, grp.pages, grp.offsets_b, grp.ranks, seg_start,
                 seg_slot, out_dims, grp.strides, tiles, n_span=128)
    assert torch.equal(out2, out)
    # the work sized on the device from the list's length (as in a graph, whose grid covers
    # its bucket): the same
    xa4 = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                       grp.stride, grp.max_rank, tiles, programs=2, split_k=0)
    assert torch.equal(xa4, xa)
    out4 = out0.clone()
    mbgmm_expand(xa_ref, out4, grp.pool, grp.pages, grp.offsets_b, grp.ranks, seg_start,
                 seg_slot, out_dims, grp.strides, tiles, programs=2, n_span=0)
    assert torch.equal(out4, out)


def test_mbgmm_shrink_slices_d_in_as_the_device_counts_them():
    """The GPU's default: the slices of d_in counted in the kernel from the step's tiles (up
    to 16, at least 4 chunks each). One 5-token segment, d_in 1,024: 4 slices, their partial
    sums meeting in xa by atomic adds; the same xa as one slice."""
    gen = torch.Generator().manual_seed(11)
    grp = Group(2, 1024, (64,), torch.float32, gen, page_size=512)
    seg_start = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    seg_slot = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    x = torch.randn(5, 1024, generator=gen).to(DEVICE)
    args = (x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot, grp.stride,
            grp.max_rank)
    one = mbgmm_shrink(*args, split_k=1)
    counted = mbgmm_shrink(*args, split_k=0)
    torch.testing.assert_close(counted, one, rtol=1e-5, atol=1e-5)
    assert not torch.equal(counted, one)  # (summed in another order: it did split)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks,
                             torch.zeros(5, dtype=torch.int32, device=DEVICE), grp.stride,
                             grp.max_rank)
    check_shrink(counted, xa_ref, torch.zeros(5, dtype=torch.int32), grp, torch.float32)


def sharing_slots(T, pattern, gen):
    """Adapter rows of T decode rows: every row its own adapter, all on one, two adapters
    interleaved, or a mix with base-only rows (one adapter taking most rows)."""
    if pattern == "distinct":
        slots = torch.randperm(T, generator=gen)
    elif pattern == "one":
        slots = torch.zeros(T, dtype=torch.long)
    elif pattern == "two":
        slots = torch.arange(T) % 2
    else:
        slots = torch.randint(-1, 3, (T,), generator=gen)
        slots[: (T + 1) // 2] = 1
        slots = slots[torch.randperm(T, generator=gen)]
    return slots.to(torch.int32)


@pytest.mark.parametrize("rank", [1, 16, 80])
@pytest.mark.parametrize("pattern", ["distinct", "one", "two", "mixed"])
@pytest.mark.parametrize("T", [1, 9])
def test_segmented_decode_matches_twin(T, pattern, rank):
    """MBGMM over the decode rows grouped by adapter (`rows`: segment positions are token
    rows; slora.kernels.segments) computes the twins with the step's own token_slot, for one
    row or many on an adapter, in tiles of the decode tile, fp32."""
    gen = torch.Generator().manual_seed(100 * T + rank + len(pattern))
    d_in, out_dims = GROUPS["qkv"]
    slots = sharing_slots(T, pattern, gen)
    n_a = max(3, int(slots.max()) + 1)
    grp = Group(n_a, d_in, out_dims, torch.float32, gen, rank=rank)
    tile = segments.decode_tile_rows(torch.device(DEVICE))
    rows, seg_start, seg_slot, tiles = (torch.tensor(v, dtype=torch.int32, device=DEVICE)
                                        for v in segments.group_rows(slots.tolist(), tile))
    slots = slots.to(DEVICE)
    # the grouping stands for the step's token_slot (the twins' input)
    assert torch.equal(ref.segments_token_slot(rows, seg_start, seg_slot, T), slots)
    x = torch.randn(T, d_in, generator=gen).to(DEVICE)
    seg = dict(rows=rows, block_m=tile)

    xa = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                      grp.stride, grp.max_rank, tiles, **seg)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots,
                             grp.stride, grp.max_rank)
    check_shrink(xa, xa_ref, slots.cpu(), grp, torch.float32)
    # two programs taking the tiles in turn, as a graph's fixed grid does: the same
    xa2 = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                       grp.stride, grp.max_rank, tiles, programs=2, **seg)
    assert torch.equal(xa2, xa)

    out0 = torch.randn(T, sum(out_dims), generator=gen).to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmm_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, seg_start,
                 seg_slot, out_dims, grp.strides, tiles, programs=2, **seg)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, slots, torch.float32)


@pytest.mark.parametrize("pattern", ["distinct", "one", "mixed"])
def test_hybrid_decode_matches_twin(pattern):
    """A step's decode rows split between the paths (`segments.split_rows`, "hybrid"): MBGMV
    over the rest (the grouped rows at -1), then MBGMM over the groups into the same xa and
    out, compute the twins with the step's own token_slot, fp32."""
    gen = torch.Generator().manual_seed(7 + len(pattern))
    d_in, out_dims = GROUPS["qkv"]
    T = 9
    slots = sharing_slots(T, pattern, gen)
    n_a = max(3, int(slots.max()) + 1)
    grp = Group(n_a, d_in, out_dims, torch.float32, gen, rank=20)
    table = tuning.kind(torch.device(DEVICE))
    by, rest = segments.split_rows(table, "hybrid", slots.tolist(), [1 << 40] * n_a)
    assert rest is not None and by is not None
    assert (pattern == "distinct") == all(s < 0 for s in by)
    tile = segments.decode_tile_rows(torch.device(DEVICE))
    rows, seg_start, seg_slot, tiles = (torch.tensor(v, dtype=torch.int32, device=DEVICE)
                                        for v in segments.group_rows(by, tile))
    rest = torch.tensor(rest, dtype=torch.int32, device=DEVICE)
    slots = slots.to(DEVICE)
    x = torch.randn(T, d_in, generator=gen).to(DEVICE)
    seg = dict(rows=rows, block_m=tile)

    xa = mbgmv_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, rest, grp.stride,
                      grp.max_rank)
    xa = mbgmm_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, seg_start, seg_slot,
                      grp.stride, grp.max_rank, tiles, xa=xa, **seg)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots,
                             grp.stride, grp.max_rank)
    check_shrink(xa, xa_ref, slots.cpu(), grp, torch.float32)

    out0 = torch.randn(T, sum(out_dims), generator=gen).to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmv_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, rest, out_dims,
                 grp.strides)
    mbgmm_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, seg_start,
                 seg_slot, out_dims, grp.strides, tiles, **seg)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, slots, torch.float32)


def test_all_base_rows_cost_nothing_and_change_nothing():
    gen = torch.Generator().manual_seed(3)
    d_in, out_dims = GROUPS["qkv"]
    grp = Group(2, d_in, out_dims, torch.float32, gen)
    T = 4
    slots = torch.full((T,), -1, dtype=torch.int32, device=DEVICE)
    x = torch.randn(T, d_in, generator=gen).to(DEVICE)
    xa = mbgmv_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride,
                      grp.max_rank)
    assert (xa == 0).all()
    out0 = torch.randn(T, sum(out_dims), generator=gen).to(DEVICE)
    out = out0.clone()
    mbgmv_expand(torch.randn_like(xa), out, grp.pool, grp.pages, grp.offsets_b, grp.ranks,
                 slots, out_dims, grp.strides)
    assert torch.equal(out, out0)


def test_runner_style_strided_metadata():
    """The runner passes slices of its [n_a, 7, 2] offsets and [L, n_a, 7] ranks: no copies."""
    gen = torch.Generator().manual_seed(11)
    d_in, out_dims = GROUPS["pair"]
    grp = Group(3, d_in, out_dims, torch.float16, gen)
    G = len(out_dims)
    offsets7 = torch.zeros(3, 7, 2, dtype=torch.int64, device=DEVICE)
    offsets7[:, 4:4 + G] = grp.offsets  # gate/up sit at module slots 4, 5
    ranks7 = torch.zeros(2, 3, 7, dtype=torch.int32, device=DEVICE)
    ranks7[1, :, 4:4 + G] = grp.ranks
    offs_a, offs_b, ranks = offsets7[:, 4:4 + G, 0], offsets7[:, 4:4 + G, 1], ranks7[1, :, 4:4 + G]
    assert not offs_a.is_contiguous() and not ranks.is_contiguous()
    T = 5
    slots = random_slots(T, 3, gen).to(DEVICE)
    x = torch.randn(T, d_in, generator=gen).half().to(DEVICE)
    xa = mbgmv_shrink(x, grp.pool, grp.pages, offs_a, ranks, slots, grp.stride, grp.max_rank)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride,
                             grp.max_rank)
    check_shrink(xa, xa_ref, slots.cpu(), grp, torch.float16)
    out0 = torch.randn(T, sum(out_dims), generator=gen).half().to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmv_expand(xa_ref, out, grp.pool, grp.pages, offs_b, ranks, slots, out_dims, grp.strides)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, slots, torch.float16)


@pytest.mark.parametrize("tiles", [(1, 1, 2, 1), (2, 2, 2, 8), (4, 4, 1, 2), (2, 1, 64, 1)],
                         ids=lambda t: "shrink%dx%d-expand%dx%d" % t)
@pytest.mark.parametrize("pre_wait", [0, 1 << 30], ids=["after-wait", "before-wait"])
def test_mbgmv_other_tilings(monkeypatch, tiles, pre_wait):
    """The GPU's tile choices (1-64 rank rows per program, those past the rank masked) on the
    interpreter too, whose own default tiles are larger to keep it fast: every tiling must
    compute the same function, with each program's first adapter tile loaded before or after
    the PDL wait."""
    from slora.kernels import mbgmv

    monkeypatch.setattr(mbgmv, "PRE_WAIT_ROWS", pre_wait)
    br_s, ch, br_e, chn = tiles
    monkeypatch.setattr(mbgmv, "_mbgmv_shrink_cfg", lambda *a: dict(BLOCK_R=br_s, CH=ch))
    monkeypatch.setattr(mbgmv, "_mbgmv_expand_cfg", lambda *a: dict(BLOCK_R=br_e, CHN=chn))
    gen = torch.Generator().manual_seed(sum(tiles))
    d_in, out_dims = GROUPS["qkv"]
    grp = Group(3, d_in, out_dims, torch.float16, gen)
    T = 4
    slots = random_slots(T, 3, gen).to(DEVICE)
    x = torch.randn(T, d_in, generator=gen).half().to(DEVICE)
    xa = mbgmv_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride,
                      grp.max_rank)
    xa_ref = ref.lora_shrink(x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots,
                             grp.stride, grp.max_rank)
    check_shrink(xa, xa_ref, slots.cpu(), grp, torch.float16)
    out0 = torch.randn(T, sum(out_dims), generator=gen).half().to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmv_expand(xa_ref, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                 out_dims, grp.strides)
    ref.lora_expand(xa_ref, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    out_dims, grp.strides)
    check_expand(out, out_ref, out0, slots, torch.float16)
