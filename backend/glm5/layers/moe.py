"""Mixture of experts: fp32 sigmoid router with a selection-only bias, grouped top-k, routed + shared.

Routing (model-spec §6): scores = sigmoid(x·Wᵀ) in fp32; the correction bias is added only to pick
experts; group scores are the sum of the top-2 biased scores per group and only ``topk_group``
groups stay eligible; the kept weights are the *unbiased* scores, renormalised, times
``routed_scaling_factor``. The shared expert is added unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5.config import TextConfig
from glm5.layers.backends import moe_backend
from glm5.layers.mlp import DenseMLP
from glm5_kernels.fp8_ref import SCALE_SUFFIX
from glm5_kernels.moe_ref import fused_moe_ref


@dataclass
class RoutingResult:
    weights: torch.Tensor  # [T, top_k] fp32
    experts: torch.Tensor  # [T, top_k] int64


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, cfg: TextConfig) -> RoutingResult:
    logits = F.linear(x.float(), gate_w.float())
    scores = logits.sigmoid()
    choice = scores + bias.float()
    n_tok, n_exp = choice.shape
    if cfg.n_group > 1:
        grouped = choice.view(n_tok, cfg.n_group, n_exp // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(n_exp // cfg.n_group, dim=1), float("-inf"))
    experts = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return RoutingResult(weights=weights * cfg.routed_scaling_factor, experts=experts)


class MoE:
    """Routed experts (stacked ``[E, I, H]`` weights) plus the shared expert.

    The stacks are either in the model dtype or all three block-scaled fp8 (``float8_e4m3fn`` with
    ``[E, ceil(rows/128), ceil(cols/128)]`` fp32 scales under ``<name>_scale_inv``): the fused kernel then reads
    fp8 and dequantizes in registers, the torch path dequantizes one touched expert at a time."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig):
        self.cfg = cfg
        # the router runs in fp32: convert once here, not on every step (5 conversions per decode step)
        self.gate_w = weights[f"{prefix}.gate.weight"].float()
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(x, self.gate_w, self.bias, self.cfg)
        shared = self.shared(x)
        if moe_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.fused_moe import fused_moe
            return fused_moe(x, self.w_gate, self.w_up, self.w_down, routing.weights, routing.experts,
                             self.cfg.swiglu_limit, scales=self.scales) + shared
        return fused_moe_ref(x, self.w_gate, self.w_up, self.w_down, routing.weights, routing.experts,
                             self.cfg.swiglu_limit, scales=self.scales) + shared
