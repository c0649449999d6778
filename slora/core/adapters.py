"""Adapter registry and tiered residency: disk -> host (LRU, bytes-bounded) -> device pool.

This module holds the *state* (which adapter is where, who uses it, in which order it was
used); the runner holds the tensors and performs the copies the scheduler's plan asks for.

Device tier: a resident adapter owns `num_pages` pages of the shared pool. Running requests
hold references; an adapter with references is never evicted. Idle resident adapters (kept
warm for future requests, or prefetched) are reclaimable: they sit in the allocator's one
eviction order beside the prefix cache's cached KV pages (`PageAllocator.evict_for`: after
cached pages no second request found, least recently used first among the rest), and are
evicted in that order when the pool needs pages, for KV or for another adapter.

Identity: `AdapterInfo.identity` names the adapter's content (a digest of its weights and
config, or a synthetic adapter's shape and seed), not its name: the prefix cache keys KV by it,
so a name registered again with other weights never meets the KV computed with the old ones.

Host tier: the adapter's flat weights in host memory (pinned on a GPU host), bounded by
`host_cache_bytes`; least recently used entries are dropped first. Missing from host means
the next load reads the files again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from numbers import Integral
from typing import Callable, Hashable

from slora.config import LORA_ALIGN, LORA_MODULES, VOCAB_MODULES, ModelConfig, cdiv, round_up
from slora.core.pages import ADAPTER, PageAllocator


def synthetic_identity(rank: int, targets, seed: int, *kind: str) -> str:
    """The identity of a synthetic adapter: its weights follow from (rank, targets, seed) and
    its kind ("dora"), so adapters of one such key have the same content (the engine's and the
    simulator's rule)."""
    return ":".join(("synthetic", str(rank), ",".join(targets), str(seed), *kind))


@dataclass(frozen=True)
class AdapterLayout:
    """Where an adapter's rows live in its per-layer virtual buffer (see kernels.reference).

    Offsets are the same in every layer (sized by each module's largest rank over layers);
    `ranks[l][m]` may be smaller in some layers (rank_pattern) or 0 (layers_to_transform).

    DoRA: `dora[m]` is the offset of module m's DoRA row (d_out elements, after every module's
    A and B^T rows), or -1 where m has none; empty for a plain LoRA adapter. The row holds
    magnitude / ||W + s B A||_row - 1 per output channel (0 in layers where m has rank 0).

    LoRA on the vocabulary modules (config.VOCAB_MODULES) lives in one layer's slot each, past
    the seven modules' rows and DoRA rows (`vocab_offsets`, A then B^T rows, same alignment
    rule): embed_tokens' A [r, vocab] and B^T [r, hidden] in layer 0's buffer (the embedding
    runs with the first piece of layers), lm_head's A [r, hidden] and B^T [r, vocab] in the
    last layer's (the head runs after it). Both start at the same offset when the model has
    more than one layer, so they cost the larger of the two a page id, not their sum; with one
    layer lm_head follows embed_tokens. `vocab_layers` names the two layers.

    Adapter-added tokens (ids vocab .. vocab + added_tokens - 1, past the base vocabulary):
    their embedding rows (added_tokens rows of hidden) in layer 0's slot and their lm_head rows
    in the last layer's, past everything above, at `added_offsets` (embedding, head).
    """

    ranks: tuple[tuple[int, ...], ...]  # [num_layers][7]
    offsets: tuple[tuple[int, int], ...]  # [7] (offset of A rows, offset of B^T rows)
    elems: int  # elements per layer, a multiple of LORA_ALIGN
    dora: tuple[int, ...] = ()  # [7] offset of the DoRA row, -1: none; (): no DoRA module
    vocab_ranks: tuple[int, int] = (0, 0)  # (embed_tokens, lm_head); 0 = not targeted
    vocab_offsets: tuple[tuple[int, int], ...] = ((0, 0), (0, 0))  # [2] (A, B^T) as `offsets`
    added_tokens: int = 0  # tokens the adapter adds to the base vocabulary
    added_offsets: tuple[int, int] = (0, 0)  # (embedding rows in layer 0, head rows in layer L-1)

    @classmethod
    def build(cls, cfg: ModelConfig, ranks: list[list[int]], dora=(),
              vocab_ranks: tuple[int, int] = (0, 0), added_tokens: int = 0) -> "AdapterLayout":
        """`dora`: the LORA_MODULES names whose output DoRA rescales (each must have a rank
        above 0 in some layer); `vocab_ranks`: the ranks of embed_tokens' and lm_head's LoRA;
        `added_tokens`: how many tokens the adapter adds."""
        offsets, pos = [], 0
        for m, name in enumerate(LORA_MODULES):
            r = max(layer[m] for layer in ranks)
            d_in, d_out = cfg.module_dims(name)
            a = pos
            pos += r * round_up(d_in, LORA_ALIGN)
            offsets.append((a, pos))
            pos += r * round_up(d_out, LORA_ALIGN)
        rows = [-1] * len(LORA_MODULES)
        for m, name in enumerate(LORA_MODULES):
            if name in dora:
                rows[m] = pos
                pos += round_up(cfg.module_dims(name)[1], LORA_ALIGN)
        vocab_offsets, end, start = [], pos, pos
        for r, name in zip(vocab_ranks, VOCAB_MODULES):
            if len(ranks) == 1:  # one layer holds both: one after the other
                start = end
            d_in, d_out = cfg.module_dims(name)
            vocab_offsets.append((start, start + r * round_up(d_in, LORA_ALIGN)))
            end = max(end, vocab_offsets[-1][1] + r * round_up(d_out, LORA_ALIGN))
        size = added_tokens * round_up(cfg.hidden_size, LORA_ALIGN)
        added = (end, end + size if len(ranks) == 1 else end)
        return cls(tuple(tuple(r) for r in ranks), tuple(offsets), added[1] + size,
                   dora=tuple(rows) if dora else (), vocab_ranks=tuple(vocab_ranks),
                   vocab_offsets=tuple(vocab_offsets), added_tokens=added_tokens,
                   added_offsets=added)

    def num_pages(self, page_size: int) -> int:
        return cdiv(self.elems, page_size)

    @property
    def vocab_layers(self) -> tuple[int, int]:
        """The layer whose slot holds embed_tokens' rows, and lm_head's."""
        return 0, len(self.ranks) - 1

    @property
    def max_rank(self) -> int:
        return max(max(max(r) for r in self.ranks), *self.vocab_ranks)

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules it targets (a rank above 0 in some layer), in LORA_MODULES order, then
        VOCAB_MODULES'."""
        return (tuple(m for i, m in enumerate(LORA_MODULES) if any(layer[i] for layer in self.ranks))
                + tuple(m for m, r in zip(VOCAB_MODULES, self.vocab_ranks) if r))

    @property
    def dora_modules(self) -> tuple[str, ...]:
        """The modules with a DoRA row, in LORA_MODULES order."""
        return tuple(m for m, off in zip(LORA_MODULES, self.dora) if off >= 0)

    @classmethod
    def uniform(cls, cfg: ModelConfig, rank: int, targets, dora: bool = False) -> "AdapterLayout":
        """Every layer: `rank` on each module in `targets` (synthetic adapters, the simulator),
        with a DoRA row on each linear one if `dora`. `rank` is an integer >= 1 (TypeError /
        ValueError otherwise); `targets` a non-empty collection of LORA_MODULES or
        VOCAB_MODULES names (ValueError otherwise)."""
        if isinstance(rank, bool) or not isinstance(rank, Integral):
            raise TypeError(f"adapter: rank must be an integer, not {type(rank).__name__} "
                            f"({rank!r})")
        if isinstance(targets, str):
            targets = (targets,)
        unknown = [t for t in targets if t not in LORA_MODULES + VOCAB_MODULES]
        if unknown or rank < 1 or not targets:
            raise ValueError(f"adapter: rank {rank} must be >= 1 and target modules "
                             f"{list(targets)} must be one or more of "
                             f"{LORA_MODULES + VOCAB_MODULES}")
        row = [int(rank) if m in targets else 0 for m in LORA_MODULES]
        return cls.build(cfg, [row] * cfg.num_layers,
                         tuple(t for t in targets if t in LORA_MODULES) if dora else (),
                         tuple(int(rank) if m in targets else 0 for m in VOCAB_MODULES))


@dataclass
class AdapterInfo:
    name: str
    num_pages: int  # pool pages it needs when resident
    nbytes: int  # host bytes of its flat weights (all layers)
    source: str  # a path, or "synthetic"
    layout: AdapterLayout | None = None  # where its rows sit in its pages (None: simulated)
    pack: Callable | None = None  # (page_size, dtype) -> its host copy; the runner calls it
    pages: list[int] | None = None  # device pages while resident
    refcount: int = 0  # running requests using it
    # the key of a host buffer it shares with other adapters (a synthetic adapter's
    # (rank, targets, seed)), or None; the manager counts the registered adapters of each key
    shared: Hashable | None = None
    # its content's identity (see the module docstring); None: the name stands for it
    identity: str | None = None

    @property
    def resident(self) -> bool:
        return self.pages is not None


class AdapterManager:
    def __init__(self, allocator: PageAllocator, host_cache_bytes: int) -> None:
        self.allocator = allocator
        self.host_cache_bytes = host_cache_bytes
        self.adapters: dict[str, AdapterInfo] = {}
        # idle (resident, refcount 0) adapters are protected in the allocator's order, by name
        allocator.reclaimers[str] = self._reclaim
        self._host: OrderedDict[str, int] = OrderedDict()  # name -> bytes; LRU first
        self.pages_of: dict[str | None, int] = {None: 0}  # registered name -> its num_pages
        self.resident: set[str] = set()  # names holding device pages (kept by load / _evict)
        self._sharing: dict[Hashable, int] = {}  # AdapterInfo.shared -> registered adapters
        self.host_bytes = 0
        self.loads = 0
        self.evictions = 0
        self.host_loads = 0
        self.host_evictions = 0

    # -- registry
    def check_name(self, name: object) -> None:
        """A name a new adapter may take: a non-empty str (TypeError / ValueError otherwise)
        that no registered adapter has (ValueError). `register` checks it; callers check it
        first too when they would otherwise read files or make buffers for nothing."""
        if not isinstance(name, str):
            raise TypeError(f"adapter name must be a non-empty str, not {type(name).__name__} "
                            f"({name!r})")
        if not name:
            raise ValueError("adapter name must be a non-empty str, not ''")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already registered; remove_adapter first")

    def register(self, info: AdapterInfo) -> None:
        self.check_name(info.name)
        if info.num_pages > self.allocator.total:
            raise ValueError(f"adapter {info.name!r} needs {info.num_pages} pages but the pool has "
                             f"only {self.allocator.total}; raise num_pages or use a smaller rank")
        self.adapters[info.name] = info
        self.pages_of[info.name] = info.num_pages
        if info.shared is not None:
            self._sharing[info.shared] = self._sharing.get(info.shared, 0) + 1

    def sharing(self, key: Hashable) -> int:
        """How many registered adapters share the host buffer `key` (AdapterInfo.shared)."""
        return self._sharing.get(key, 0)

    def unregister(self, name: str) -> list[int]:
        """Forget an adapter; returns its device pages (freed). Fails while requests use it."""
        info = self.get(name)
        if info.refcount:
            raise ValueError(f"adapter {name!r} is used by {info.refcount} running request(s); "
                             "remove it after they finish")
        freed = self._evict(name) if info.resident else []
        self.drop_host(name)
        del self.adapters[name]
        del self.pages_of[name]
        if info.shared is not None:
            self._sharing[info.shared] -= 1
            if not self._sharing[info.shared]:
                del self._sharing[info.shared]
        return freed

    def get(self, name: str) -> AdapterInfo:
        try:
            return self.adapters[name]
        except KeyError:
            known = ", ".join(sorted(self.adapters)[:10]) or "none registered"
            raise KeyError(f"unknown adapter {name!r} (registered: {known}); "
                           "call engine.add_adapter(name, path) first") from None

    # -- device tier
    def pages_needed(self, name: str | None) -> int:
        """Pages to allocate before a request on `name` can run (0 if resident or base)."""
        if name is None:
            return 0
        info = self.adapters[name]
        return 0 if info.resident else info.num_pages

    def load(self, name: str) -> list[int] | None:
        """Allocate pages for a non-resident adapter (no eviction); None if the pool is short."""
        info = self.adapters[name]
        assert not info.resident, f"adapter {name!r} is already resident"
        pages = self.allocator.alloc(info.num_pages, ADAPTER)
        if pages is None:
            return None
        info.pages = pages
        self.resident.add(name)
        self.allocator.idle(name, info.num_pages)
        self.loads += 1
        return pages

    def acquire(self, name: str) -> None:
        info = self.adapters[name]
        assert info.resident, f"adapter {name!r} must be resident before use"
        info.refcount += 1
        self.allocator.busy(name)

    def release(self, name: str) -> None:
        info = self.adapters[name]
        assert info.refcount > 0, f"adapter {name!r} released more often than acquired"
        info.refcount -= 1
        if info.refcount == 0:
            self.allocator.idle(name, info.num_pages)  # most recently used: evicted last

    def touch(self, name: str) -> None:
        """Mark an idle resident adapter as recently used (prefetch hits, for example)."""
        self.allocator.touch(name)

    def evict_for(self, n: int, keep=frozenset()) -> list[str] | None:
        """Reclaim idle adapters and cached KV pages in their one LRU order (never those in
        `keep`: names, page ids) until n pages are free (`PageAllocator.evict_for`).

        Returns the evicted adapters' names, or None (evicting nothing) if even reclaiming
        everything reclaimable would not free enough.
        """
        victims = self.allocator.evict_for(n, keep)
        if victims is None or not victims:
            return victims
        return [v for v in victims if isinstance(v, str)]

    def _reclaim(self, names: list[str]) -> None:
        for name in names:
            self.allocator.free(self._evict(name))

    def unload(self, name: str) -> list[int]:
        """Make an idle resident adapter not resident, as a load that failed leaves it (not
        counted as an eviction); returns its pages, for the caller to free."""
        pages = self._evict(name)
        self.evictions -= 1
        return pages

    def _evict(self, name: str) -> list[int]:
        info = self.adapters[name]
        assert info.refcount == 0, f"adapter {name!r} is in use and cannot be evicted"
        pages, info.pages = info.pages, None
        self.resident.discard(name)
        self.allocator.busy(name)
        self.evictions += 1
        return pages

    def idle_pages(self) -> int:
        return sum(n for k, n in self.allocator.order() if isinstance(k, str))

    # -- host tier
    def on_host(self, name: str) -> bool:
        return name in self._host

    def admit_host(self, name: str) -> list[str]:
        """Record `name` as cached on the host; returns the names to drop (LRU, over budget)."""
        if name in self._host:
            self._host.move_to_end(name)
            return []
        size = self.adapters[name].nbytes
        self._host[name] = size
        self.host_bytes += size
        self.host_loads += 1
        dropped = []
        while self.host_bytes > self.host_cache_bytes and len(self._host) > 1:
            old = next(iter(self._host))
            self.drop_host(old)
            dropped.append(old)
        return dropped

    def drop_host(self, name: str) -> None:
        if name in self._host:
            self.host_bytes -= self._host.pop(name)
            self.host_evictions += 1
