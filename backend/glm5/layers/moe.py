"""Mixture of experts: sigmoid router with a selection-only bias, grouped top-k, routed + shared.

Routing (model-spec §6, :mod:`glm5_kernels.router_ref`): scores = sigmoid(x·Wᵀ) in fp32; the correction
bias is added only to pick experts; group scores are the sum of the top-2 biased scores per group and only
``topk_group`` groups stay eligible; the kept weights are the *unbiased* scores, renormalised, times
``routed_scaling_factor``. The shared expert is added unscaled. On CUDA in bf16 the whole router is one
Triton launch (:mod:`glm5_kernels.router`); the torch path keeps the fp32 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.config import TextConfig
from glm5.layers.backends import moe_backend, router_backend
from glm5.layers.mlp import DenseMLP
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
    accumulation, one launch) when :func:`router_backend` picks it and ``gate_w_model`` (the weight in x's
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
    fp8 and dequantizes in registers, the torch path dequantizes one touched expert at a time."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig):
        self.cfg = cfg
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
        self.shared = DenseMLP(weights, f"{prefix}.shared_experts", cfg.swiglu_limit)
        self.router_workspace = RouterWorkspace()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(x, self.gate_w, self.bias, self.cfg, self.gate_w_model, self.router_workspace)
        shared = self.shared(x)
        if moe_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.fused_moe import fused_moe
            return fused_moe(x, self.w_gate, self.w_up, self.w_down, routing.weights, routing.experts,
                             self.cfg.swiglu_limit, scales=self.scales) + shared
        return fused_moe_ref(x, self.w_gate, self.w_up, self.w_down, routing.weights, routing.experts,
                             self.cfg.swiglu_limit, scales=self.scales) + shared
