"""The loop of a tensor-parallel worker (ranks 1..N-1): join the group, build this rank's
runner (its shard of the weights, its pool), then run each step rank 0 sends until it closes
the group. The worker keeps the greedy tokens of its last step, as rank 0 does, for the
decode rows whose input ids come from them (async scheduling)."""

from __future__ import annotations

import os
import sys
import traceback

from slora.config import EngineConfig, ModelConfig
import torch.distributed as dist

from slora.distributed.group import JOINED, START_TIMEOUT, TensorParallel
from slora.runner.device import resolve_device


def launch(config: EngineConfig, model_config: ModelConfig) -> TensorParallel:
    """Rank 0's start of the group: checks that the model splits over the degree (before any
    process starts), then joins torchrun's group or spawns the workers (`worker_main`)."""
    from slora.distributed.shapes import check_degree

    check_degree(model_config, config.tensor_parallel_size)
    return TensorParallel.launch(config, resolve_device(config.device), worker_main)


def worker_main(config: EngineConfig, rank: int, size: int, address: tuple[str, int]) -> None:
    """The spawned worker's entry point: joins rank 0's store at `address`; exit code 0 when
    rank 0 closed the group, 1 (with the traceback on stderr) when the worker failed."""
    try:
        store = dist.TCPStore(*address, size, is_master=False, timeout=START_TIMEOUT)
        store.add(JOINED, 1)
        tp = TensorParallel.join(config, rank, size, store, resolve_device(config.device))
        serve(config, tp)
    except BaseException:  # noqa: BLE001 - reported on stderr; rank 0 sees the exit code
        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (no interpreter teardown: rank 0 waits for this exit)


def serve_torchrun(config: EngineConfig) -> None:
    """A worker under torchrun (RANK > 0): joins the group torchrun set up and serves until
    rank 0 closes it."""
    tp = TensorParallel.join(config, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                             "env://", resolve_device(config.device))
    serve(config, tp)


def serve(config: EngineConfig, tp: TensorParallel) -> None:
    from slora.runner import ModelRunner

    runner = ModelRunner(config, ModelConfig.from_dir(config.model), config.model, tp=tp)
    tokens = None
    while (msg := tp.recv_step()) is not None:
        batch, pairs, loads, prefetch, width = msg
        if runner.graphs is not None and width:  # the page-table width rank 0's graphs have
            runner.graphs.reserve_pages(width)
        logits = runner.run(batch, pairs, tokens, [("", p) for p in loads],
                            [("", p) for p in prefetch], None)
        if logits is not None:
            tokens = logits.argmax(dim=-1)
    tp.close()
