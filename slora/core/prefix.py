"""Prefix caching: full KV pages found again by the content of everything before them.

A full page (`block_size` tokens) of a sequence is keyed by a digest chain:

    root      = sha256(repr((adapter identity, cache_salt)))
    digest[i] = sha256(digest[i - 1] (root for i = 0) ++ the page's token ids as int64)

so a page is found only by a request with the same adapter content
(`AdapterInfo.identity`, not its name), the same `cache_salt` (tenants that pass different
salts never share a page, so no timing side channel runs through the cache) and the same
tokens in every position before and in the page. SHA-256 makes a false match as unlikely as a
collision of it; a page found holds exactly the KV its request would compute.

Page states (`slora.core.pages`): a page a running request holds is KV, shared by every
request whose block table lists it (`_refs` counts them for pages that were ever cached); a
cached page no request holds is CACHED and reclaimable, in the allocator's one eviction order
beside idle adapters: on probation until a request other than the one that computed it takes it
(`take`), protected from then on, so prompt pages nobody shares are reclaimed before idle
adapters; a cached page is evicted (its digest forgotten, the page freed) when that order
reaches it. Invariants:
- `_page_of` and `_digest_of` are inverse maps over the cached pages (held or not);
- a page in `_refs` with count 0 is CACHED and in the allocator's LRU; any other page in
  `_refs` is KV; a held page that leaves the cache (`forget`, `reset`) stays in `_refs` until
  its last holder releases it, and is then freed;
- `_reused` holds only cached pages.

The scheduler decides when: a request looks its prefix up at admission (`match`: at most its
tokens less one, so the last prompt token is always computed and its logits exist), registers
the full pages it computed once their KV is queued on the device (`commit`, at `advance` for
prompts and at its end or preemption for the rest), and gives its pages back (`release`), tail
first, so its tail pages are evicted before the head others may share.

Pure Python over ints and bytes: no torch.
"""

from __future__ import annotations

import hashlib
from array import array

from slora.core.pages import CACHED, KV, PageAllocator
from slora.request import Request


