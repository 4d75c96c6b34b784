"""mHC (manifold-constrained hyper-connections): the residual stream is ``hc_mult`` streams.

Each block site (attention, FFN) computes from the flattened, weight-less-RMS-normalised streams
three token-dependent mixings: ``pre`` collapses the streams into the block input, ``post`` spreads
the block output back, ``comb`` (Sinkhorn-projected to doubly stochastic, column normalisation
first) mixes the old streams — applied *transposed*: ``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]``.
All mapping math is fp32 (model-spec §7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5.config import TextConfig
from glm5.layers.norms import unweighted_rms_norm


@dataclass
class HyperMix:
    post: torch.Tensor  # [T, n] fp32
    comb: torch.Tensor  # [T, n, n] fp32


class HyperConnection:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig):
        self.fn = weights[f"{prefix}_fn"].float()
        self.base = weights[f"{prefix}_base"].float()
        self.scale = weights[f"{prefix}_scale"].float()
        self.n = cfg.hc_mult
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.iters = cfg.hc_sinkhorn_iters

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, HyperMix]:
        """streams [T, n, H] -> (collapsed block input [T, H], mixing for :meth:`post`)."""
        n = self.n
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, HyperMix(post=post, comb=comb)

    @staticmethod
    def post(block_out: torch.Tensor, streams: torch.Tensor, mix: HyperMix) -> torch.Tensor:
        dtype = streams.dtype
        return mix.post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            mix.comb.to(dtype).transpose(-1, -2), streams
        )
