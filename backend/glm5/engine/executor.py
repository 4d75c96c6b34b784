"""The distributed executor: one process per device, the engine in the driver (rank 0).

Shape (vLLM's multiprocess executor, with the driver holding rank 0's shard): the process that runs the
:class:`~glm5.engine.llm_engine.LLMEngine` — scheduler, sampler, detokenizer, the Triton glue — is rank 0 of a
``torch.distributed`` world and runs its own shard of the model; every other rank is a worker process
(:mod:`glm5.engine.worker`) on its own device. Per step the driver broadcasts the packed step (a
:class:`~glm5.engine.model_runner.PackedStep`, or the rows of a decode step) on a gloo control group, every rank
runs the same forward on its shard (collectives inside the layers), and the logits — gathered over the
vocab-parallel LM head — are already on the driver, which samples. Sampling where the logits are avoids shipping
``[rows, vocab]`` logits between processes every step.

Why the driver is a rank rather than a separate process: the sampler, speculative verification and the MTP
draft loop stay the single-device code, and the step's logits never cross a process boundary. The price:
a collective blocked on a dead peer must be broken from outside — the watchdog thread aborts the process groups
when a worker exits (gloo already fails at once on the closed connection).

Lifecycle: the driver hosts the rendezvous (a ``TCPStore`` at ``master_addr:master_port``, the env:// contract
torchrun uses), publishes the setup there, starts its local workers (``python -m glm5.engine.worker`` with
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``), waits for every rank (the other
nodes' workers come from ``glm5 worker``), and every rank loads only its shard. A worker that exits makes the
next (or the running) step raise :class:`ExecutorError`; workers watch their parent and exit when it is gone;
:meth:`DistributedRunner.shutdown` stops them (terminate, then kill), so no process outlives the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from glm5.cache.hybrid_cache import CacheConfig
from glm5.cache.snapshot_pool import StateSnapshotPool
from glm5.config import ModelConfig
from glm5.distributed import ParallelConfig, ParallelContext
from glm5.distributed.parallel_state import (abort_process_groups, build_context, destroy_parallel_context,
                                            join_world)
from glm5.distributed.sharding import WeightSharding
from glm5.engine.cuda_graph import DecodeRows
from glm5.engine.errors import EngineDeadError
from glm5.engine.model_runner import ModelRunner, PackedStep
from glm5.engine.scheduler import SchedulerOutput
from glm5.engine.worker_processes import LocalWorkers, cpu_threads, free_port  # noqa: F401 (re-exported)
from glm5.engine.sequence import Sequence
from glm5.layers.batch import ForwardBatch
from glm5.layers.glm5 import ModelOutput

logger = logging.getLogger(__name__)

SETUP_KEY = "glm5/setup"
READY_PREFIX = "glm5/ready/"
#: How long the driver waits for every rank to reach the rendezvous (workers import torch and load their shard).
STARTUP_TIMEOUT_S = float(os.environ.get("GLM5_STARTUP_TIMEOUT_S", "600"))


class ExecutorError(EngineDeadError):
    """The distributed executor cannot run the model any more: a worker died or failed, or the process group
    broke. Unrecoverable for this engine — an :class:`~glm5.engine.errors.EngineDeadError`, so the engine does
    not retry the step's requests, fails those in flight, and the server goes down for its supervisor to restart
    it. Raised from every engine call that needs the workers, with the worker's exit code and the tail of its log
    when it is known."""


@dataclass
class WorkerSetup:
    """What every worker needs to build its shard (published by the driver in the rendezvous store)."""

    engine_args: dict[str, Any]
    parallel: ParallelConfig
    cache: CacheConfig
    max_model_len: int
    device_type: str            # "cuda" or "cpu"
    device_base: int            # CUDA: local rank r uses cuda:{device_base + r}
    dtype: str


def rank_device(setup: WorkerSetup, local_rank: int) -> torch.device:
    if setup.device_type == "cuda":
        return torch.device("cuda", setup.device_base + local_rank)
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# building a rank
# ---------------------------------------------------------------------------------------------------------------
def build_rank_runner(setup: WorkerSetup, cfg: ModelConfig, par: ParallelContext, device: torch.device,
                      runner_cls: type[ModelRunner] = ModelRunner, **runner_kw: Any) -> ModelRunner:
    """Load this rank's shard (only its slices are read) and build its model runner."""
    from glm5.engine.args import EngineArgs
    from glm5.weights import load_weights

    args = EngineArgs(**setup.engine_args)
    dtype = getattr(torch, setup.dtype)
    sharding = WeightSharding(cfg, par.config, par.ranks)
    t0 = time.perf_counter()
    quant = args.load_quantization
    if args.load_format == "dummy":
        from glm5.weights import dummy_weights
        weights = dummy_weights(cfg, device, dtype, seed=0, include_mtp=args.num_speculative_tokens > 0,
                                sharding=sharding, fp8=quant == "fp8")
    else:
        weights = load_weights(args.model, cfg, device=device, dtype=dtype, progress=args.load_progress,
                               allow_missing_mtp=args.num_speculative_tokens == 0, quantization=quant,
                               sharding=sharding)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    runner = runner_cls(cfg, weights, setup.cache, device, dtype, use_mtp=args.num_speculative_tokens > 0,
                        index_fp8=args.index_cache == "fp8", max_model_len=setup.max_model_len,
                        decode_path=args.decode_path, par=par, **runner_kw)
    runner.load_seconds = load_s
    runner.init_seconds = time.perf_counter() - t0
    return runner