class PrefixCache:
    def __init__(self, allocator: PageAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._page_of: dict[bytes, int] = {}  # digest -> its cached page
        self._digest_of: dict[int, bytes] = {}  # cached page -> its digest
        self._refs: dict[int, int] = {}  # page ever cached -> running requests holding it
        self._reused: set[int] = set()  # cached pages a request has taken (found again)
        self._roots: dict[tuple, bytes] = {}  # (identity, salt) -> root digest
        self.query_tokens = 0  # tokens of admitted requests looked up
        self.hit_tokens = 0  # of which found cached (not computed)
        allocator.reclaimers[int] = self._evict

    # -- keys
    def root(self, identity: str, salt: str | None) -> bytes:
        key = (identity, salt)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = hashlib.sha256(repr(key).encode()).digest()
        return root

    def digests(self, req: Request, root: bytes, n: int) -> list[bytes]:
        """`req.block_digests`, extended to at least n pages (its tokens must be known)."""
        out = req.block_digests
        have = len(out)
        if have < n:
            bs = self.block_size
            start, end, prompt = have * bs, n * bs, req.prompt_token_ids
            ids = prompt[start:end] if end <= len(prompt) else req.token_ids_from(start)[:end - start]
            data = array("q", ids).tobytes()
            step = 8 * bs  # bytes of a page's int64 token ids
            prev, sha = out[-1] if out else root, hashlib.sha256
            for at in range(0, len(data), step):
                prev = sha(prev + data[at:at + step]).digest()
                out.append(prev)
        return out

    # -- requests
    def match(self, req: Request, root: bytes) -> list[int]:
        """The cached pages of `req`'s longest cached prefix of full pages, at most
        (num_tokens - 1) // block_size of them. Looks up, takes nothing; digests pages only up
        to the first miss."""
        pages, page_of, digests = [], self._page_of, req.block_digests
        for i in range((req.num_tokens - 1) // self.block_size):
            if i == len(digests):
                self.digests(req, root, i + 1)
            p = page_of.get(digests[i])
            if p is None:
                break
            pages.append(p)
        return pages

    def take(self, req: Request, pages: list[int]) -> None:
        """`req` holds the cached `pages` (`match`'s) as its first pages; counts the hit."""
        refs, alloc = self._refs, self.allocator
        self._reused.update(pages)
        for p in pages:
            if refs[p] == 0:
                alloc.busy(p)
                alloc.retag([p], KV)
            refs[p] += 1
        n = len(pages) * self.block_size
        self.query_tokens += req.num_tokens
        self.hit_tokens += n
        req.num_cached_pages = len(pages)
        req.num_cached_tokens = n

    def commit(self, req: Request, root: bytes, num_tokens: int) -> None:
        """Cache `req`'s full pages among its first `num_tokens` tokens (computed and known)
        that it has not offered yet. A page whose digest is cached already (computed twice
        by requests admitted together) stays private to `req`."""
        n = num_tokens // self.block_size
        start = req.num_cached_pages
        if n <= start:
            return
        digests = self.digests(req, root, n)
        page_of, digest_of, refs, table = self._page_of, self._digest_of, self._refs, req.block_table
        for i in range(start, n):
            d = digests[i]
            if d not in page_of:
                p = table[i]
                page_of[d] = p
                digest_of[p] = d
                refs[p] = 1
        req.num_cached_pages = n

    def release(self, pages: list[int]) -> None:
        """A request gives its pages back, tail first: cached pages it was the last to hold
        become reclaimable (the most recently used of their segment: on probation unless
        found again), the others are freed."""
        refs, digest_of = self._refs, self._digest_of
        free, cached = [], []
        for p in reversed(pages):
            count = refs.get(p)
            if count is None:
                free.append(p)
            elif count > 1:
                refs[p] = count - 1
            elif p in digest_of:
                refs[p] = 0
                cached.append(p)
            else:  # left the cache while held: its last holder frees it
                del refs[p]
                free.append(p)
        alloc = self.allocator
        alloc.retag(cached, CACHED)
        alloc.idle_pages(cached, self._reused)
        alloc.free(free)

    def forget(self, pages: list[int]) -> None:
        """Take held `pages` out of the cache (their KV may be wrong: the request that
        computed them failed); each is freed when its last holder releases it."""
        for p in pages:
            d = self._digest_of.pop(p, None)
            if d is not None:
                del self._page_of[d]
                self._reused.discard(p)

    def reset(self) -> int:
        """Forget every cached page: those no request holds are freed now, held ones when
        released. Returns the pages freed now."""
        idle = [p for p, n in self._refs.items() if n == 0]
        self._evict(idle)
        self.forget(list(self._digest_of))
        return len(idle)

    def _evict(self, pages: list[int]) -> None:
        """The allocator reclaims cached pages no request holds."""
        page_of, digest_of, refs, reused = self._page_of, self._digest_of, self._refs, self._reused
        for p in pages:
            del page_of[digest_of.pop(p)]
            del refs[p]
        reused.difference_update(pages)
        self.allocator.busy_pages(pages)
        self.allocator.free(pages)

    # -- state
    @property
    def num_cached(self) -> int:
        """Pages in the cache (held by requests or not)."""
        return len(self._digest_of)

    def check(self) -> None:
        assert len(self._page_of) == len(self._digest_of)
        assert all(self._page_of[d] == p for p, d in self._digest_of.items())
        idle = sum(1 for n in self._refs.values() if n == 0)
        assert idle == self.allocator.used[CACHED] == sum(
            1 for k, _ in self.allocator.order() if isinstance(k, int))
        assert self._reused <= self._digest_of.keys()
        assert all(p in self.allocator.probation for p, n in self._refs.items()
                   if n == 0 and p not in self._reused)
        assert all(p in self._digest_of for p, n in self._refs.items() if n == 0)



def prefix_stats(cache: PrefixCache | None) -> dict:
    """`engine.stats()`'s prefix-cache part (zeros without prefix caching): pages in the
    cache (held by requests or not), tokens looked up at admission, tokens found, their ratio."""
    if cache is None:
        return {"prefix_cached_pages": 0, "prefix_query_tokens": 0, "prefix_hit_tokens": 0,
                "prefix_hit_rate": 0.0}
    q = cache.query_tokens
    return {"prefix_cached_pages": cache.num_cached, "prefix_query_tokens": q,
            "prefix_hit_tokens": cache.hit_tokens,
            "prefix_hit_rate": cache.hit_tokens / q if q else 0.0}
