"""Torch reference of mHC (manifold-constrained hyper-connections), also the engine's torch path.

The residual stream is ``n = hc_mult`` streams. Each block site (attention, FFN) computes from the flattened,
weight-less-RMS-normalised streams three token-dependent mixings: ``pre`` collapses the streams into the block
input, ``post`` spreads the block output back, ``comb`` (Sinkhorn-projected to doubly stochastic, column
normalisation first) mixes the old streams — applied *transposed*: ``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]``.
All mapping math is fp32 (model-spec §7). :mod:`glm5_kernels.mhc` fuses the same math into two launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5_kernels.norms_ref import rms_norm, unweighted_rms_norm


def mhc_pre_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
                eps: float, norm_eps: float, iters: int, block_norm_w: torch.Tensor | None = None,
                block_norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams ``[T, n, H]`` → (block input ``[T, H]``, post ``[T, n]`` fp32, comb ``[T, n, n]`` fp32).

    ``fn [n(n+2), nH]``, ``base [n(n+2)]``, ``scale [3]`` fp32. With ``block_norm_w`` the block input is also
    passed through the decoder layer's weighted RMSNorm (what the fused kernel does in the same pass)."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    mix = F.linear(flat, fn)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    if block_norm_w is not None:
        if block_norm_eps is None:
            raise ValueError("block_norm_w given without block_norm_eps; pass the layer's rms_norm_eps")
        x = rms_norm(x, block_norm_w, block_norm_eps)
    return x, post, comb


def mhc_post_ref(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
    """``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]`` → ``[T, n, H]``; post/comb cast to the stream dtype first."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)


__all__ = ["mhc_post_ref", "mhc_pre_ref"]
