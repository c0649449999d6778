"""The tensor-parallel group: its processes, its collectives and the step messages.

    rank 0        the engine's process: scheduler, sampling, outputs; runs its own shard
    ranks 1..N-1  workers (`slora.distributed.worker`): each step, the message rank 0
                  broadcasts, the adapter shards rank 0 scatters, then the same forward

Rank 0 spawns the workers (`worker.launch`, torch.multiprocessing's spawn), or, under
`torchrun` (RANK / WORLD_SIZE set), every process joins the group torchrun set up and ranks
above 0 become workers. Two process groups: `group` runs the model's collectives (NCCL on
CUDA, gloo on CPU: the same code either way) with a bounded timeout; `control`, always gloo
on the host, carries the step messages and waits without a limit (an idle engine sends
none).

A step on the wire (`send_step` / `recv_step`): a header [op, words] broadcast, then the
message (`codec.encode` of the batch's host tensors, the decode rows whose ids come from the
last step's tokens, the adapter loads' and prefetches' page lists, the graphs' page-table
width), then one scatter per adapter copied: each rank its own shard. A rank's collectives
then come in the same order on every rank, because every rank runs the same code on the same
batch.

Failure: a worker that exits makes rank 0's next collective fail (gloo: its socket closes)
or rank 0 finds it dead before the step (`check`). Either way `fail` names the worker and its
exit code, ends the other workers and marks the group dead: the engine fails its requests
and refuses new ones. A worker whose rank 0 is gone exits when its next receive fails.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from slora.distributed import codec
from slora.distributed.shapes import ROW_PARALLEL_GROUPS
from slora.distributed.sharding import VocabShard

STEP, STOP = 1, 2
# A collective of a step that takes longer than this means a rank is stuck: rank 0 fails.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits this long for the next step
START_TIMEOUT = datetime.timedelta(minutes=5)  # spawned workers join within this
JOINED = "slora_tp_joined"  # the store's count of the workers that joined


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or stopped answering: the engine cannot serve on."""


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher) set RANK and WORLD_SIZE."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


