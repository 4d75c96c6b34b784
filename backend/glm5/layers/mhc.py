"""mHC (manifold-constrained hyper-connections) at one block site: its weights and the choice of path.

The residual stream is ``hc_mult`` streams; ``pre`` collapses them into the block input (and applies the
decoder layer's RMSNorm), ``post`` spreads the block output back and mixes the old streams. The math lives in
:mod:`glm5_kernels.mhc_ref` (torch, the reference) and :mod:`glm5_kernels.mhc` (two fused Triton launches);
this class picks one by :func:`glm5.layers.backends.mhc_backend`.
"""

from __future__ import annotations

import torch

from glm5.config import TextConfig
from glm5.layers.backends import mhc_backend
from glm5_kernels.mhc_ref import mhc_post_ref, mhc_pre_ref


class HyperConnection:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig):
        self.fn = weights[f"{prefix}_fn"].float()
        # the bf16 prefill projection's split of fn (glm5_kernels.mhc.split_fn_bf16x3, 3 MB per site at H = 4096),
        # made by the first eager bf16 pre of SPLIT3_MIN_ROWS rows or more (a prefill chunk)
        self.fn_split: torch.Tensor | None = None
        self.base = weights[f"{prefix}_base"].float()
        self.scale = weights[f"{prefix}_scale"].float()
        self.n = cfg.hc_mult
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.iters = cfg.hc_sinkhorn_iters

    def pre(self, streams: torch.Tensor, block_norm_w: torch.Tensor,
            block_norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams ``[T, n, H]`` → (RMS-normed block input ``[T, H]``, post ``[T, n]``, comb ``[T, n, n]``)."""
        if mhc_backend(streams.device, streams.dtype) == "triton":
            from glm5_kernels.mhc import mhc_pre
            if self.fn_split is None:
                self.fn_split = self._make_split(streams)
            return mhc_pre(streams, self.fn, self.base, self.scale, self.n, self.eps, self.norm_eps, self.iters,
                           block_norm_w, block_norm_eps, fn_split=self.fn_split)
        return mhc_pre_ref(streams, self.fn, self.base, self.scale, self.n, self.eps, self.norm_eps, self.iters,
                           block_norm_w, block_norm_eps)

    def _make_split(self, streams: torch.Tensor) -> torch.Tensor | None:
        """``fn``'s bf16 split for the prefill projection when ``streams`` will use it (bf16, a prefill chunk's
        rows); None otherwise, and while a graph is captured (its kernels would be recorded, not run)."""
        from glm5_kernels.mhc import SPLIT3_MIN_ROWS, split_fn_bf16x3
        if streams.dtype != torch.bfloat16 or streams.shape[0] < SPLIT3_MIN_ROWS:
            return None
        if streams.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return split_fn_bf16x3(self.fn)

    @staticmethod
    def post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]`` → ``[T, n, H]``."""
        if mhc_backend(streams.device, streams.dtype) == "triton":
            from glm5_kernels.mhc import mhc_post
            return mhc_post(block_out, streams, post, comb)
        return mhc_post_ref(block_out, streams, post, comb)
