"""The clamped SwiGLU of the dense MLPs and shared experts in one launch. Torch reference:
:func:`glm5_kernels.moe_ref.clamped_swiglu_ref`.

``silu(min(gate, L)) * clamp(up, -L, L)``: the reference is four or five elementwise kernels (two clamps, the
SiLU, the product) per MLP; at decode each is launch-bound. Rounding as torch does it: the SiLU is computed in
fp32 (``x / (1 + exp(-x))`` with libdevice ``exp`` and a correctly rounded division) and rounded to the
activation dtype, then the product of two values of that dtype is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from glm5_kernels.device import interpreting
from glm5_kernels.norms import _round_to
from glm5_kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _clamped_swiglu_kernel(g_ptr, u_ptr, out_ptr, N, limit, stride_g, stride_u, stride_o,
                           BLOCK: tl.constexpr, PRECISE: tl.constexpr, BF16: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.minimum(tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    if PRECISE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = _round_to(tl.div_rn(g, 1.0 + e), out_ptr, BF16)
    tl.store(out_ptr + row * stride_o + cols, _round_to(s * u, out_ptr, BF16).to(
        out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Fused ``clamped_swiglu_ref(gate, up, limit)`` for ``[..., I]`` tensors of one dtype; ``limit=None``: no
    clamp."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} must match")
    n = gate.shape[-1]
    g2, u2 = (t.reshape(-1, n) for t in (gate, up))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _clamped_swiglu_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2, u2, out, n, float("inf") if limit is None else float(limit), g2.stride(0), u2.stride(0),
            out.stride(0), BLOCK=block, PRECISE=not interpreting(), BF16=gate.dtype == torch.bfloat16, num_warps=4,
            **pdl_kwargs(g2.device))
    return out.view(gate.shape)


__all__ = ["clamped_swiglu"]
