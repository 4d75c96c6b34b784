"""Clamped SwiGLU feed-forward (dense layers, shared experts, routed experts, vision MLP).

GLM-5.3-Flash clamps the gate from above and the up projection on both sides with
``swiglu_limit`` everywhere a SwiGLU appears; forgetting the clamp is invisible on small
activations and wrong on large ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_mlp(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    limit: float,
    gate_b: torch.Tensor | None = None,
    up_b: torch.Tensor | None = None,
    down_b: torch.Tensor | None = None,
) -> torch.Tensor:
    h = clamped_swiglu(F.linear(x, gate_w, gate_b), F.linear(x, up_w, up_b), limit)
    return F.linear(h, down_w, down_b)


class DenseMLP:
    """Dense MLP of the first ``first_k_dense_replace`` layers (weights ``mlp.{gate,up,down}_proj``)."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, limit: float):
        self.gate = weights[f"{prefix}.gate_proj.weight"]
        self.up = weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate, self.up, self.down, self.limit)
