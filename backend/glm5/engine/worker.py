"""A worker process of the distributed engine: one rank, one device, its shard of the model.

Started as ``python -m glm5.engine.worker`` with torch.distributed's env:// variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` — the ones torchrun sets), by the driver for the ranks of its
own machine and by ``glm5 worker`` on the others. It reads the driver's setup from the rendezvous store, joins the
world, loads only its slices of the checkpoint, reports ready (or its load error), then runs whatever the driver
broadcasts — the same :class:`~glm5.engine.model_runner.ModelRunner` calls the driver makes on its own shard,
in the same order — until told to shut down. It exits when the driver's process is gone (``GLM5_PARENT_PID``
watch) or when a collective fails (a peer died): a worker never outlives its engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from glm5.engine.executor import READY_PREFIX, SETUP_KEY, STARTUP_TIMEOUT_S, WorkerSetup, build_rank_runner, \
    cpu_threads, gather_status, rank_device
from glm5.engine.model_runner import ModelRunner
from glm5.heap import freeze_startup_heap, unfreeze_heap

logger = logging.getLogger("glm5.worker")


@dataclass
class WorkerState:
    """What a worker keeps between operations: the last step's batch (the accepted-row commit reads its records), the MTP
    draft loop's shared pool selection and tail snapshot."""

    last_batch: Any = None
    shared_pools: dict | None = None
    mtp_tails: torch.Tensor | None = None
    snapshots: Any = None       # the prefix cache's state snapshots of this rank (made on first use)


def apply(runner: ModelRunner, state: WorkerState, op: tuple) -> bool:
    """Run one operation the driver sent; False when it says shut down."""
    kind = op[0]
    if kind == "forward":
        state.last_batch, _ = runner.forward_packed(op[1])
    elif kind == "decode":
        state.last_batch, _ = runner.forward_decode(op[1])
    elif kind == "reset_slot":
        runner.reset_slot(op[1])
    elif kind == "snapshot_move":
        if state.snapshots is None:
            from glm5.cache.snapshot_pool import StateSnapshotPool
            state.snapshots = StateSnapshotPool(runner.cache, op[1])
        state.snapshots.move(*op[2:])
    elif kind == "commit_accepted":
        runner.commit_accepted(state.last_batch, op[1], op[2])
    elif kind == "mtp":
        _, step, mode, shape, dtype = op
        hidden = torch.empty(shape, dtype=getattr(torch, dtype), device=runner.device)
        runner.par.broadcast(hidden)
        if mode == "new":
            state.shared_pools = {}
        runner.mtp_forward_packed(step, hidden, None if mode is None else state.shared_pools)
    elif kind == "snapshot_mtp_tails":
        state.mtp_tails = runner.snapshot_mtp_tails(op[1])
    elif kind == "restore_mtp_tails":
        runner.restore_mtp_tails(op[1], state.mtp_tails)
    elif kind == "capture":
        runner.capture_cuda_graphs(op[1])
        freeze_startup_heap()   # what the capture made joins the frozen start-up heap
    elif kind == "rebalance":
        runner.rebalance_experts()
    elif kind == "call":
        _, name, args = op
        if name not in runner.RANK_CALLS:
            raise ValueError(f"the driver asked for {name!r}, not a per-rank call")
        gather_status(runner.par, getattr(runner, name)(*args))
    elif kind == "shutdown":
        return False
    else:
        raise ValueError(f"unknown operation {kind!r} from the driver (driver and worker versions differ?)")
    return True


def _watch_parent(parent: int) -> None:
    """Exit when the process that started us is gone (its children are re-parented)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def main() -> int:
    logging.basicConfig(level=os.environ.get("GLM5_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s rank%(rank)s %(name)s: %(message)s", stream=sys.stderr)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **kw: Any) -> logging.LogRecord:
        rec = old_factory(*a, **kw)
        rec.rank = rank
        return rec
    logging.setLogRecordFactory(factory)
    parent = os.environ.get("GLM5_PARENT_PID")
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    import datetime
    import torch.distributed as dist

    from glm5.config import ModelConfig
    from glm5.distributed.parallel_state import build_context, join_world

    store = dist.TCPStore(addr, port, world, is_master=False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    setup: WorkerSetup = pickle.loads(store.get(SETUP_KEY))
    device = rank_device(setup, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(int(os.environ.get("GLM5_LOCAL_WORLD_SIZE", "1"))))
    store.set(f"{READY_PREFIX}{rank}", str(os.getpid()))
    backend, control = join_world(rank, world, device, store)
    par = build_context(setup.parallel, rank, backend, control)
    error = None
    runner = None
    try:
        cfg = ModelConfig.from_pretrained(setup.engine_args["model"])
        runner = build_rank_runner(setup, cfg, par, device)
    except Exception as e:  # the driver reports it, with this rank's number
        logger.exception("loading the shard failed")
        error = f"{type(e).__name__}: {e}"
    status = gather_status(par, error)
    if any(s is not None for s in status):
        return 1
    assert runner is not None
    logger.info("rank %d ready on %s", rank, device)
    freeze_startup_heap()   # a full collection on one rank would stall the world (glm5.heap)
    state = WorkerState()
    try:
        with torch.no_grad():
            while True:
                ops = par.broadcast_object(None)
                if not all(apply(runner, state, op) for op in ops):
                    break
    except Exception:  # a peer died or an operation failed: the driver sees the closed connection / exit code
        logger.exception("worker rank %d failed", rank)
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    unfreeze_heap()
    return 0


if __name__ == "__main__":
    sys.exit(main())
