"""RMSNorm and the KDA gated output norm in one launch each. Torch references: :mod:`glm5_kernels.norms_ref`.

The references are chains of 8 (``rms_norm``) and 12 (``gated_rms_norm``) elementwise / reduction kernels;
at decode each is a few µs of launch-bound work, several times per layer. These kernels do the same math in
one pass over a row and round where the references round: ``rms_norm`` casts the normalised row to the
activation dtype *before* the weight multiply (the reference's order; a fp32 multiply changes bf16
results), ``gated_rms_norm`` stays in fp32 until the single final cast. ``rsqrt`` and ``exp`` are libdevice's
(CUDA's ``rsqrtf`` / ``expf``, what torch's kernels call) and the sigmoid divides with correct rounding; the
only difference left is the order of the mean's fp32 additions (a bf16 result can differ by one ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from glm5_kernels.device import interpreting
from glm5_kernels.kpool import _rne_bf16
from glm5_kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.rsqrt(x)
    return 1.0 / tl.sqrt(x)


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    if PRECISE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.div_rn(tl.zeros_like(x) + 1.0, 1.0 + e)


@triton.jit
def _round_to(x, like_ptr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to the element type of ``like_ptr`` (returned as fp32): bf16 by explicit
    round-to-nearest-even bit arithmetic (the interpreter's own cast truncates), other dtypes by a cast."""
    if BF16:
        return _rne_bf16(x)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, M, N, inv_n, eps, stride_x, stride_o,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr, X_BF16: tl.constexpr,
                     O_BF16: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = _rsqrt(tl.sum(xf * xf, 1) * inv_n + eps, PRECISE)                      # torch's mean: sum × (1/N)
    y = _round_to(xf * r[:, None], x_ptr, X_BF16)            # the reference casts back first
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = _round_to(w[None, :] * y, out_ptr, O_BF16)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, M, inv_d, eps, stride_x, stride_g, stride_o,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISE: tl.constexpr, O_BF16: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    mask = (rows < M)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    xf = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gf = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    r = _rsqrt(tl.sum(xf * xf, 1) * inv_d + eps, PRECISE)
    y = _round_to(w[None, :] * (xf * r[:, None]) * _sigmoid(gf, PRECISE), out_ptr, O_BF16)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last]`` view with a unit last stride (a copy only when no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused :func:`glm5_kernels.norms_ref.rms_norm`: ``weight * (x / rms(x)).to(x.dtype)`` over the last dim,
    result in ``promote(weight.dtype, x.dtype)``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != [{n}] (the last dim of x {tuple(x.shape)})")
    x2 = _rows(x)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    m = x2.shape[0]
    if m:
        block_n = triton.next_power_of_2(n)
        block_m = max(1, min(16, 2048 // block_n))
        _rms_norm_kernel[(triton.cdiv(m, block_m),)](
            x2, weight, out, m, n, 1.0 / n, eps, x2.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
            PRECISE=not interpreting(), X_BF16=x.dtype == torch.bfloat16, O_BF16=out.dtype == torch.bfloat16,
            num_warps=8 if block_n >= 4096 else 4, **pdl_kwargs(x2.device))
    return out.view(*x.shape[:-1], n)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused :func:`glm5_kernels.norms_ref.gated_rms_norm` (KDA output norm): fp32 RMSNorm × weight ×
    ``sigmoid(gate)``, cast to ``x.dtype`` once. ``x`` and ``gate`` share a shape (heads as rows: ``[..., d]``)."""
    d = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"be [{d}]")
    if d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two for the fused norm; use norms_ref.gated_rms_norm")
    x2, g2 = _rows(x), _rows(gate)
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    m = x2.shape[0]
    if m:
        block_m = max(1, min(64, 4096 // d))
        _gated_rms_norm_kernel[(triton.cdiv(m, block_m),)](
            x2, g2, weight, out, m, 1.0 / d, eps, x2.stride(0), g2.stride(0), out.stride(0), D=d, BLOCK_M=block_m,
            PRECISE=not interpreting(), O_BF16=out.dtype == torch.bfloat16, num_warps=4,
            **pdl_kwargs(x2.device))
    return out.view(x.shape)


__all__ = ["rms_norm", "gated_rms_norm"]
