"""Torch reference of the routed-expert MoE (:mod:`glm5_kernels.fused_moe`) and the clamped SwiGLU.

Also the engine's torch path (CPU): one GEMM pair per touched expert. No Triton import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5_kernels.fp8_ref import BLOCK, dequantize_fp8_block, expand_block_scales, per_token_group_quant_fp8_ref


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM-5.3-Flash SwiGLU: the gate is clamped from above, the up projection on both sides.

    Every SwiGLU of the model (dense, shared and routed experts, vision MLP) clamps with ``swiglu_limit``;
    forgetting it is invisible on small activations and wrong on large ones."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_moe_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, swiglu_limit: float,
                  compute_dtype: torch.dtype | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  expert_map: torch.Tensor | None = None, quant_act: bool = False) -> torch.Tensor:
    """Per-expert loop: ``x [T, H]`` → ``[T, H]`` = Σ_k w_k · W_down[e_k] @ clamped_swiglu(...).

    Computes in ``x.dtype`` (accumulating the k slots in fp32) and returns ``x.dtype`` unless ``compute_dtype``
    is given; then each expert's weights are upcast one at a time (no full fp64 copy of the experts) and the
    result is returned in ``compute_dtype`` — the oracle for kernel tests and the tuner. Syncs with the host
    once per touched expert: the CPU path, not for GPU serving.

    ``scales`` (gate, up, down block scales ``[E, ceil(rows/128), ceil(cols/128)]`` fp32) marks the three stacks
    as block-scaled fp8: each touched expert is dequantised (:func:`glm5_kernels.fp8_ref.dequantize_fp8_block`,
    fp32 products) and cast to the compute dtype, which is what the fp8 kernel path is compared with.
    ``expert_map`` as in :func:`glm5_kernels.fused_moe.fused_moe`: ids → local experts, ``-1`` skipped (a partial
    sum). ``quant_act`` (with ``scales``; the kernels' w8a8 mode): the rows of ``x`` and of the SwiGLU output
    (rounded to ``x.dtype`` first, as the kernel stores it) are quantised per 128-channel group
    (:func:`glm5_kernels.fp8_ref.per_token_group_quant_fp8_ref`) and both GEMMs run in fp32 (or
    ``compute_dtype``) on the exactly dequantised operands."""
    if quant_act and scales is None:
        raise ValueError("quant_act quantises the activations of fp8 experts: pass their scales too")
    dt = compute_dtype or (torch.float32 if quant_act else x.dtype)
    t, h = x.shape
    k = topk_ids.shape[1]
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    out = torch.zeros(t, h, dtype=acc_dt, device=x.device)
    flat_e = topk_ids.reshape(-1)
    if expert_map is not None:
        flat_e = expert_map.index_select(0, flat_e.long())
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)
    flat_w = topk_weights.reshape(-1).to(acc_dt)
    xc = x if quant_act else x.to(dt)

    def act(v: torch.Tensor) -> torch.Tensor:
        if not quant_act:
            return v
        q, sv = per_token_group_quant_fp8_ref(v)
        return (q.to(torch.float64) * expand_block_scales(sv, v.shape[0], v.shape[1], (1, BLOCK))).to(dt)

    def expert(w: torch.Tensor, i: int, e: int) -> torch.Tensor:
        return w[e].to(dt) if scales is None else dequantize_fp8_block(w[e], scales[i][e], dtype=dt)

    for e in torch.unique(flat_e).tolist():
        if e < 0:
            continue
        sel = (flat_e == e).nonzero().squeeze(1)
        toks = token_of[sel]
        xe = act(xc[toks])
        hid = clamped_swiglu_ref(F.linear(xe, expert(w_gate, 0, e)), F.linear(xe, expert(w_up, 1, e)), swiglu_limit)
        if quant_act:
            hid = act(hid.to(x.dtype))
        y = F.linear(hid, expert(w_down, 2, e)).to(acc_dt) * flat_w[sel, None]
        out.index_add_(0, toks, y)
    return out.to(compute_dtype or x.dtype)


def moe_sum_ref(y: torch.Tensor, top_k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T·k, H]`` (token-major slots) → ``[T, H]``: the fp32 sum over each token's slots in slot order, rounded
    to ``y.dtype`` once, then ``+ add`` in that dtype — what :func:`glm5_kernels.fused_moe.moe_sum` computes in one
    launch (and ``y.view(T, k, H).sum(1) + add`` in two, up to the sum's order)."""
    t = y.shape[0] // top_k
    slots = y.view(t, top_k, y.shape[1])
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        acc += slots[:, j].float()
    out = acc.to(y.dtype)
    return out if add is None else out + add


__all__ = ["clamped_swiglu_ref", "fused_moe_ref", "moe_sum_ref"]
