"""The host tier of adapters and the copies from it into the pool.

The host tier holds adapters packed as their pool pages ([layers, pages, page_size], pinned
on a GPU). Which adapters it keeps is `AdapterManager`'s LRU decision (`admit_host` names the
ones to drop); this class keeps `tensors` equal to that LRU state: every tensor added or
dropped here goes through `host_copy`, `drop` or the LRU's answer.

On a GPU every copy runs on `copy_stream`, beside the forward. The two kinds of copy:

- a step's own loads (`load_for_step`): adapters the step reads and no prefetch brought; a
  piece of layers at a time, an event after each piece, so the forward waits for its first
  piece's copies only and its later layers run while the later pieces still arrive;
- prefetches (`prefetch`): adapters a later step reads, copied while this step runs. Their
  pages were free or held idle adapters at scheduling time, so this step never reads them.

Every copy waits for the work queued on the compute stream before it (its pages may be ones
an earlier step read or wrote: a finished request's KV, an evicted adapter), and the compute
stream waits for every copy before the next step starts (`wait_for_copies`).
"""

from __future__ import annotations

from typing import Callable

import torch

from slora.core.adapters import AdapterInfo, AdapterManager
from slora.model.loader import AdapterError
from slora.runner.device import intra_op_threads

Loads = list[tuple[str, list[int]]]  # (adapter name, its pool pages)


