"""The blocks' normalisations and activation, each a fused Triton launch or its torch reference.

:func:`glm5.layers.backends.fuse_backend` picks per call from the tensor's device and dtype (``auto``: the
kernels of :mod:`glm5_kernels.norms` / :mod:`glm5_kernels.swiglu` for bf16 on CUDA; the references of
:mod:`glm5_kernels.norms_ref` / :mod:`glm5_kernels.moe_ref` everywhere else, fp32 included, whose rounding the
oracle tests pin). The kernels round where the references round, so the choice changes launch counts (8 and
12 kernels become one), not results beyond an occasional last bf16 bit.
"""

from __future__ import annotations

import torch

from glm5.layers.backends import fuse_backend
from glm5_kernels import norms_ref
from glm5_kernels.moe_ref import clamped_swiglu_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`glm5_kernels.norms_ref.rms_norm`."""
    if fuse_backend(x.device, x.dtype) == "triton":
        from glm5_kernels.norms import rms_norm as fused
        return fused(x, weight, eps)
    return norms_ref.rms_norm(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`glm5_kernels.norms_ref.gated_rms_norm` (the KDA output norm)."""
    if fuse_backend(x.device, x.dtype) == "triton":
        from glm5_kernels.norms import gated_rms_norm as fused
        return fused(x, gate, weight, eps)
    return norms_ref.gated_rms_norm(x, gate, weight, eps)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`glm5_kernels.moe_ref.clamped_swiglu_ref`."""
    if fuse_backend(gate.device, gate.dtype) == "triton":
        from glm5_kernels.swiglu import clamped_swiglu as fused
        return fused(gate, up, limit)
    return clamped_swiglu_ref(gate, up, limit)


__all__ = ["clamped_swiglu", "gated_rms_norm", "rms_norm"]
