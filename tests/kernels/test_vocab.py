"""The vocabulary modules' LoRA kernels against their twins: the embedding shrink (a gather of
A's columns by token id, `vocab.embedding_shrink` / `reference.embedding_shrink`), and the
MBGMV shrink and expand over vocab-wide rows as lm_head runs them. Adapters lie in scattered,
shuffled pages with NaN in every element no adapter row owns (test_lora's `Group`)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from slora.kernels import reference as ref  # noqa: E402
from slora.kernels.mbgmv import mbgmv_expand, mbgmv_shrink  # noqa: E402
from slora.kernels.vocab import embedding_shrink  # noqa: E402
from tests.kernels.test_lora import (DEVICE, DTYPES, Group, check_expand, check_shrink,  # noqa: E402
                                     random_slots)

VOCAB, HIDDEN = 200, 96  # a vocabulary that is not a multiple of the 64-element alignment


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 5])
def test_embedding_shrink_matches_twin(T, dtype):
    gen = torch.Generator().manual_seed(10 * T + DTYPES.index(dtype))
    n_a = min(T, 3)
    grp = Group(n_a, VOCAB, (HIDDEN,), dtype, gen)  # A [r, vocab], B^T [r, hidden]
    slots = random_slots(T, n_a, gen).to(DEVICE)
    ids = torch.randint(VOCAB, (T,), generator=gen).to(DEVICE)
    ids[-1] = VOCAB - 1  # the last column: inside the row, before its padding
    args = (ids, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride, grp.max_rank)
    xa, xa_ref = embedding_shrink(*args), ref.embedding_shrink(*args)
    check_shrink(xa, xa_ref, slots.cpu(), grp, dtype)
    assert torch.equal(xa, xa_ref)  # a gather: the same values, exactly
    check_mbgmv_expand(xa_ref, grp, slots, HIDDEN, dtype, gen)


def check_mbgmv_expand(xa, grp, slots, d_out, dtype, gen):
    """MBGMV's expand of `xa` over the group's B^T rows equals the twin's."""
    out0 = torch.randn(xa.shape[0], d_out, generator=gen).to(dtype).to(DEVICE)
    out, out_ref = out0.clone(), out0.clone()
    mbgmv_expand(xa, out, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots, (d_out,),
                 grp.strides)
    ref.lora_expand(xa, out_ref, grp.pool, grp.pages, grp.offsets_b, grp.ranks, slots,
                    (d_out,), grp.strides)
    check_expand(out, out_ref, out0, slots, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lm_head_rows_match_twin(dtype):
    """lm_head: hidden -> r -> vocab on the logits rows, each its sequence's adapter row."""
    gen = torch.Generator().manual_seed(7 + DTYPES.index(dtype))
    T, n_a = 4, 3
    grp = Group(n_a, HIDDEN, (VOCAB,), dtype, gen)
    slots = random_slots(T, n_a, gen).to(DEVICE)
    x = torch.randn(T, HIDDEN, generator=gen).to(dtype).to(DEVICE)
    args = (x, grp.pool, grp.pages, grp.offsets_a, grp.ranks, slots, grp.stride, grp.max_rank)
    xa, xa_ref = mbgmv_shrink(*args), ref.lora_shrink(*args)
    check_shrink(xa, xa_ref, slots.cpu(), grp, dtype)
    check_mbgmv_expand(xa_ref, grp, slots, VOCAB, dtype, gen)
