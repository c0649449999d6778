"""The page allocator: one pool of page ids shared by KV blocks and adapter weights.

Every page id addresses the same slot in every layer of the runner's pool tensor, so one
allocator serves both kinds. A page is free, or held as KV (by one or more running requests),
as ADAPTER (by a resident adapter) or as CACHED (a full KV page of the prefix cache that no
request holds, `slora.core.prefix`). Invariant, checked by `check()` and kept by every method:

    free + kv + adapter + cached == total

Allocation returns None when the pool cannot satisfy it; the caller (the scheduler)
decides what to evict or preempt. Nothing here raises on an ordinary shortage.

Reclaimable space, in one segmented least-recently-used order (`evict_for`): idle resident
adapters (keyed by name, a str) and cached KV pages (keyed by page id, an int). Holders that were
never reused (a cached page no second request found) are on probation and are reclaimed first,
least recently used first; then the protected holders (idle adapters, cached pages that were
found again), least recently used first. So a pool full of prompt pages nobody shares gives them
up before any idle adapter, as if caching were off, while a shared prefix, once found, competes
with adapters by recency alone. Owners put holders in the order when they become idle (`idle`),
take them out when used again (`busy`), and register how victims of their key type are given
back (`reclaimers`: called with each run of consecutive victims of that type, in order).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Collection, Hashable, Iterator

KV = "kv"
ADAPTER = "adapter"
CACHED = "cached"


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages={num_pages} must be at least 1")
        self.total = num_pages
        # A stack: freed pages are reused first (warm in caches), the order is deterministic.
        self._free = list(range(num_pages - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_pages  # page id -> its kind; None: free
        self.used = {KV: 0, ADAPTER: 0, CACHED: 0}
        # Reclaimable holders, least recently used first: key -> the pages it would free;
        # on probation (never reused), then protected. A key is in at most one of them.
        self.probation: OrderedDict[Hashable, int] = OrderedDict()
        self.lru: OrderedDict[Hashable, int] = OrderedDict()
        self.lru_pages = 0  # pages both would free
        # key type -> the function that evicts holders of that type (a list of keys, in reclaim
        # order) and frees their pages
        self.reclaimers: dict[type, Callable[[list], None]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, kind: str) -> list[int] | None:
        """n pages for `kind` (KV or ADAPTER), or None (and nothing taken) if fewer are free."""
        free = self._free
        if n > len(free):
            return None
        cut = len(free) - n
        pages = free[cut:][::-1]  # popped from the end, one at a time
        del free[cut:]
        owner = self._owner
        for p in pages:
            owner[p] = kind
        self.used[kind] += n
        return pages

    def free(self, pages: list[int]) -> None:
        owner, used, free = self._owner, self.used, self._free  # (once a finish, per page)
        for p in pages:
            kind = owner[p]
            if kind is None:
                raise ValueError(f"PageAllocator.free: page {p} is not allocated (double free?)")
            owner[p] = None
            used[kind] -= 1
            free.append(p)

    def retag(self, pages: list[int], kind: str) -> None:
        """Move allocated pages to `kind` (KV <-> CACHED as requests take or leave them)."""
        owner, used = self._owner, self.used
        for p in pages:
            used[owner[p]] -= 1
            owner[p] = kind
        used[kind] += len(pages)

    # -- the one eviction order
    def idle(self, key: Hashable, pages: int) -> None:
        """`key` (holding `pages` pages) is reclaimable, protected, most recently used: evicted
        last. (Pages on probation come in through `idle_pages`.)"""
        self.busy(key)
        self.lru[key] = pages
        self.lru_pages += pages

    def busy(self, key: Hashable) -> None:
        """`key` is in use again: not reclaimable (nothing if it was not)."""
        self.lru_pages -= self.lru.pop(key, 0) + self.probation.pop(key, 0)

    def idle_pages(self, pages: list[int], protected: Collection[int]) -> None:
        """`idle` for each of `pages` in turn, holders of one page each that were not
        reclaimable (cached KV pages no request holds now): protected if in `protected`,
        else on probation."""
        probation, lru = self.probation, self.lru
        for p in pages:
            (lru if p in protected else probation)[p] = 1
        self.lru_pages += len(pages)

    def busy_pages(self, pages: list[int]) -> None:
        """`busy` for each of `pages`, holders of one page each (cached KV pages)."""
        probation, lru, n = self.probation, self.lru, 0
        for p in pages:
            n += probation.pop(p, 0) or lru.pop(p, 0)
        self.lru_pages -= n

    def touch(self, key: Hashable) -> None:
        """Mark a reclaimable `key` as recently used, in its segment."""
        for segment in (self.probation, self.lru):
            if key in segment:
                segment.move_to_end(key)

    def order(self) -> Iterator[tuple[Hashable, int]]:
        """Every reclaimable holder and its pages, in reclaim order."""
        return itertools.chain(self.probation.items(), self.lru.items())

    def evict_for(self, n: int, keep: Collection[Hashable] = ()) -> list[Hashable] | None:
        """Reclaim holders (least recently used first, never those in `keep`) until n pages
        are free. Returns the reclaimed keys, or None (reclaiming nothing) if even all of them
        would not free enough."""
        free = len(self._free)
        if free >= n:
            return []
        if free + self.lru_pages < n:
            return None
        victims = []
        for key, pages in self.order():
            if key in keep:
                continue
            victims.append(key)
            free += pages
            if free >= n:
                break
        if free < n:
            return None
        reclaimers, run = self.reclaimers, []
        for key in victims:  # each run of one type at once; each takes its keys out (busy)
            if run and type(key) is not type(run[0]):
                reclaimers[type(run[0])](run)
                run = []
            run.append(key)
        reclaimers[type(run[0])](run)
        return victims

    def check(self) -> None:
        used = self.used
        assert len(self._free) + used[KV] + used[ADAPTER] + used[CACHED] == self.total, (
            f"page accounting broken: free {len(self._free)} + kv {used[KV]} + adapter "
            f"{used[ADAPTER]} + cached {used[CACHED]} != total {self.total}")
        assert self.total - self._owner.count(None) == used[KV] + used[ADAPTER] + used[CACHED]
        assert self.lru_pages == sum(n for _, n in self.order())
        assert not self.lru.keys() & self.probation.keys()
