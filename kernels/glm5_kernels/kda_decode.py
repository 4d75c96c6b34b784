"""The KDA decode conv step in one launch. Torch reference: :func:`glm5_kernels.kda_decode_ref.kda_conv_step_ref`.

Per row (one request's new token) and channel: read the slot's last ``K-1`` inputs, form the causal depthwise
conv with the new input, apply SiLU, shift the new input into the slot's state — and write q, k and v as three
contiguous ``[N, D]`` tensors, the layout fla's recurrent kernel reads (the torch path's
``index_select``/``cat``/``index_copy_``/multiply/sum/SiLU plus three ``.contiguous()`` copies: 9 launches).
The row's β logits can ride along (``extra``): a strided slice of the fused input projection copied to a
contiguous tensor in the same launch. Rounding as the reference: each product and the 4-term sum (in order)
rounded to the activation dtype, the SiLU computed in fp32.

Rows that share a slot (the padding rows of a CUDA-graph batch all point at the scratch slot) race on that
slot's state; only the scratch slot is ever shared, and its contents are never read by a request.
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
def _conv_step_kernel(mixed_ptr, state_ptr, slot_ptr, w_ptr, out_ptr, esrc_ptr, edst_ptr,
                      C, D, E, stride_m, stride_ss, stride_sk, stride_w, stride_os, stride_on, stride_es, stride_ed,
                      K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, HAS_EXTRA: tl.constexpr,
                      PRECISE: tl.constexpr, BF16: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    st = state_ptr + slot * stride_ss + cols
    x = tl.load(mixed_ptr + n * stride_m + cols, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K - 1):
        s_j = tl.load(st + j * stride_sk, mask=mask, other=0.0).to(mixed_ptr.dtype.element_ty)
        w_j = tl.load(w_ptr + cols * stride_w + j, mask=mask, other=0.0).to(mixed_ptr.dtype.element_ty)
        acc += _round_to(s_j.to(tl.float32) * w_j.to(tl.float32), mixed_ptr, BF16)
        if j > 0:
            tl.store(st + (j - 1) * stride_sk, s_j.to(state_ptr.dtype.element_ty), mask=mask)   # shift left
    w_last = tl.load(w_ptr + cols * stride_w + (K - 1), mask=mask, other=0.0).to(mixed_ptr.dtype.element_ty)
    acc += _round_to(x.to(tl.float32) * w_last.to(tl.float32), mixed_ptr, BF16)
    tl.store(st + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=mask)
    a = _round_to(acc, mixed_ptr, BF16)
    if PRECISE:
        e = libdevice.exp(-a)
    else:
        e = tl.exp(-a)
    y = _round_to(tl.div_rn(a, 1.0 + e), mixed_ptr, BF16)
    tl.store(out_ptr + (cols // D) * stride_os + n * stride_on + cols % D, y.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_EXTRA:
        if cb == 0:
            ec = tl.arange(0, BLOCK_E)
            ev = tl.load(esrc_ptr + n * stride_es + ec, mask=ec < E)
            tl.store(edst_ptr + n * stride_ed + ec, ev, mask=ec < E)


def kda_conv_step(mixed: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor,
                  parts: int = 3, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused :func:`~glm5_kernels.kda_decode_ref.kda_conv_step_ref` (same arguments, states updated in place).

    Returns the SiLU output as ``[parts, N, C/parts]`` (q, k, v each contiguous) and, when ``extra [N, E]`` is
    given (any row stride), a contiguous copy of it."""
    n, c = mixed.shape
    k1 = conv_state.shape[1]
    if conv_state.shape[2] != c or conv_w.shape != (c, k1 + 1) or slots.shape != (n,):
        raise ValueError(f"mixed {tuple(mixed.shape)}, conv_state {tuple(conv_state.shape)}, conv_w "
                         f"{tuple(conv_w.shape)}, slots {tuple(slots.shape)}: need [N, C], [S, K-1, C], [C, K], [N]")
    if c % parts:
        raise ValueError(f"{c} channels do not split into {parts} equal parts")
    if mixed.stride(-1) != 1 or conv_state.stride(-1) != 1 or conv_w.stride(-1) != 1:
        raise ValueError("mixed, conv_state and conv_w need a unit last stride")
    d = c // parts
    out = torch.empty(parts, n, d, device=mixed.device, dtype=mixed.dtype)
    extra_out = None
    if extra is not None:
        if extra.dim() != 2 or extra.shape[0] != n or extra.stride(-1) != 1:
            raise ValueError(f"extra must be [{n}, E] with a unit last stride, got {tuple(extra.shape)}")
        extra_out = torch.empty(extra.shape, device=extra.device, dtype=extra.dtype)
    if n == 0:
        return out, extra_out
    block = min(1024, triton.next_power_of_2(c))
    e = extra.shape[1] if extra is not None else 1
    _conv_step_kernel[(n, triton.cdiv(c, block))](
        mixed, conv_state, slots, conv_w, out, extra if extra is not None else mixed,
        extra_out if extra_out is not None else out, c, d, e, mixed.stride(0), conv_state.stride(0),
        conv_state.stride(1), conv_w.stride(0), out.stride(0), out.stride(1),
        extra.stride(0) if extra is not None else 0, extra_out.stride(0) if extra_out is not None else 0,
        K=k1 + 1, BLOCK=block, BLOCK_E=triton.next_power_of_2(e), HAS_EXTRA=extra is not None,
        PRECISE=not interpreting(), BF16=mixed.dtype == torch.bfloat16, num_warps=4, **pdl_kwargs(mixed.device))
    return out, extra_out


__all__ = ["kda_conv_step"]
