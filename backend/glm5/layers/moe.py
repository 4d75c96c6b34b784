"""Mixture of experts: sigmoid router with a selection-only bias, grouped top-k, routed + shared.

Routing (model-spec §6, :mod:`glm5_kernels.router_ref`): scores = sigmoid(x·Wᵀ) in fp32; the correction
bias is added only to pick experts; group scores are the sum of the top-2 biased scores per group and only
``topk_group`` groups stay eligible; the kept weights are the *unbiased* scores, renormalised, times
``routed_scaling_factor``. The shared expert is added unscaled. On CUDA in bf16 the whole router is two
Triton launches (:mod:`glm5_kernels.router`: the GEMM, then the selection); the torch path keeps the fp32 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.config import TextConfig
from glm5.distributed import ParallelContext
from glm5.distributed.eplb import ExpertMap, initial_placement
from glm5.layers.backends import moe_backend, router_backend
from glm5.layers.mlp import DenseMLP
from glm5.layers.overlap import Branch, StreamOverlap
from glm5_kernels.fp8_ref import SCALE_SUFFIX
from glm5_kernels.moe_ref import fused_moe_ref
from glm5_kernels.router_ref import route_ref


class RouterWorkspace:
    """Lazy handle on :class:`glm5_kernels.router.RouterWorkspace` (the Triton import waits for first use)."""

    def __init__(self) -> None:
        self._ws = None

    def semaphores(self, n: int, device: torch.device) -> torch.Tensor:
        if self._ws is None:
            from glm5_kernels.router import RouterWorkspace as _Workspace
            self._ws = _Workspace()
        return self._ws.semaphores(n, device)


@dataclass
class RoutingResult:
    weights: torch.Tensor  # [T, top_k] fp32
    experts: torch.Tensor  # [T, top_k] int64


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, cfg: TextConfig,
          gate_w_model: torch.Tensor | None = None, workspace: "RouterWorkspace | None" = None) -> RoutingResult:
    """Route ``x [T, H]``: the fused Triton router (:mod:`glm5_kernels.router`, bf16 GEMM with fp32
    accumulation, then the selection) when :func:`router_backend` picks it and ``gate_w_model`` (the weight in x's
    dtype) and a ``workspace`` are given, else the fp32 torch reference (``gate_w`` fp32). Both break ties
    towards the lower expert id (:mod:`glm5_kernels.router_ref`)."""
    args = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    if (gate_w_model is not None and workspace is not None and gate_w_model.dtype == x.dtype
            and router_backend(x.device, x.dtype) == "triton"):
        from glm5_kernels.router import router_topk
        weights, experts = router_topk(x, gate_w_model, bias, *args, workspace=workspace)
    else:
        weights, experts = route_ref(x, gate_w, bias, *args)
    return RoutingResult(weights=weights, experts=experts)


class MoE:
    """Routed experts (stacked ``[E, I, H]`` weights) plus the shared expert.

    The stacks are either in the model dtype or all three block-scaled fp8 (``float8_e4m3fn`` with
    ``[E, ceil(rows/128), ceil(cols/128)]`` fp32 scales under ``<name>_scale_inv``): the fused kernel then reads
    fp8 and dequantizes in registers, the torch path dequantizes one touched expert at a time.

    Parallel layouts (:mod:`glm5.distributed`): without expert parallelism every rank holds every expert's slice
    of the intermediate dim (like a dense MLP) and its output is a partial sum; with it, a rank holds whole
    experts — its physical experts under EPLB — and computes only the (token, slot) pairs routed to them. Either
    way the shared expert's partial is added to the routed partial before one reduce (with attention replicas the
    shared partial is added on the first replica only, so it is counted once). Dispatch under EP
    (``ep_dispatch``): ``allgather_reducescatter`` — tokens are already on every rank (attention is
    tensor-parallel), each rank runs its experts on the pairs routed to them, and the partials are combined by a
    reduce-scatter over token rows plus an all-gather; ``all2all`` — each rank takes a slice of the tokens, sends
    every pair to the rank owning its expert, gets the weighted results back, and the slices are all-gathered (it
    moves ``k`` rows per token instead of the whole ``[T, H]`` partial; sizes are exchanged on the host, so this
    mode runs eagerly, outside CUDA graphs)."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig,
                 par: ParallelContext | None = None, overlap: StreamOverlap | None = None):
        self.cfg = cfg
        self.par = par = par or ParallelContext.single()
        self.overlap = overlap or StreamOverlap()
        # the torch router runs in fp32: convert once here, not on every step; the Triton router reads the
        # checkpoint's (model dtype) weight with fp32 accumulation
        self.gate_w_model = weights[f"{prefix}.gate.weight"]
        self.gate_w = self.gate_w_model.float()
        self.bias = weights[f"{prefix}.gate.e_score_correction_bias"].float()
        self.w_gate = weights[f"{prefix}.experts.gate_proj"]
        self.w_up = weights[f"{prefix}.experts.up_proj"]
        self.w_down = weights[f"{prefix}.experts.down_proj"]
        scales = [weights.get(f"{prefix}.experts.{n}_proj{SCALE_SUFFIX}") for n in ("gate", "up", "down")]
        if any(s is not None for s in scales) and any(s is None for s in scales):
            raise ValueError(f"{prefix}.experts: gate/up/down must all be fp8 or none (scales present: "
                             f"{[s is not None for s in scales]}); load with quantization=none or fp8")
        self.scales = None if scales[0] is None else tuple(scales)
        self.shared = DenseMLP(weights, f"{prefix}.shared_experts", cfg.swiglu_limit, par, reduce=False) \
            if f"{prefix}.shared_experts.gate_proj.weight" in weights else None
        self.router_workspace = RouterWorkspace()
        self.experts: ExpertMap | None = None
        if par.config.expert_parallel:
            pc = par.config
            p2l = initial_placement(cfg.n_routed_experts, pc.num_redundant_experts)
            self.experts = ExpertMap.build(p2l, cfg.n_routed_experts, par.ep_rank, par.ep_size, self.gate_w.device)
            if self.w_gate.shape[0] != self.experts.per_rank:
                raise ValueError(f"{prefix}: {self.w_gate.shape[0]} local experts loaded, the placement gives this "
                                 f"rank {self.experts.per_rank}; load the weights with the same parallel config")
        self.count_load = par.config.enable_eplb

    def expert_tensors(self) -> list[torch.Tensor]:
        """The per-local-expert tensors (dim 0 = local physical expert) an EPLB rebalance moves."""
        return [self.w_gate, self.w_up, self.w_down] + (list(self.scales) if self.scales is not None else [])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the shared expert does not depend on the routing: at small batch it runs on the side stream beside the
        # router (latency-bound launches) and the routed experts, and is joined just before its sum
        # (glm5.layers.overlap)
        with self.overlap.branch(x) as side:
            shared = self.shared(x) if self.shared is not None else None
        routing = route(x, self.gate_w, self.bias, self.cfg, self.gate_w_model, self.router_workspace)
        if self.experts is None:
            return self.par.tp_all_reduce(self._routed(x, routing.weights, routing.experts, add=shared, side=side))
        phys = self.experts.to_physical(routing.experts, self.count_load)
        if self.par.config.ep_dispatch == "all2all":
            out = self._routed_all2all(x, routing.weights, phys)
            side.join()
            if shared is not None:
                out = out + self.par.tp_all_reduce(shared)
            return out
        out = self._routed(x, routing.weights, phys, self.experts.local_of_physical,
                           add=shared if self.par.ranks.replica == 0 else None, side=side)
        return self.par.ep_reduce_scatter_gather(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                expert_map: torch.Tensor | None = None, add: torch.Tensor | None = None,
                side: Branch | None = None) -> torch.Tensor:
        """This rank's experts on the pairs routed to them (all pairs without an ``expert_map``), plus ``add``
        (the shared expert's partial; the Triton path adds it in the kernel that sums the slots). ``side``: the
        branch computing ``add``, joined before ``add`` is read."""
        join = side.join if side is not None else None
        if moe_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.fused_moe import fused_moe
            return fused_moe(x, self.w_gate, self.w_up, self.w_down, weights, ids, self.cfg.swiglu_limit,
                             scales=self.scales, expert_map=expert_map, add=add, before_add=join)
        out = fused_moe_ref(x, self.w_gate, self.w_up, self.w_down, weights, ids, self.cfg.swiglu_limit,
                            scales=self.scales, expert_map=expert_map)
        if join is not None:
            join()
        return out if add is None else out + add

    def _routed_all2all(self, x: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        """All-to-all dispatch and combine of the routed experts (see the class docstring)."""
        par, per = self.par, self.experts.per_rank
        world, rank = par.ranks.world_size, par.ranks.rank
        t, k = phys.shape
        rows = -(-t // world)
        lo, hi = min(rank * rows, t), min((rank + 1) * rows, t)
        mine_e, mine_w = phys[lo:hi].reshape(-1), weights[lo:hi].reshape(-1)
        token = torch.arange(lo, hi, device=x.device).repeat_interleave(k)
        dest = torch.div(mine_e, per, rounding_mode="floor")
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=world)
        counts = par.ep_all_gather(send)                    # [world, world]: counts[s, d] pairs s sends to d
        send_n, recv_n = counts[rank].tolist(), counts[:, rank].tolist()
        meta = torch.stack([(mine_e - dest * per).float(), mine_w.float()], dim=1)[order]
        recv_x = par.ep_all_to_all(x[token[order]], send_n, recv_n)
        recv_meta = par.ep_all_to_all(meta, send_n, recv_n)
        y = self._routed(recv_x, recv_meta[:, 1:2], recv_meta[:, 0:1].long())
        back = par.ep_all_to_all(y, recv_n, send_n)
        part = torch.zeros(rows, x.shape[1], dtype=torch.float32, device=x.device)
        part.index_add_(0, token[order] - lo, back.float())
        return par.ep_all_gather(part.to(x.dtype)).reshape(world * rows, -1)[:t]


@dataclass
class RebalanceReport:
    """What one EPLB rebalance did (identical on every rank)."""

    layers: int
    moved_layers: int
    bytes_received: int           # by this rank
    imbalance_before: float       # max / mean tokens per rank over the MoE layers, at the old placement
    imbalance_after: float        # the same counts at the new placement (replicas share their expert's load)


def _rank_imbalance(logical_load: torch.Tensor, placement: list[int], ranks: int) -> float:
    counts = torch.bincount(torch.tensor(placement), minlength=logical_load.numel()).clamp_min(1).double()
    per_copy = logical_load.double() / counts
    per = len(placement) // ranks
    rank_load = torch.stack([per_copy[torch.tensor(placement[r * per:(r + 1) * per])].sum() for r in range(ranks)])
    mean = float(rank_load.mean())
    return float(rank_load.max()) / mean if mean > 0 else 1.0


def rebalance_experts(layers: list[MoE], par: ParallelContext) -> RebalanceReport:
    """EPLB step over ``layers`` (every rank calls it together, at the same point of the step sequence): from
    each layer's load counters since the last call, a new placement (:func:`glm5.distributed.eplb.rebalance`),
    the expert weights moved to match, the routing maps rewritten in place, the counters reset."""
    from glm5.distributed.eplb import exchange_expert_weights, rebalance

    moved, received, before, after = 0, 0, [], []
    for moe in layers:
        m = moe.experts
        if m is None:
            continue
        n_log = m.logical_to_physical.shape[0]
        load = torch.zeros(n_log, dtype=torch.float64, device=m.load.device)
        load.index_add_(0, m.physical_to_logical, m.load.double())
        load = load.cpu()
        old = m.placement()
        new = rebalance(load.tolist(), old, par.ep_size)
        before.append(_rank_imbalance(load, old, par.ep_size))
        after.append(_rank_imbalance(load, new, par.ep_size))
        if new != old:
            received += exchange_expert_weights(moe.expert_tensors(), old, new, par.ep_rank, par.ep_size,
                                                par.world_group)
            m.set(new)
            moved += 1
        m.load.zero_()
    mean = (lambda xs: sum(xs) / len(xs) if xs else 1.0)
    return RebalanceReport(layers=len(before), moved_layers=moved, bytes_received=received,
                           imbalance_before=mean(before), imbalance_after=mean(after))
