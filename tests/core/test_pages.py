"""PageAllocator: exact accounting under any sequence of allocations and frees."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slora.core.pages import ADAPTER, CACHED, KV, PageAllocator


def test_alloc_free_roundtrip():
    a = PageAllocator(10)
    kv = a.alloc(4, KV)
    ad = a.alloc(3, ADAPTER)
    assert len(set(kv) | set(ad)) == 7
    assert (a.num_free, a.used[KV], a.used[ADAPTER]) == (3, 4, 3)
    assert a.alloc(4, KV) is None and a.num_free == 3  # all or nothing
    a.free(ad)
    assert a.alloc(6, KV) is not None and a.num_free == 0
    a.check()


def test_double_free_is_an_error():
    a = PageAllocator(4)
    p = a.alloc(2, KV)
    a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p[:1])


def test_page_freed_by_adapter_holds_kv_next():
    a = PageAllocator(3)
    ad = a.alloc(3, ADAPTER)
    a.free(ad)
    kv = a.alloc(3, KV)
    assert sorted(kv) == sorted(ad) and a.used == {KV: 3, ADAPTER: 0, CACHED: 0}


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 64),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.sampled_from([KV, ADAPTER])),
                    max_size=60))
def test_accounting_is_exact(total, ops):
    a = PageAllocator(total)
    held: list[tuple[list[int], str]] = []
    for is_alloc, n, kind in ops:
        if is_alloc or not held:
            pages = a.alloc(n, kind)
            free_before = a.num_free + (len(pages) if pages else 0)
            assert (pages is None) == (n > free_before)
            if pages:
                held.append((pages, kind))
        else:
            pages, _ = held.pop(n % len(held))
            a.free(pages)
        a.check()
        owned = [p for ps, _ in held for p in ps]
        assert len(owned) == len(set(owned))  # no page handed out twice
        assert a.used[KV] == sum(len(ps) for ps, k in held if k == KV)
        assert a.used[ADAPTER] == sum(len(ps) for ps, k in held if k == ADAPTER)
