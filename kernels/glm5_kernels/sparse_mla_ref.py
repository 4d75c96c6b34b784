"""Torch references of the sparse NoPE MLA decode (:mod:`glm5_kernels.sparse_mla_decode`, also the torch path)
and prefill (:mod:`glm5_kernels.sparse_mla_prefill`)."""

from __future__ import annotations

import torch


def sparse_mla_decode_ref(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Reference: q_lat [N, H, R], latent [S, R], idx [N, K] int (−1 = unused) → [N, H, R] fp32 (fp64 when the
    inputs are fp64)."""
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    valid = idx >= 0
    rows = latent[idx.clamp(min=0).long()].to(acc)                      # [N, K, R]
    s = torch.einsum("nhr,nkr->nhk", q_lat.to(acc), rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("nhk,nkr->nhr", p, rows)


def sparse_mla_prefill_ref(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor,
                           scale: float, rows_per_chunk: int = 64) -> torch.Tensor:
    """Reference of :func:`~glm5_kernels.sparse_mla_prefill.sparse_mla_prefill`: row ``n`` attends to
    ``latent[idx[n, j]]`` for ``j < counts[n]`` (``-1`` entries skipped) → ``[N, H, R]`` fp32 (fp64 inputs stay
    fp64). Rows go in chunks so the gathered ``[rows, W, R]`` block stays small at prefill sizes."""
    n = q_lat.shape[0]
    out = torch.empty(q_lat.shape, device=q_lat.device,
                      dtype=torch.float64 if q_lat.dtype == torch.float64 else torch.float32)
    cols = torch.arange(idx.shape[1], device=idx.device)
    for lo in range(0, n, rows_per_chunk):
        hi = min(n, lo + rows_per_chunk)
        part = torch.where(cols[None, :] < counts[lo:hi, None].long(), idx[lo:hi].long(), -1)
        out[lo:hi] = sparse_mla_decode_ref(q_lat[lo:hi], latent, part, scale)
    return out


__all__ = ["sparse_mla_decode_ref", "sparse_mla_prefill_ref"]