class TensorParallel:
    """One rank's membership of the group. `size` ranks, this one `rank`; `device` its
    device; `vocab` its vocabulary rows (set by the runner once the model is sharded)."""

    def __init__(self, rank: int, size: int, device: torch.device, procs=()) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.procs = list(procs)  # rank 0 that spawned them: the workers' processes
        self.nccl = device.type == "cuda"
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) \
            if self.nccl else self.group
        self.vocab: VocabShard | None = None
        self.dead: str | None = None

    # -- start and stop
    @classmethod
    def launch(cls, config, device: torch.device, worker_main) -> "TensorParallel":
        """Rank 0 of a new group of `config.tensor_parallel_size` ranks: under torchrun, the
        group torchrun set up; else N-1 spawned workers on this host (127.0.0.1), each
        running `worker_main(config, rank, size, address)` (slora.distributed.worker's)."""
        n = config.tensor_parallel_size
        if torchrun_rank() is not None:
            world = int(os.environ["WORLD_SIZE"])
            if world != n:
                raise ValueError(f"EngineConfig.tensor_parallel_size={n} but torchrun started "
                                 f"WORLD_SIZE={world} processes; they must match")
            return cls.join(config, torchrun_rank(), n, "env://", device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + n:
            raise ValueError(f"EngineConfig.tensor_parallel_size={n} needs {n} GPUs from "
                             f"{device}; this machine has {torch.cuda.device_count()}")
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                              timeout=START_TIMEOUT)
        address = ("127.0.0.1", store.port)
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(config, k, n, address), daemon=True,
                             name=f"slora-tp{k}") for k in range(1, n)]
        try:
            for p in procs:
                p.start()
            # every worker joins, or one exits first: no wait on a worker that is gone
            deadline = time.monotonic() + START_TIMEOUT.total_seconds()
            while store.add(JOINED, 0) < n - 1:
                dead = [(k, p) for k, p in enumerate(procs, 1) if not p.is_alive()]
                if dead:
                    k, p = dead[0]
                    raise WorkerDied(f"tensor-parallel worker rank {k} (pid {p.pid}) exited "
                                     f"with code {p.exitcode} while starting (its traceback "
                                     "is on stderr)")
                if time.monotonic() > deadline:
                    raise WorkerDied(f"tensor-parallel workers did not start within "
                                     f"{START_TIMEOUT}")
                time.sleep(0.02)
            return cls.join(config, 0, n, store, device, procs)
        except BaseException:
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise

    @classmethod
    def join(cls, config, rank: int, n: int, store, device: torch.device,
             procs=()) -> "TensorParallel":
        """Join the group as `rank` (rank 0: the engine; others: workers) through `store`
        (a TCPStore, "env://" under torchrun); `device` is rank 0's device, each rank taking
        the next one on CUDA."""
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + rank)
            torch.cuda.set_device(device)
        where = dict(init_method=store) if isinstance(store, str) else dict(store=store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=n, timeout=COLLECTIVE_TIMEOUT, **where)
        return cls(rank, n, device, procs)

    def close(self) -> None:
        """Rank 0: tell the workers to stop, wait for them, leave the group."""
        if self.rank == 0 and self.dead is None:
            try:
                self._broadcast_header(STOP, 0)
            except Exception:  # noqa: BLE001 - a worker already gone: ended below
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def check(self) -> None:
        """Rank 0: WorkerDied if the group is dead or a worker has exited."""
        if self.dead is None and not all(p.is_alive() for p in self.procs):
            self.fail(None)
        if self.dead is not None:
            raise WorkerDied(self.dead)

    def fail(self, error: BaseException | None) -> WorkerDied:
        """Rank 0: the group cannot go on (a worker died, or a step broke off between
        collectives and the ranks are out of step). Ends the workers, leaves the group and
        returns the error that says why."""
        if self.dead is None:
            why = ""
            for k, p in enumerate(self.procs, 1):
                p.join(timeout=1 if error is not None else 0)
                if not p.is_alive():
                    why = (f"tensor-parallel worker rank {k} (pid {p.pid}) exited with code "
                           f"{p.exitcode}")
                    break
            if not why:
                why = f"a tensor-parallel step failed: {type(error).__name__}: {error}"
            self.dead = f"{why}; the engine has shut down and serves no more requests"
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=10)
            self.procs = []
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - the group is already broken
                    pass
        return WorkerDied(self.dead)

    def agree(self, pages: int) -> int:
        """The fewest pool pages any rank has room for: every rank's pool takes that many,
        so one page id means one page on every rank."""
        t = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # -- the model's collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        dist.all_reduce(t, group=self.group)
        return t

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` from vocabulary-sharded tables: each rank looks up the ids
        in its rows (zeros elsewhere) and the ranks sum: exact, one rank contributes each."""
        v = self.vocab
        local = ids - v.start
        mine = (local >= 0) & (local < v.size)
        out = table[local.clamp(0, v.size - 1)] * mine[:, None].to(table.dtype)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The full vocabulary's logits [S, V] from each rank's rows [S, V / N]; every rank
        gets them."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.vocab.vocab]

    def lora_input(self, group: str, x: torch.Tensor) -> torch.Tensor:
        """The input of a LoRA group's shrink on this rank: a column-parallel group's (qkv,
        gate_up) x is the whole hidden state, replicated, and this rank's A holds the hidden
        columns [k h/N, (k+1) h/N): their view of x. A row-parallel group's x is already
        the rank's own. A copy where the view would not start on a 16-byte boundary (the
        CUDA MBGMV's vector loads need one)."""
        if group in ROW_PARALLEL_GROUPS:
            return x
        cols = x.shape[1] // self.size
        view = x[:, self.rank * cols:(self.rank + 1) * cols]
        return view if view.data_ptr() % 16 == 0 else view.contiguous()

    def lora_partials(self, group: str, xa, out: torch.Tensor):
        """(xa, out) for a LoRA group's expand on this rank. Every rank's xa is a partial
        product over its slice of the input (`lora_input`): summed over the ranks in place
        (an all-reduce of [T, modules, rank] fp32). Row-parallel groups (o, down): `out`
        narrowed to this rank's hidden columns, where B's rows of this rank add the delta
        into the partial sum the base layer's all-reduce then completes; column-parallel
        groups: `out` is the rank's own columns already. xa: a tensor, or a tuple of tensors
        and Nones (one per kernel)."""
        for t in (xa if isinstance(xa, tuple) else (xa,)):
            if t is not None:
                self.all_reduce(t)
        if group not in ROW_PARALLEL_GROUPS:
            return xa, out
        cols = out.shape[1] // self.size
        return xa, out[:, self.rank * cols:(self.rank + 1) * cols]

    # -- step messages
    def _broadcast_header(self, op: int, words: int) -> None:
        dist.broadcast(torch.tensor([op, words], dtype=torch.int64), 0, group=self.control)

    def send_step(self, value) -> None:
        """Rank 0: the step's message to every worker."""
        msg = codec.encode(value)
        self._broadcast_header(STEP, msg.numel())
        dist.broadcast(msg, 0, group=self.control)

    def recv_step(self):
        """A worker: the next step's message; None when rank 0 closes the group."""
        head = torch.empty(2, dtype=torch.int64)
        dist.broadcast(head, 0, group=self.control)
        op, words = head.tolist()
        if op == STOP:
            return None
        msg = torch.empty(words, dtype=torch.int64)
        dist.broadcast(msg, 0, group=self.control)
        return codec.decode(msg)

    def scatter(self, shards: torch.Tensor | None, shape, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of an adapter: rank 0 passes every rank's ([N, *shape], on the
        host), the others None; each gets its own [*shape] of `dtype`, on its device under
        NCCL."""
        if self.rank == 0:
            src = shards.to(self.device) if self.nccl else shards
            mine = torch.empty_like(src[0])
            dist.scatter(mine, list(src.unbind(0)), src=0, group=self.group)
            return mine
        mine = torch.empty(shape, dtype=dtype, device=self.device if self.nccl else "cpu")
        dist.scatter(mine, None, src=0, group=self.group)
        return mine
