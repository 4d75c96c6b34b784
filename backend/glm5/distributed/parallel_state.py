"""The parallel layout, one rank's place in it, and the collectives the network calls.

Layout (vLLM's names). ``tensor_parallel_size`` (TP) ranks split the attention heads (MLA, KDA, indexer), the
dense MLPs, the shared experts and the vocabulary. Routed experts are either split the same way along their
intermediate dimension (no expert parallelism) or, with expert parallelism, partitioned whole over
``expert_parallel_size`` (EP) ranks. The world is ``max(TP, EP)`` ranks; when EP > TP the attention/dense part is
replicated ``EP / TP`` times ("attention replicas": every replica runs the same step on the same tokens), which is
how "EP alone" (TP = 1, EP = N) works. World rank ``w`` is TP rank ``w % TP`` of replica ``w // TP`` and EP rank
``w``.

:class:`ParallelContext` owns the process groups of one rank and is what the layers call: ``tp_all_reduce`` after a
row-parallel projection, ``tp_all_gather`` for the vocab-parallel logits, the EP dispatch/combine collectives. A
context without groups (:meth:`ParallelContext.single`) makes every collective the identity, so single-device code
pays nothing. A group of one rank is the identity as well (as vLLM's collectives are): at world size 1 the model
is built and run through the distributed path (process groups, sharded layers, the executor), but neither a
one-rank NCCL collective, which moves nothing, nor the driver's per-step message to no worker is launched.
Launched anyway they made the bench config's batch-1 decode step 1.2-1.4x slower on the H200, most of it the
pickled step message on gloo (``bench/bench.py --distributed`` measures both ways: ``collectives_at_size_one=True``
launches them).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

EP_DISPATCH_CHOICES = ("allgather_reducescatter", "all2all")
#: Workers wait for the driver's next step inside a broadcast on the control group: an idle server must not time out.
CONTROL_TIMEOUT = datetime.timedelta(days=30)
#: A collective of the model's step that waits this long means a peer hung (a dead peer fails at once).
DEVICE_TIMEOUT = datetime.timedelta(minutes=10)


class ParallelConfigError(ValueError):
    """A parallel layout that cannot split this model; the message names the value and the fix."""


@dataclass(frozen=True)
class ParallelConfig:
    """How one model copy is spread over ranks (see the module docstring)."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1        # 1: experts split by intermediate dim over TP; else = world size
    enable_eplb: bool = False
    num_redundant_experts: int = 0       # EPLB: extra physical copies of hot experts (per MoE layer)
    eplb_step_interval: int = 1000       # engine steps between rebalances
    ep_dispatch: str = "allgather_reducescatter"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name}={v!r}: must be an integer >= 1")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if ep > 1 and ep % tp != 0:
            raise ParallelConfigError(
                f"expert_parallel_size={ep} must be a multiple of tensor_parallel_size={tp} (the world is max(TP, EP) "
                f"ranks, each TP group a replica of the attention); use expert_parallel_size={tp * max(1, ep // tp)}")
        if self.ep_dispatch not in EP_DISPATCH_CHOICES:
            raise ParallelConfigError(f"ep_dispatch={self.ep_dispatch!r}: choose one of {', '.join(EP_DISPATCH_CHOICES)}")
        if self.num_redundant_experts < 0:
            raise ParallelConfigError(f"num_redundant_experts={self.num_redundant_experts}: must be >= 0")
        if (self.enable_eplb or self.num_redundant_experts) and ep == 1:
            raise ParallelConfigError("enable_eplb / num_redundant_experts need expert parallelism: add "
                                      "--enable-expert-parallel (or --expert-parallel-size N)")
        if self.eplb_step_interval < 1:
            raise ParallelConfigError(f"eplb_step_interval={self.eplb_step_interval}: must be >= 1")

    @classmethod
    def from_args(cls, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                  expert_parallel_size: int | None = None, **kw: Any) -> "ParallelConfig":
        """vLLM's flags: ``--enable-expert-parallel`` partitions the experts over the TP ranks (EP = TP);
        ``expert_parallel_size`` sets EP explicitly (a multiple of TP; implies expert parallelism)."""
        ep = expert_parallel_size if expert_parallel_size else (tensor_parallel_size if enable_expert_parallel else 1)
        return cls(tensor_parallel_size=tensor_parallel_size, expert_parallel_size=ep, **kw)

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def expert_parallel(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def attention_replicas(self) -> int:
        return self.world_size // self.tensor_parallel_size

    def num_physical_experts(self, n_routed_experts: int) -> int:
        return n_routed_experts + self.num_redundant_experts

    def check_model(self, cfg: Any) -> None:
        """Raise :class:`ParallelConfigError` if ``cfg`` (a :class:`~glm5.config.TextConfig`) cannot be split so."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        splits = [("num_attention_heads", cfg.num_attention_heads), ("linear_attn_config.num_heads", cfg.linear_num_heads),
                  ("index_n_heads", cfg.index_n_heads), ("intermediate_size", cfg.intermediate_size),
                  ("shared expert intermediate (moe_intermediate_size * n_shared_experts)",
                   cfg.moe_intermediate_size * cfg.n_shared_experts)]
        if not self.expert_parallel:
            splits.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for name, value in splits:
            if value % tp:
                divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                raise ParallelConfigError(f"tensor_parallel_size={tp} does not divide {name}={value}; use one of "
                                          f"{divisors}")
        if self.expert_parallel:
            phys = self.num_physical_experts(cfg.n_routed_experts)
            if phys % ep:
                raise ParallelConfigError(
                    f"expert_parallel_size={ep} does not divide the {phys} physical experts (n_routed_experts="
                    f"{cfg.n_routed_experts} + num_redundant_experts={self.num_redundant_experts}); choose "
                    f"num_redundant_experts so that the sum is a multiple of {ep}")


@dataclass(frozen=True)
class Ranks:
    """One rank's coordinates in a :class:`ParallelConfig`."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    replica: int

    @classmethod
    def of(cls, rank: int, pc: ParallelConfig) -> "Ranks":
        if not 0 <= rank < pc.world_size:
            raise ParallelConfigError(f"rank {rank} outside the world of {pc.world_size} ranks")
        tp = pc.tensor_parallel_size
        ep_rank, ep_size = (rank, pc.expert_parallel_size) if pc.expert_parallel else (0, 1)
        return cls(rank=rank, world_size=pc.world_size, tp_rank=rank % tp, tp_size=tp, ep_rank=ep_rank,
                   ep_size=ep_size, replica=rank // tp)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def _single(name: str) -> Any:
    import torch.distributed as dist
    # torch 2.13 renamed the tensor collectives; older releases (the GPU machine) only have the old names
    new = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}[name]
    old = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[name]
    return getattr(dist, new, None) or getattr(dist, old)


@dataclass
class ParallelContext:
    """The process groups of one rank and the collectives over them (identity when there are none)."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    ranks: Ranks = field(default_factory=lambda: Ranks.of(0, ParallelConfig()))
    world_group: Any = None     # device backend (nccl / gloo) over every rank: EP collectives, broadcasts
    tp_group: Any = None        # device backend over this rank's TP group
    control_group: Any = None   # gloo over every rank: the driver's step messages (pickled objects)
    backend: str = "none"
    collectives_at_size_one: bool = False   # launch collectives over one-rank groups too (bench: their cost)
    collective_calls: int = 0                # collectives launched (counted on the host)

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls()

    @property
    def distributed(self) -> bool:
        return self.world_group is not None

    def _launch(self, group: Any, size: int) -> bool:
        """Whether a collective over ``group`` (of ``size`` ranks) runs (module docstring: one-rank groups)."""
        if group is None or (size == 1 and not self.collectives_at_size_one):
            return False
        self.collective_calls += 1
        return True

    @property
    def tp_size(self) -> int:
        return self.ranks.tp_size

    @property
    def tp_rank(self) -> int:
        return self.ranks.tp_rank

    @property
    def ep_size(self) -> int:
        return self.ranks.ep_size

    @property
    def ep_rank(self) -> int:
        return self.ranks.ep_rank

    # ------------------------------------------------------------------ tensor parallel
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group, in place (the reduce after a row-parallel projection)."""
        if not self._launch(self.tp_group, self.tp_size):
            return x
        import torch.distributed as dist
        dist.all_reduce(x, group=self.tp_group)
        return x

    def tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every TP rank's ``x [N, C]`` along the last dim → ``[N, tp * C]`` (rank order)."""
        if not self._launch(self.tp_group, self.tp_size):
            return x
        n = self.tp_size
        x = x.contiguous()
        out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _single("all_gather")(out, x, group=self.tp_group)
        return out.view((n,) + tuple(x.shape)).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])

    # ------------------------------------------------------------------ expert parallel (world group)
    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self._launch(self.world_group, self.ranks.world_size):
            return x
        import torch.distributed as dist
        dist.all_reduce(x, group=self.world_group)
        return x

    def ep_reduce_scatter_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x [T, H]`` over the world as a reduce-scatter over token rows then an all-gather of the summed
        rows (the combine of the all-gather + reduce-scatter dispatch; same result as an all-reduce)."""
        if not self._launch(self.world_group, self.ranks.world_size):
            return x
        n = self.ranks.world_size
        t = x.shape[0]
        pad = (-t) % n
        src = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
        part = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
        _single("reduce_scatter")(part, src, group=self.world_group)
        out = torch.empty_like(src)
        _single("all_gather")(out, part, group=self.world_group)
        return out[:t]

    def ep_all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank r; returns the rows received, in rank order."""
        import torch.distributed as dist
        if not self._launch(self.world_group, self.ranks.world_size):
            return x.contiguous()
        out = torch.empty((sum(recv_counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.world_group)
        return out

    def ep_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Stack every rank's ``x`` → ``[world, *x.shape]``."""
        if not self._launch(self.world_group, self.ranks.world_size):
            return x.unsqueeze(0)
        n = self.ranks.world_size
        out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _single("all_gather")(out, x.contiguous(), group=self.world_group)
        return out.view((n,) + tuple(x.shape))

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast a tensor from ``src`` over the world (device backend), in place."""
        if not self._launch(self.world_group, self.ranks.world_size):
            return x
        import torch.distributed as dist
        dist.broadcast(x, src=src, group=self.world_group)
        return x

    # ------------------------------------------------------------------ control messages
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (picklable) to every rank; every rank returns it (workers block here for the
        driver's next step). A world of one has nobody to send to (module docstring)."""
        if not self._launch(self.control_group, self.ranks.world_size):
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def barrier(self) -> None:
        if self._launch(self.control_group, self.ranks.world_size):
            import torch.distributed as dist
            dist.barrier(group=self.control_group)


def join_world(rank: int, world_size: int, device: torch.device, store: Any,
               device_timeout: datetime.timedelta = DEVICE_TIMEOUT) -> tuple[str, Any]:
    """Join the world through ``store`` (a ``torch.distributed`` store every rank reaches: the driver hosts a
    ``TCPStore`` at MASTER_ADDR:MASTER_PORT, the env:// rendezvous torchrun also uses). Returns the device
    backend (``nccl`` on CUDA, ``gloo`` on CPU) and the gloo control group. Every rank calls this, then
    :func:`build_context` with the same :class:`ParallelConfig`.

    One distributed engine per process: torch.distributed's default group is per process."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one distributed engine per "
                           "process (shut the other engine down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("rank %d/%d joining the %s group", rank, world_size, backend)
    kw: dict[str, Any] = {}
    if backend == "nccl":
        kw["device_id"] = device  # eager communicator init on this device (no device guessing)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=device_timeout, **kw)
    return backend, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def build_context(pc: ParallelConfig, rank: int, backend: str, control: Any,
                  device_timeout: datetime.timedelta = DEVICE_TIMEOUT) -> ParallelContext:
    """The rank's :class:`ParallelContext`: the world group, its TP group (created by every rank for every
    replica, in the same order), the control group."""
    import torch.distributed as dist

    world, tp = pc.world_size, pc.tensor_parallel_size
    if dist.get_world_size() != world:
        raise ParallelConfigError(f"the process group has {dist.get_world_size()} ranks but the parallel config needs "
                                  f"{world} (max(TP={tp}, EP={pc.expert_parallel_size}))")
    tp_group = dist.group.WORLD if tp == world else None
    if tp != world:
        for r in range(pc.attention_replicas):
            g = dist.new_group(list(range(r * tp, (r + 1) * tp)), timeout=device_timeout)
            if r == rank // tp:
                tp_group = g
    return ParallelContext(config=pc, ranks=Ranks.of(rank, pc), world_group=dist.group.WORLD, tp_group=tp_group,
                           control_group=control, backend=backend)


def abort_process_groups() -> None:
    """Make collectives blocked on a dead peer return with an error (NCCL would otherwise wait for its timeout;
    gloo already fails on the closed connection). Called from the driver's watchdog thread."""
    import torch.distributed as dist
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return
    try:
        abort()
    except Exception:  # noqa: BLE001 (best effort: the engine is failing anyway)
        logger.warning("aborting the process groups failed", exc_info=True)


def destroy_parallel_context(ctx: ParallelContext) -> None:
    """Leave the groups (safe to call after a peer died)."""
    import torch.distributed as dist
    if ctx.world_group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a dead peer can make the teardown itself fail; the groups are gone anyway)
        logger.warning("destroying the process groups failed", exc_info=True)
    ctx.world_group = ctx.tp_group = ctx.control_group = None
