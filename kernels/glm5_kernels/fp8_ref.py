"""Block-scaled fp8 (e4m3) weights and activations: the torch definitions the fp8 kernels are tested against.

Format (DeepSeek-V3 / GLM-5.3-Flash fp8 checkpoints, vLLM's ``block_shape=[128, 128]``): a weight ``W [N, K]`` is
stored as ``W8 = round_e4m3(W / s)`` with one fp32 scale ``s`` per 128 x 128 tile (``weight_scale_inv`` in the
checkpoint, ``[ceil(N/128), ceil(K/128)]``; edge tiles may be partial), so ``W ≈ W8 · s`` tile by tile.
Activations for the fp8 x fp8 GEMMs are quantised the same way per token and per 128-channel group
(``[M, ceil(K/128)]`` scales). ``s = amax(tile) / 448`` (448 is e4m3's largest finite value), so the
largest entry of every tile is representable and the rounding error of each entry is at most half a unit
in its last place: ``|W8·s - W| <= 2^-4 |W|`` for normal values (3 mantissa bits), plus an absolute
``2^-10 · s`` in e4m3's subnormal range (``|W| < 2^-6 · s``).

Two linear references, one per kernel family:

* :func:`fp8_linear_ref` - weight-only (W8A16): dequantise the weight to the activation dtype, then a plain
  ``F.linear``. What the fp8 GEMV and the fp8 fused MoE compute (they dequantise in registers).
* :func:`w8a8_linear_ref` - activations quantised per 1 x 128 group too, both operands dequantised in fp32.
  What ``torch._scaled_mm`` with block scales and the Triton w8a8 GEMM compute.

No Triton import: the engine's CPU path uses these functions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: Checkpoints store a weight's block scales under the weight's name plus this suffix (``x.weight_scale_inv``);
#: the engine's weights dicts keep the same convention (``layers.3.mlp.experts.gate_proj_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
#: Smallest tile absmax used to form a scale: an all-zero tile gets a tiny positive scale instead of 0
#: (so ``W8 = 0`` and dequantisation gives exact zeros, never NaN).
MIN_AMAX = 1e-12


def block_scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, ...]:
    """Shape of the block scales of a ``[..., N, K]`` weight: one per (partial) ``block`` tile of the last two dims."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int,
                        block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The per-element scale ``[..., rows, cols]`` of per-tile ``scale [..., ceil(rows/b0), ceil(cols/b1)]``."""
    s = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` → ``(W8 float8_e4m3fn [..., N, K], scale fp32 [..., ceil(N/b0), ceil(K/b1)])``.

    The scale of each tile is its absmax / 448 (vLLM's online fp8 and the published checkpoints use the same
    rule); dequantising with :func:`dequantize_fp8_block` gives ``w`` within the bound in the module docstring.
    Works on any device; computes in fp32."""
    if w.dim() < 2:
        raise ValueError(f"block quantisation needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    b0, b1 = block
    pn, pk = -n % b0, -k % b1
    wf = w.float()
    if pn or pk:
        wf = F.pad(wf, (0, pk, 0, pn))
    tiles = wf.reshape(*lead, (n + pn) // b0, b0, (k + pk) // b1, b1)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(MIN_AMAX)           # [..., nb, kb]
    scale = amax / torch.full_like(amax, FP8_MAX)   # IEEE division on every device (see the activation one)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, n + pn, k + pk)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W = W8 · s`` tile by tile (fp32 products), returned in ``dtype`` on ``w8``'s device."""
    rows, cols = w8.shape[-2], w8.shape[-1]
    s = expand_block_scales(scale.to(device=w8.device, dtype=torch.float32), rows, cols, block)
    w = w8.to(torch.float32) * s
    return w if dtype == torch.float32 else w.to(dtype)


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → ``(x8 float8_e4m3fn [M, K], scale fp32 [M, ceil(K/group)])``, one scale per token and
    ``group`` channels (absmax / 448). The reference of the Triton activation-quantisation kernel."""
    if x.dim() != 2:
        raise ValueError(f"per-token-group quantisation takes [M, K], got shape {tuple(x.shape)}; flatten first")
    m, k = x.shape
    pad = -k % group
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    g = xf.reshape(m, (k + pad) // group, group)
    amax = g.abs().amax(dim=-1).clamp_min(MIN_AMAX)
    # tensor / tensor: the IEEE-rounded division (on CUDA, dividing by a Python scalar multiplies by its
    # rounded reciprocal, which the H200 check saw 1 ulp off amax / 448 and flip e4m3 codes at ties)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(m, k + pad)[:, :k].contiguous()
    return q, scale.contiguous()


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Weight-only fp8 linear: ``x @ dequant(W8, s)ᵀ (+ b)`` with the weight dequantised to ``x.dtype``.

    Also the engine's CPU path for an fp8 linear (the weight is dequantised on every call: the fp8 storage is
    what is kept, as on the GPU)."""
    return F.linear(x, dequantize_fp8_block(w8, scale, block, x.dtype), bias)


def w8a8_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """fp8 x fp8 linear: ``x`` quantised per token and ``block[1]`` channels (:func:`per_token_group_quant_fp8_ref`),
    both operands dequantised exactly in fp32, fp32 matmul, result in ``x.dtype``."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x8, xs = per_token_group_quant_fp8_ref(x2, block[1])
    xd = x8.float() * xs.repeat_interleave(block[1], dim=1)[:, :k]
    y = xd @ dequantize_fp8_block(w8, scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, w8.shape[0])


def fp8_head_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Per-head weight-only fp8 linear: ``y[n, g] = x[n, g] @ dequant(W8[g], s[g])ᵀ`` for ``x [M, G, K]``,
    ``W8 [G, N, K]``, ``s [G, ceil(N/b0), ceil(K/b1)]`` → ``[M, G, N]`` in ``x.dtype`` (MLA's absorbed
    ``kv_b_proj`` views)."""
    return torch.einsum("mgk,gnk->mgn", x, dequantize_fp8_block(w8, scale, block, x.dtype))


__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "block_scale_shape", "dequantize_fp8_block", "expand_block_scales",
           "fp8_head_linear_ref", "fp8_linear_ref", "per_token_group_quant_fp8_ref", "quantize_fp8_block",
           "w8a8_linear_ref"]
