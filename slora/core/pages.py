"""The page allocator: one pool of page ids shared by KV blocks and adapter weights.

Every page id addresses the same slot in every layer of the runner's pool tensor, so one
allocator serves both kinds. Invariant, checked by `check()` and kept by every method:

    free + kv + adapter == total

Allocation returns None when the pool cannot satisfy it; the caller (the scheduler)
decides what to evict or preempt. Nothing here raises on an ordinary shortage.
"""

from __future__ import annotations

KV = "kv"
ADAPTER = "adapter"


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages={num_pages} must be at least 1")
        self.total = num_pages
        # A stack: freed pages are reused first (warm in caches), the order is deterministic.
        self._free = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, str] = {}
        self.used = {KV: 0, ADAPTER: 0}

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
        self._owner.update(dict.fromkeys(pages, kind))
        self.used[kind] += n
        return pages

    def free(self, pages: list[int]) -> None:
        owner, used, free = self._owner, self.used, self._free  # (once a finish, per page)
        for p in pages:
            kind = owner.pop(p, None)
            if kind is None:
                raise ValueError(f"PageAllocator.free: page {p} is not allocated (double free?)")
            used[kind] -= 1
            free.append(p)

    def check(self) -> None:
        assert len(self._free) + self.used[KV] + self.used[ADAPTER] == self.total, (
            f"page accounting broken: free {len(self._free)} + kv {self.used[KV]} + "
            f"adapter {self.used[ADAPTER]} != total {self.total}")
        assert len(self._owner) == self.used[KV] + self.used[ADAPTER]
