"""The MoE router in two launches: GEMM (bf16 products, fp32 accumulation), then sigmoid, selection bias,
grouped top-k and renormalisation. Torch reference: :func:`glm5_kernels.router_ref.route_ref`.

Why bf16 with fp32 accumulation is enough: the router's input is the bf16 block input and its weight is a bf16
checkpoint tensor, so ``x.float() @ W.float()ᵀ`` and a tensor-core ``x @ Wᵀ`` multiply the same values exactly;
they differ only in the order of the fp32 additions (~1e-7 relative), which moves an expert in or out of the
top-k only at a near tie (measured in ``bench/kernel_check.py``). The fp32 GEMM read the weight in fp32 (twice
the bytes) and, at prefill, ran on the CUDA cores (2.3 ms of an 8K prefill in the bench profile).

The GEMM, grid ``(expert blocks, K splits, token blocks)``, writes each program's fp32 partial logits
``[BLOCK_T, BLOCK_E]`` to a scratch buffer; at decode (T ≤ 256) K splits put ~70 programs per token block on
the 2.4 MB weight read, at prefill 64-token blocks make it a tiled GEMM. The selection launch, one
token per one-warp program, adds the partials in split order (a deterministic sum) and runs the epilogue:
``sigmoid`` (libdevice ``exp`` and a correctly rounded division: torch's CUDA sigmoid bit for bit), ``+ bias``,
the group filter, ``TOP_K`` rounds of (max, lowest id among equal values), renormalisation, scale.

A fused mode (``config={"fused": True}``) saves the second launch: each program increments its token block's
semaphore after storing its partial, and the program that arrives last (atomic acquire/release after a CTA
barrier) runs the epilogue for the block's rows and resets the semaphore, so the same buffer serves the next
launch and every CUDA-graph replay. It is slower at every size measured (:func:`default_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from glm5_kernels.device import interpreting
from glm5_kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _select_rows(part_ptr, bias_ptr, wout_ptr, iout_ptr, r0, T, scaling, stride_ps, stride_pt, stride_wo, stride_io,
                 E: tl.constexpr, E_PAD: tl.constexpr, SPLITS: tl.constexpr, EPI_T: tl.constexpr,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, PRECISE: tl.constexpr):
    """Epilogue for rows ``r0 .. r0+EPI_T``: sum the split partials, sigmoid, bias, groups, top-k, weights."""
    erows = r0 + tl.arange(0, EPI_T)
    ermask = erows < T
    ecol = tl.arange(0, E_PAD)
    ecmask = ecol < E
    m2d = ermask[:, None] & ecmask[None, :]
    logit = tl.zeros([EPI_T, E_PAD], tl.float32)
    for s in tl.static_range(SPLITS):
        logit += tl.load(part_ptr + s * stride_ps + erows[:, None] * stride_pt + ecol[None, :], mask=m2d,
                         other=0.0, volatile=True)
    if PRECISE:
        e = libdevice.exp(-logit)
    else:
        e = tl.exp(-logit)
    score = tl.div_rn(tl.full([EPI_T, E_PAD], 1.0, tl.float32), 1.0 + e)
    bias = tl.load(bias_ptr + ecol, mask=ecmask, other=0.0)
    choice = tl.where(ecmask[None, :], score + bias[None, :], float("-inf"))
    if N_GROUP > 1:
        grp = ecol // (E // N_GROUP)
        gar = tl.arange(0, G_PAD)
        gsc = tl.full([EPI_T, G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            cg = tl.where((grp == g)[None, :], choice, float("-inf"))
            m1 = tl.max(cg, 1)
            i1 = tl.min(tl.where(cg == m1[:, None], ecol[None, :], E_PAD), 1)
            m2 = tl.max(tl.where(ecol[None, :] == i1[:, None], float("-inf"), cg), 1)
            gsc = tl.where(gar[None, :] == g, (m1 + m2)[:, None], gsc)
        keep = tl.zeros([EPI_T, G_PAD], tl.int32)
        for j in tl.static_range(TOPK_GROUP):
            gm = tl.max(gsc, 1)
            gi = tl.min(tl.where(gsc == gm[:, None], gar[None, :], G_PAD), 1)
            hit = gar[None, :] == gi[:, None]
            keep = tl.where(hit, 1, keep)
            gsc = tl.where(hit, float("-inf"), gsc)
        ekeep = tl.zeros([EPI_T, E_PAD], tl.int32)
        for g in tl.static_range(N_GROUP):
            kg = tl.sum(tl.where(gar[None, :] == g, keep, 0), 1)                            # [EPI_T]
            ekeep = tl.where((grp[None, :] == g) & (kg[:, None] > 0), 1, ekeep)
        choice = tl.where(ekeep > 0, choice, float("-inf"))
    kar = tl.arange(0, K_PAD)
    wt = tl.zeros([EPI_T, K_PAD], tl.float32)
    it = tl.zeros([EPI_T, K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        m = tl.max(choice, 1)
        i = tl.min(tl.where(choice == m[:, None], ecol[None, :], E_PAD), 1)
        sel = ecol[None, :] == i[:, None]
        wj = tl.sum(tl.where(sel, score, 0.0), 1)
        wt = tl.where(kar[None, :] == j, wj[:, None], wt)
        it = tl.where(kar[None, :] == j, i.to(tl.int64)[:, None], it)
        choice = tl.where(sel, float("-inf"), choice)
    if RENORM:
        den = tl.sum(wt, 1) + 1e-20
        wt = tl.div_rn(wt, den[:, None] + tl.zeros([EPI_T, K_PAD], tl.float32))
    wt = wt * scaling
    omask = ermask[:, None] & (kar[None, :] < TOP_K)
    tl.store(wout_ptr + erows[:, None] * stride_wo + kar[None, :], wt, mask=omask)
    tl.store(iout_ptr + erows[:, None] * stride_io + kar[None, :], it, mask=omask)


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, sem_ptr, wout_ptr, iout_ptr,
                   T, HID, k_per_split, scaling,
                   stride_x, stride_w, stride_ps, stride_pt, stride_wo, stride_io,
                   E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, EPI_T: tl.constexpr,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr, PRECISE: tl.constexpr, FUSED: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    """Partial logits of one (expert block, K split, token block); with ``FUSED`` the last program of a token
    block to arrive also runs that block's epilogue."""
    pdl_enter(USE_PDL)
    eb = tl.program_id(0)
    ks = tl.program_id(1)
    tb = tl.program_id(2)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    k_lo = ks * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, HID)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + kk[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE or UPCAST:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    tl.store(part_ptr + ks * stride_ps + rows[:, None] * stride_pt + cols[None, :], acc,
             mask=rmask[:, None] & cmask[None, :])
    if FUSED:
        tl.debug_barrier()                  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(sem_ptr + tb, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) * SPLITS - 1:
            tl.atomic_xchg(sem_ptr + tb, 0, sem="relaxed", scope="gpu")     # ready for the next launch
            for r0 in range(tb * BLOCK_T, tl.minimum(tb * BLOCK_T + BLOCK_T, T), EPI_T):
                _select_rows(part_ptr, bias_ptr, wout_ptr, iout_ptr, r0, T, scaling, stride_ps, stride_pt,
                             stride_wo, stride_io, E, E_PAD, SPLITS, EPI_T, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP,
                             RENORM, PRECISE)


@triton.jit
def _router_select_kernel(part_ptr, bias_ptr, wout_ptr, iout_ptr, T, scaling, stride_ps, stride_pt, stride_wo,
                          stride_io, E: tl.constexpr, E_PAD: tl.constexpr, SPLITS: tl.constexpr,
                          EPI_T: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                          G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr,
                          PRECISE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The epilogue as its own launch, ``EPI_T`` rows per program: every token's selection runs in parallel
    (and with few warps its reductions stay inside one warp) instead of one program per token block walking
    its rows in turn."""
    pdl_enter(USE_PDL)
    _select_rows(part_ptr, bias_ptr, wout_ptr, iout_ptr, tl.program_id(0) * EPI_T, T, scaling, stride_ps,
                 stride_pt, stride_wo, stride_io, E, E_PAD, SPLITS, EPI_T, TOP_K, K_PAD, N_GROUP, G_PAD,
                 TOPK_GROUP, RENORM, PRECISE)


class RouterWorkspace:
    """The router's token-block semaphores (int32, zero between launches: the kernel resets them).

    Owned by the caller (one per MoE layer). A larger launch gets a new, larger buffer; the old ones stay
    referenced because a captured CUDA graph keeps using the buffer it was captured with."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def semaphores(self, n: int, device: torch.device) -> torch.Tensor:
        cur = self._buffers[-1] if self._buffers else None
        if cur is None or cur.numel() < n or cur.device != device:
            cur = torch.zeros(max(n, 64, 2 * (cur.numel() if cur is not None else 0)), dtype=torch.int32,
                              device=device)
            self._buffers.append(cur)
        return cur


def default_config(t: int, hidden: int) -> dict:
    """Launch configuration for ``t`` tokens. GEMM: ``BLOCK_T x BLOCK_E`` tiles, ``SPLITS`` K splits, ``num_warps``.
    Selection: ``fused`` (the last GEMM program of each token block walks the block's rows, ``EPI_T`` at a time,
    with the GEMM's warps) or a second launch of ``EPI_T`` rows per program on ``epi_warps`` warps.

    Measured on the H200 (``bench/kernel_bench.py --router``, CUDA-graph replay, 288 experts x 4096): the
    separate launch with one row per one-warp program wins at every size (13.9 vs 16.2 µs at T = 1, 14.5 vs
    36.7 at T = 64, 34.9 vs 136 at T = 256, 53 vs 173 at T = 4096): the fused epilogue runs a token block's
    rows one after another in a single program, and with four warps each of its ~25 row reductions per
    expert choice crosses warps through shared memory. GEMM tiles (same run, separate selection): the K-split
    16 x 32 tiles up to T = 256 (18.6 µs there against 35.0 with 64 x 64 tiles and no split, which leave 20
    programs on 132 SMs), 64 x 64 with a split of 2 to T = 2048 (26.0 against 37.3 µs at T = 1024), no split
    beyond (52.8 µs at T = 4096)."""
    if t <= 256:   # decode / verification rows: split K so the weight read is spread over ~70 programs per block
        gemm = dict(BLOCK_T=16, BLOCK_E=32, BLOCK_K=64, SPLITS=max(1, min(8, hidden // 512)), num_warps=4)
    else:          # prefill: 64 x 64 tiles, a K split of 2 until the token blocks alone fill the GPU
        gemm = dict(BLOCK_T=64, BLOCK_E=64, BLOCK_K=64, SPLITS=2 if t <= 2048 else 1, num_warps=4)
    return {**gemm, "fused": False, "EPI_T": 1, "epi_warps": 1}


def router_topk(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                topk_group: int, renormalize: bool, scaling: float, workspace: RouterWorkspace,
                logits_out: torch.Tensor | None = None,
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``x [T, H]`` with ``gate_w [E, H]`` (same dtype as x: bf16/fp16, or fp32 with IEEE products)
    and the fp32 selection ``bias [E]`` → (weights ``[T, top_k]`` fp32, expert ids ``[T, top_k]`` int64), the
    values :func:`~glm5_kernels.router_ref.select_experts_ref` computes from this kernel's logits (same ties:
    lower expert / group id first; experts in descending biased-score order). Two launches (one with the
    fused epilogue), no host sync.
    ``logits_out`` (tests): a ``[T, E]`` fp32 tensor that receives the logits (one more copy). ``config``
    overrides keys of :func:`default_config` (benchmarks, tests)."""
    if x.dim() != 2 or gate_w.dim() != 2 or gate_w.shape[1] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and gate_w {tuple(gate_w.shape)} must be [T, H] and [E, H]")
    if gate_w.dtype != x.dtype:
        raise ValueError(f"gate_w dtype {gate_w.dtype} != x dtype {x.dtype}; keep the router weight in the model "
                         "dtype for this kernel")
    t, hidden = x.shape
    e = gate_w.shape[0]
    if bias.shape != (e,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != [{e}]")
    if not 1 <= top_k <= e or n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"top_k={top_k}, n_group={n_group}, topk_group={topk_group} do not fit {e} experts")
    if n_group > 1 and e // n_group < 2:
        raise ValueError(f"{e} experts in {n_group} groups: a group score needs at least 2 experts per group")
    dev = x.device
    weights = torch.empty(t, top_k, device=dev, dtype=torch.float32)
    ids = torch.empty(t, top_k, device=dev, dtype=torch.int64)
    if t == 0:
        return weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_w = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    bias = bias.float().contiguous()
    shape = {**default_config(t, hidden), **(config or {})}
    epi = {key: shape.pop(key) for key in ("fused", "EPI_T", "epi_warps")}
    splits = shape.pop("SPLITS")
    k_per_split = shape["BLOCK_K"] * triton.cdiv(triton.cdiv(hidden, splits), shape["BLOCK_K"])
    splits = triton.cdiv(hidden, k_per_split)
    t_blocks = triton.cdiv(t, shape["BLOCK_T"])
    part = torch.empty(splits, t, e, device=dev, dtype=torch.float32)
    sem = workspace.semaphores(t_blocks, dev) if epi["fused"] else part   # unread without the fused epilogue
    num_warps = shape.pop("num_warps")
    grid = (triton.cdiv(e, shape["BLOCK_E"]), splits, t_blocks)
    select = dict(E=e, E_PAD=triton.next_power_of_2(e), SPLITS=splits, EPI_T=epi["EPI_T"], TOP_K=top_k,
                  K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
                  TOPK_GROUP=topk_group, RENORM=bool(renormalize), PRECISE=not interpreting())
    _router_kernel[grid](
        x, gate_w, bias, part, sem, weights, ids, t, hidden, k_per_split, float(scaling),
        x.stride(0), gate_w.stride(0), part.stride(0), part.stride(1), weights.stride(0), ids.stride(0),
        IEEE=x.dtype == torch.float32, UPCAST=interpreting() and x.dtype != torch.float32, FUSED=epi["fused"],
        num_warps=num_warps, **select, **shape, **pdl_kwargs(x.device))
    if not epi["fused"]:
        _router_select_kernel[(triton.cdiv(t, epi["EPI_T"]),)](
            part, bias, weights, ids, t, float(scaling), part.stride(0), part.stride(1), weights.stride(0),
            ids.stride(0), num_warps=epi["epi_warps"], **select, **pdl_kwargs(part.device))
    if logits_out is not None:   # the kernel's sum: the splits added in order
        acc = part[0].clone()
        for i in range(1, splits):
            acc += part[i]
        logits_out.copy_(acc)
    return weights, ids


__all__ = ["RouterWorkspace", "router_topk"]
