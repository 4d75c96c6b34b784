"""Torch reference of the MoE router (:mod:`glm5_kernels.router`), also the engine's torch path.

Routing (model-spec §6): scores = sigmoid(x·Wᵀ) in fp32; the correction bias is added only to pick experts;
group scores are the sum of the top-2 biased scores per group and only ``topk_group`` groups stay eligible;
the kept weights are the *unbiased* scores, renormalised (``+ 1e-20``), times the routing scale.

Ties are broken towards the lower expert (and group) id — a stable descending sort — so the selection is
defined exactly and the kernel can match it; ``torch.topk``'s order among equal values is unspecified.
Experts come out in descending (biased score, expert id) order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """From fp32 router logits ``[T, E]``: (weights ``[T, top_k]`` fp32, expert ids ``[T, top_k]`` int64)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    n_tok, n_exp = choice.shape
    if n_group > 1:
        grouped = choice.view(n_tok, n_group, n_exp // n_group)
        group_scores = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(n_exp // n_group, dim=1), float("-inf"))
    experts = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def route_ref(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
              renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router GEMM (``x.float() @ gate_w.float()ᵀ``) then :func:`select_experts_ref`."""
    logits = F.linear(x.float(), gate_w.float())
    return select_experts_ref(logits, bias, top_k, n_group, topk_group, renormalize, scaling)


__all__ = ["route_ref", "select_experts_ref"]