def gather_status(par: ParallelContext, value: Any) -> list[Any]:
    """Every rank's ``value`` (a load outcome, ``None`` = ready; a per-rank call's result) on every rank, in rank
    order, over the control group."""
    import torch.distributed as dist
    out: list[Any] = [None] * par.ranks.world_size
    dist.all_gather_object(out, value, group=par.control_group)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the driver's runner
# ---------------------------------------------------------------------------------------------------------------
class DistributedRunner(ModelRunner):
    """Rank 0's :class:`ModelRunner`: every call that touches the model first sends the same operation to the
    workers (one broadcast per step; queued cache operations travel with it), then runs it on its own shard.
    Same interface as :class:`ModelRunner`, so :class:`~glm5.engine.llm_engine.LLMEngine` drives it unchanged."""

    def __init__(self, *args: Any, workers: LocalWorkers | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.workers = workers
        self._pending: list[tuple] = []
        self._shared_pools: dict | None = None
        self._failure: ExecutorError | None = None
        self._closed = False
        self._steps = 0
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, args: Any, cfg: ModelConfig, cache_cfg: CacheConfig, max_model_len: int,
              encoder_cache_bytes: int = 64 * 2**20) -> "DistributedRunner":
        """Host the rendezvous, start this node's workers, join, load rank 0's shard, wait for every rank."""
        import torch.distributed as dist

        pc: ParallelConfig = args.parallel_config
        pc.check_model(cfg.text)
        world, nproc = pc.world_size, pc.world_size // args.nnodes
        device, dtype = args.torch_device, args.torch_dtype
        setup = WorkerSetup(engine_args=dataclasses.asdict(args), parallel=pc, cache=cache_cfg,
                            max_model_len=max_model_len, device_type=device.type,
                            device_base=(device.index or 0) if device.type == "cuda" else 0,
                            dtype=str(dtype).removeprefix("torch."))
        device = rank_device(setup, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif "OMP_NUM_THREADS" not in os.environ and nproc > 1:
            # ranks on one CPU share its cores: each at its share, or their spin-waiting threads fight (the
            # workers take the same share, see cpu_threads)
            torch.set_num_threads(cpu_threads(nproc))
            logger.info("CPU ranks: %d torch threads per rank", torch.get_num_threads())
        addr = args.master_addr
        port = args.master_port or free_port(addr)
        if addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore(addr, port, world, is_master=True, wait_for_workers=False,
                              timeout=_timedelta(STARTUP_TIMEOUT_S))
        store.set(SETUP_KEY, pickle.dumps(setup))
        workers = LocalWorkers(list(range(1, nproc)), list(range(1, nproc)), world, addr, port).start() \
            if nproc > 1 else None
        try:
            _wait_for_ranks(store, world, workers, addr, port)
            backend, control = join_world(0, world, device, store)
            par = build_context(pc, 0, backend, control)
        except BaseException:
            if workers is not None:
                workers.stop()
            raise
        error = None
        runner = None
        try:
            runner = build_rank_runner(setup, cfg, par, device, runner_cls=cls, workers=workers,
                                       encoder_cache_bytes=encoder_cache_bytes)
        except Exception as e:  # reported with the workers' outcomes below
            error = f"{type(e).__name__}: {e}"
            logger.exception("rank 0 failed to load its shard")
        try:
            status = gather_status(par, error)
        except Exception as e:  # a worker died while loading: its exit code and log say why
            dead = workers.dead() if workers is not None else None
            status = [None] * world
            status[dead[0] if dead else 1] = (f"exited with code {dead[2]} while loading; last lines of its log:\n"
                                              f"{workers.log_tail(dead[0])}" if dead else f"{type(e).__name__}: {e}")
        failed = [(r, s) for r, s in enumerate(status) if s is not None]
        if failed:
            destroy_parallel_context(par)
            if workers is not None:
                workers.stop()
            raise ExecutorError("the distributed engine failed to start: " + "; ".join(
                f"rank {r}: {s}" for r, s in failed))
        assert runner is not None
        runner._start_watchdog()
        runner._finalizer = weakref.finalize(runner, _emergency_stop, workers)
        logger.info("distributed engine up: %d ranks (TP=%d, EP=%d, %s)%s", world, pc.tensor_parallel_size,
                    pc.expert_parallel_size, backend, f", worker logs in {workers.log_dir}" if workers else "")
        return runner

    # ------------------------------------------------------------------ failure handling
    def _start_watchdog(self) -> None:
        if self.workers is None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="glm5-executor-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            dead = self.workers.dead()
            if dead is not None and not self._closed:
                self._failure = self._worker_error(*dead)
                logger.error("%s", self._failure)
                abort_process_groups()  # unblock a collective waiting on the dead rank (NCCL)
                self.workers.stop(timeout=5.0)  # the others cannot continue without it
                return

    def _worker_error(self, rank: int, pid: int, code: int) -> ExecutorError:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = self.workers.log_tail(rank) if self.workers is not None else ""
        return ExecutorError(f"worker rank {rank} (pid {pid}) {how}; the engine cannot continue and must be "
                             f"restarted" + (f". Last lines of its log {self.workers.log_path(rank)}:\n{tail}"
                                             if tail else ""))

    @property
    def failure(self) -> ExecutorError | None:
        """Why the executor can no longer run the model (``None`` while it can): set by the watchdog as soon as a
        worker exits, so a health check can report the engine as not ready before the next step fails."""
        return self._failure

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ExecutorError("the distributed engine was shut down")

    def _fail(self, exc: BaseException) -> ExecutorError:
        """The error to raise for ``exc`` seen in a step: the worker's death when that explains it."""
        if isinstance(exc, ExecutorError):
            return exc
        deadline = time.monotonic() + 2.0
        while self._failure is None and self.workers is not None and time.monotonic() < deadline:
            dead = self.workers.dead()  # the collective can fail before the watchdog's next look
            if dead is not None:
                self._failure = self._worker_error(*dead)
                break
            time.sleep(0.05)
        if self._failure is None:
            self._failure = ExecutorError(f"a collective of the distributed engine failed: {type(exc).__name__}: "
                                          f"{exc}; the engine cannot continue and must be restarted")
        return self._failure

    def _dispatch(self, op: tuple, tensor: torch.Tensor | None = None) -> None:
        """Send the queued operations and ``op`` to every worker (and ``tensor`` after it, over the device group),
        then apply the queued ones here, in the same order the workers do."""
        self._check()
        ops, self._pending = self._pending + [op], []
        try:
            self.par.broadcast_object(ops)
            if tensor is not None:
                self.par.broadcast(tensor)
            for pending in ops[:-1]:
                self._apply_local(pending)
        except Exception as e:
            raise self._fail(e) from e

    def _apply_local(self, op: tuple) -> None:
        if op[0] == "reset_slot":
            ModelRunner.reset_slot(self, op[1])
        elif op[0] == "snapshot_move":
            StateSnapshotPool.move(self.snapshot_pool, *op[2:])
        elif op[0] == "rebalance":
            ModelRunner.rebalance_experts(self)
        else:
            raise AssertionError(f"not a queued operation: {op[0]}")

    def queue(self, op: tuple) -> None:
        """A cache mutation for every rank: applied here and on the workers, in order, before the next step."""
        self._pending.append(op)

    # the prefix cache's mutations (slot resets, snapshot copies) replayed on every rank
    snapshot_pool: StateSnapshotPool | None = None

    def kv_cache_view(self) -> "MirroredCache":
        return MirroredCache(self)

    @property
    def snapshot_pool_cls(self) -> type[StateSnapshotPool]:
        return MirroredSnapshotPool

    def _guard(self, fn, *a: Any) -> Any:
        """Run rank 0's side of an operation the workers are running too. Any failure here is fatal for the
        executor: the workers are inside the same collectives, and there is no way to bring them back in step
        (so request-level isolation does not apply to a distributed step; docs/parallelism.md)."""
        try:
            return fn(*a)
        except ExecutorError:
            raise
        except Exception as e:
            if self._failure is None and not _is_comm_error(e):
                self._failure = ExecutorError(
                    f"rank 0 failed inside a distributed step ({type(e).__name__}: {e}); the other ranks cannot be "
                    "brought back in step, so the engine stops and must be restarted")
                if self.workers is not None:
                    self.workers.stop(timeout=5.0)
            raise self._fail(e) from e

    # ------------------------------------------------------------------ the ModelRunner interface
    def reset_slot(self, slot: int) -> None:
        self.queue(("reset_slot", slot))

    def execute(self, sched: SchedulerOutput, mtp_rows: bool = True
                ) -> tuple[ForwardBatch, ModelOutput, list[tuple[int, int, int]]]:
        rows = self._decode_rows(sched) if self.batched_decode else None
        if rows is not None:
            self._dispatch(("decode", rows))
            out = self._guard(self._execute_decode, sched, rows, mtp_rows)
        else:
            step, sample_idx = self.pack(sched)
            self._dispatch(("forward", step))
            batch, model_out = self._guard(self.forward_packed, step)
            out = (batch, model_out, sample_idx)
        self._steps += 1
        pc = self.par.config
        if pc.enable_eplb and self._steps % pc.eplb_step_interval == 0:
            self._pending.append(("rebalance",))
        return out

    def commit_accepted(self, batch: ForwardBatch, state_slot: int, valid_rows: int) -> None:
        self._dispatch(("commit_accepted", state_slot, valid_rows))
        super().commit_accepted(batch, state_slot, valid_rows)

    def mtp_forward(self, entries: list[tuple[Sequence, int, list[int]]], hidden: torch.Tensor,
                    want_logits: list[bool], shared_pools: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.pack_mtp(entries, want_logits)
        if shared_pools is None:
            mode = None
        elif shared_pools is self._shared_pools:
            mode = "same"
        else:
            mode, self._shared_pools = "new", shared_pools
        hidden = hidden.contiguous()
        self._dispatch(("mtp", step, mode, tuple(hidden.shape), str(hidden.dtype).removeprefix("torch.")), hidden)
        return self._guard(self.mtp_forward_packed, step, hidden, shared_pools)

    def snapshot_mtp_tails(self, slots: list[int]) -> torch.Tensor:
        self._dispatch(("snapshot_mtp_tails", list(slots)))
        return super().snapshot_mtp_tails(slots)

    def restore_mtp_tails(self, slots: list[int], snapshot: torch.Tensor) -> None:
        self._dispatch(("restore_mtp_tails", list(slots)))
        super().restore_mtp_tails(slots, snapshot)

    def capture_cuda_graphs(self, max_batch: int | None = None) -> str | None:
        self._dispatch(("capture", max_batch))
        return self._guard(super().capture_cuda_graphs, max_batch)

    def rebalance_experts(self):
        """Rebalance now (all ranks); the periodic trigger queues the same operation every
        ``eplb_step_interval`` steps."""
        self._dispatch(("rebalance",))
        return self._guard(super().rebalance_experts)

    def run_decode_step(self, rows: DecodeRows) -> tuple[ForwardBatch, ModelOutput]:
        self._dispatch(("decode", rows))
        return self._guard(self.forward_decode, rows)

    def run_packed(self, step: PackedStep) -> tuple[ForwardBatch, ModelOutput]:
        self._dispatch(("forward", step))
        return self._guard(self.forward_packed, step)

    def call_all(self, name: str, *args: Any) -> list:
        """Run a per-rank method (:attr:`ModelRunner.RANK_CALLS`) on every rank; results gathered in rank order."""
        if name not in self.RANK_CALLS:
            raise ValueError(f"{name!r} is not a per-rank call; choose one of {sorted(self.RANK_CALLS)}")
        self._dispatch(("call", name, args))
        mine = self._guard(getattr(self, name), *args)
        return self._guard(gather_status, self.par, mine)

    def worker_pids(self) -> list[int]:
        return self.workers.pids() if self.workers is not None else []

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._failure is None:
            try:
                self.par.broadcast_object([("shutdown",)])
            except Exception:  # noqa: BLE001 (a broken group: the workers are stopped below anyway)
                logger.warning("could not send shutdown to the workers", exc_info=True)
        if self.workers is not None:
            self.workers.stop()
        destroy_parallel_context(self.par)
        if self._finalizer is not None:
            self._finalizer.detach()


class MirroredCache:
    """The driver's cache as the KV-cache manager sees it: reads pass through to rank 0's cache; a slot reset is
    queued for every rank (:meth:`DistributedRunner.queue`)."""

    def __init__(self, runner: DistributedRunner):
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner.cache, name)

    def reset_slot(self, slot: int) -> None:
        self.runner.reset_slot(slot)


class MirroredSnapshotPool(StateSnapshotPool):
    """The prefix cache's snapshot pool on the driver: bookkeeping here, every data copy queued for every rank
    (each rank keeps a pool of the same capacity over its own heads' states; workers make theirs on first use)."""

    def __init__(self, cache: MirroredCache, num_snapshots: int):
        super().__init__(cache, num_snapshots)
        self.runner = cache.runner
        self.runner.snapshot_pool = self

    def move(self, i: int, state_slot: int, partial_block: int | None, rows: int, to_snapshot: bool) -> None:
        self.runner.queue(("snapshot_move", self.capacity, i, state_slot, partial_block, rows, to_snapshot))


def _is_comm_error(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, RuntimeError) and any(w in text for w in ("gloo", "nccl", "connection", "peer", "c10d",
                                                                    "process group", "timed out", "abort"))


def _emergency_stop(workers: LocalWorkers | None) -> None:
    """At interpreter exit / garbage collection of an engine that was never shut down: no orphans."""
    if workers is not None:
        workers.stop(timeout=2.0)


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def _wait_for_ranks(store: Any, world: int, workers: LocalWorkers | None, addr: str, port: int) -> None:
    """Wait until every rank announced itself in the store; fail fast when a local worker dies first."""
    keys = [f"{READY_PREFIX}{r}" for r in range(1, world)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while keys:
        keys = [k for k in keys if not store.check([k])]
        if not keys:
            return
        dead = workers.dead() if workers is not None else None
        if dead is not None:
            rank, pid, code = dead
            raise ExecutorError(f"worker rank {rank} (pid {pid}) exited with code {code} during startup. Last lines "
                                f"of its log {workers.log_path(rank)}:\n{workers.log_tail(rank)}")
        if time.monotonic() > deadline:
            missing = [int(k.rsplit("/", 1)[1]) for k in keys]
            raise ExecutorError(f"ranks {missing} did not join within {STARTUP_TIMEOUT_S:.0f} s; ranks on other "
                                f"machines come from `glm5 worker --master-addr {addr} --master-port {port} ...` "
                                "(docs/parallelism.md)")
        time.sleep(0.05)


__all__ = ["DistributedRunner", "ExecutorError", "WorkerSetup", "build_rank_runner", "rank_device"]
