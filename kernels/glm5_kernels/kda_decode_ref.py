"""Torch reference of the KDA decode conv step (:mod:`glm5_kernels.kda_decode`), also the engine's torch path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_conv_step_ref(mixed: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                      conv_w: torch.Tensor) -> torch.Tensor:
    """One causal depthwise-conv step for single-token rows: ``mixed [N, C]`` (the new pre-conv q|k|v inputs),
    ``conv_state [S, K-1, C]`` (the last K-1 inputs of each slot, oldest first; row i uses slot ``slots[i]``),
    ``conv_w [C, K]``. Updates the states in place and returns ``silu(Σ_j window_j · w_j)`` ``[N, C]`` in
    ``mixed.dtype`` (products and the sum rounded there, as the layer computes them)."""
    window = torch.cat([conv_state.index_select(0, slots).to(mixed.dtype), mixed.unsqueeze(1)], dim=1)  # [N, K, C]
    conv_state.index_copy_(0, slots, window[:, 1:].to(conv_state.dtype))
    return F.silu((window * conv_w.t().to(mixed.dtype).unsqueeze(0)).sum(dim=1))


__all__ = ["kda_conv_step_ref"]
