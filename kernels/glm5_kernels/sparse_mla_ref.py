"""Torch reference of the sparse NoPE MLA decode (:mod:`glm5_kernels.sparse_mla_decode`), also the torch path."""

from __future__ import annotations

import torch


def sparse_mla_decode_ref(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Reference: q_lat [N, H, R], latent [S, R], idx [N, K] int (−1 = unused) → [N, H, R] fp32."""
    valid = idx >= 0
    rows = latent[idx.clamp(min=0).long()].float()                      # [N, K, R]
    s = torch.einsum("nhr,nkr->nhk", q_lat.float(), rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("nhk,nkr->nhr", p, rows)


__all__ = ["sparse_mla_decode_ref"]