class HostAdapterTier:
    """pool: the pool tensor [layers, pages, page_size]; piece_starts: the first layer of each
    piece a step's own loads are cut into (the pieces of the step's graphs); read_threads:
    torch's intra-op threads for an adapter's read from disk, its packing, check and pinning,
    whatever the step's host work runs on (`EngineConfig.host_threads`; 0: as they are)."""

    def __init__(self, pool: torch.Tensor, dtype: torch.dtype, piece_starts: list[int],
                 read_threads: int = 0) -> None:
        self.pool = pool
        self.dtype = dtype
        self.piece_starts = piece_starts
        self.read_threads = read_threads
        self.cuda = pool.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self.tensors: dict[str, torch.Tensor] = {}  # adapter name -> its packed pages
        self.staged: dict[str, torch.Tensor] = {}  # the step's adapters, read by `stage`

    def host_copy(self, info: AdapterInfo, adapters: AdapterManager) -> torch.Tensor:
        """The adapter's packed weights from the host tier, reading them from disk on a miss;
        the adapters the LRU drops to make room leave the tier."""
        host = self.tensors.get(info.name)
        if host is None:
            with intra_op_threads(self.read_threads):
                host = self._read(info)
            self.tensors[info.name] = host
        for dropped in adapters.admit_host(info.name):
            self.tensors.pop(dropped, None)
        return host

    def _read(self, info: AdapterInfo) -> torch.Tensor:
        """The adapter's weights packed into pages' rows, checked finite, pinned on a GPU."""
        host = info.pack(self.pool.shape[2], self.dtype)
        # A read holding NaN or inf never reaches the pool. (Buffers shared by synthetic
        # adapters are drawn by slora, finite, and large: they are not scanned per read.)
        if info.shared is None and not bool(torch.isfinite(host).all()):
            raise AdapterError(f"adapter {info.name!r}: its weights hold NaN or inf",
                               adapter=info.name)
        if self.cuda and not host.is_pinned():
            host = host.pin_memory()
        return host

    def stage(self, names: list[str], adapters: AdapterManager) -> dict[str, Exception]:
        """Bring the adapters a step copies into the pool into the host tier: the reads from
        disk happen here, before the step is launched, so a read that fails touches no other
        adapter's rows. Returns {name: error} of the reads that failed (the tier is left as
        it was for those). `load` takes the staged copies even if the LRU dropped one since."""
        self.staged, failed = {}, {}
        for name in names:
            try:
                self.staged[name] = self.host_copy(adapters.adapters[name], adapters)
            except Exception as e:  # noqa: BLE001 - the engine fails this adapter's requests
                failed[name] = e
        return failed

    def drop(self, name: str) -> None:
        """Forget an adapter's host copy (the adapter was removed)."""
        self.tensors.pop(name, None)

    def load(self, loads: Loads, adapters: AdapterManager,
             on_piece: Callable[[int], None] | None = None) -> None:
        """Copy adapters into their pool pages, on the current stream: per adapter one host ->
        device copy of its layers, then one `index_copy_` into the pool's (layer, page) rows,
        wherever its pages lie. With `on_piece`, a piece of layers at a time
        (`piece_starts`), on_piece(its first layer) called after each piece's copies.

        The rows' ids travel to the device once for the whole call, in one pinned tensor: a
        pageable copy would block the host until the stream drains. One `index_copy_` per
        adapter and piece keeps the launches few: the pool is too large for 32-bit indexing,
        so a copy through its [layers, pages, page] view splits into one kernel per layer."""
        self._copy(loads, [self._host(name, adapters) for name, _ in loads], on_piece)

    def _host(self, name: str, adapters: AdapterManager) -> torch.Tensor:
        """The adapter's packed copy: the one `stage` read for this step, else the tier's."""
        if name in self.staged:
            return self.staged[name]
        return self.host_copy(adapters.adapters[name], adapters)

    def _copy(self, loads: Loads, hosts: list[torch.Tensor],
              on_piece: Callable[[int], None] | None) -> None:
        """Copy each packed adapter of `hosts` into the pages of its entry of `loads`."""
        L, P, ps = self.pool.shape
        hosts = [h.view(L, len(pages), ps) for h, (_, pages) in zip(hosts, loads)]
        starts = self.piece_starts if on_piece is not None else [0]
        pieces = list(zip(starts, starts[1:] + [L]))
        # pool rows in the order the copies read them: by piece, adapter, layer, page
        layer_rows = torch.arange(L)[:, None] * P
        page_ids = [torch.tensor(pages) for _, pages in loads]
        rows = torch.cat([(layer_rows[l0:l1] + ids).flatten() for l0, l1 in pieces for ids in page_ids])
        if self.cuda:
            rows = rows.pin_memory().to(self.pool.device, non_blocking=True)
        pool, at = self.pool.view(L * P, ps), 0
        for l0, l1 in pieces:
            for host in hosts:
                src = host[l0:l1].to(self.pool.device, non_blocking=True).view(-1, ps)
                pool.index_copy_(0, rows[at:at + len(src)], src)
                at += len(src)
            if on_piece is not None:
                on_piece(l0)

    def load_for_step(self, loads: Loads, adapters: AdapterManager) -> dict[int, torch.cuda.Event]:
        """Copy the adapters a step reads itself: {a piece's first layer: the event after its
        layers' copies}, for the forward to wait for piece by piece (empty when there is
        nothing to wait for: no loads, or a CPU, where the copies run in line)."""
        if not loads:
            return {}
        if self.copy_stream is None:
            self.load(loads, adapters)
            return {}
        ready: dict[int, torch.cuda.Event] = {}

        def mark(layer: int) -> None:
            ready[layer] = torch.cuda.Event()
            ready[layer].record()

        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self.load(loads, adapters, mark)
        return ready

    def prefetch(self, loads: Loads, adapters: AdapterManager,
                 after: torch.cuda.Event | None = None) -> None:
        """Copy prefetched adapters on the copy stream, issued once the forward is queued, so
        the copies run beside it; this step's forward never reads their pages, so the copies
        need not wait for it. `after`: an event after this step's inputs were uploaded; it
        follows any step still running (async scheduling), whose pages the copies may
        overwrite (a request that ended or was preempted meanwhile)."""
        if not loads:
            return
        if self.copy_stream is None:
            return self.load(loads, adapters)
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            self.load(loads, adapters)

    def wait_for_copies(self) -> None:
        """Make the compute stream wait for every copy queued so far: the prefetches of the
        last step land before the next step reads them."""
        if self.copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)
