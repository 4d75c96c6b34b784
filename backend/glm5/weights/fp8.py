"""Block-scaled fp8 copies of a canonical weights dict (online quantization outside the loader).

:func:`quantize_weights` is what ``quantization="fp8"`` does at load, applied to tensors already in memory:
the benchmark quantizes its random weights with it, and tests build fp8 checkpoints from the tiny
checkpoint's weights with it (then :func:`glm5.weights.save_weights` writes the fp8 tensors and their
``weight_scale_inv`` scales under the published key names).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glm5.weights.names import SCALE_SUFFIX, is_fp8_linear_weight
from glm5_kernels.fp8_ref import FP8_DTYPE, block_scale_shape, quantize_fp8_block


def quantize_weights(weights: dict[str, torch.Tensor], select: Callable[[str], bool] = is_fp8_linear_weight,
                     inplace: bool = False) -> dict[str, torch.Tensor]:
    """A dict where every tensor ``select`` picks is float8_e4m3fn with fp32 128 x 128 block scales under
    ``<name>_scale_inv`` (stacked experts: ``[E, ...]`` scales); the others are the same tensor objects.
    Tensors already fp8 (a scale beside them) are left as they are. ``inplace`` replaces the tensors of
    ``weights`` itself one at a time, so peak memory is the model-dtype weights plus one fp8 copy of the
    largest tensor (the bench quantizes a 70 GB bf16 stack that way), and returns ``weights``."""
    out: dict[str, torch.Tensor] = weights if inplace else {}
    for name in list(weights):
        t = weights[name]
        if name.endswith(SCALE_SUFFIX) or name + SCALE_SUFFIX in weights or not select(name):
            out[name] = t
            continue
        out[name], out[name + SCALE_SUFFIX] = quantize_tensor(t)
        del t
    return out


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight as float8_e4m3fn and its fp32 128 x 128 block scales; a stacked ``[E, ...]`` expert tensor a
    few experts at a time (the fp32 temporaries of all 288 would be ~20 GB)."""
    if t.dim() != 3:
        return quantize_fp8_block(t)
    q = torch.empty(t.shape, dtype=FP8_DTYPE, device=t.device)
    s = torch.empty(block_scale_shape(t.shape), dtype=torch.float32, device=t.device)
    for lo in range(0, t.shape[0], 16):
        q[lo:lo + 16], s[lo:lo + 16] = quantize_fp8_block(t[lo:lo + 16])
    return q, s


def weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors of ``weights`` occupy (fp8 weights count one byte per value, plus their scales)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


__all__ = ["quantize_tensor", "quantize_weights", "weight_bytes"]
