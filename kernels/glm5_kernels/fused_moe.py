"""Fused routed-expert MoE (grouped GEMM over sorted token/expert pairs), with its torch reference.

For token ``t`` with routed experts ``e_k`` and fp32 weights ``w_k``::

    out[t] = Σ_k w_k · W_down[e_k] @ clamped_swiglu(W_gate[e_k] @ x_t, W_up[e_k] @ x_t, limit)
    clamped_swiglu(g, u) = silu(min(g, limit)) * clamp(u, -limit, limit)

Design (the structure of vLLM's ``fused_moe``, written for separate gate/up tensors):

1. :func:`moe_align_block_size` (one launch of :mod:`glm5_kernels.moe_align` for decode-sized
   batches, :func:`align_routing`) sorts the ``T*k`` (token, slot) pairs by expert on the device and
   pads each expert's group to a multiple of ``BLOCK_M`` so every ``BLOCK_M`` row block belongs to
   exactly one expert. The row buffer is sized for the worst case from shapes alone, and the real
   padded total stays on the device: kernels read it and surplus programs exit at once. No host
   sync, so the whole forward is CUDA-graph capturable.
2. ``_moe_gate_up_kernel``: per row block, gather the tokens' rows of ``x`` and multiply by the
   expert's gate *and* up tiles (two accumulators sharing the A tile; gate and up stay separate
   tensors because a concatenated copy of ~72 GB of experts does not fit), apply the clamped SwiGLU
   in the epilogue and write ``h[pair]`` in ``x.dtype`` (the reference rounds there too).
3. ``_moe_down_kernel``: ``h[pair] @ W_downᵀ`` times the pair's routing weight, written to
   ``y[pair]`` in (token, slot) order, so step 4 is a plain deterministic sum over the k slots
   (no atomics: same result on every run and on graph replay).
4. ``_moe_sum_kernel``: that sum (fp32, slot order, rounded once, as ``y.sum(dim=1)``), plus an optional
   ``add`` (the shared expert's output) in the same launch: ``round(round(Σ_k y) + add)``, what
   ``y.sum(1) + add`` gives in two launches.

fp32 inputs use ``input_precision="ieee"`` (the fp32 mode is compared token for token with an
oracle); bf16/fp16 use tensor cores with fp32 accumulation.

fp8 experts (``scales=(s_gate, s_up, s_down)``, weights ``float8_e4m3fn`` with fp32 scales per 128 x 128
tile, ``[E, ceil(rows/128), ceil(cols/128)]``): the kernels read one byte per weight and dequantise in
registers (W8A16, the activations stay bf16). A weight tile at most 128 wide in N lies in one scale row,
so its scales are one value per 128 columns of K: they are folded into the activation tile
(``a[:, k] · s[n_blk, k // 128]``) before the ``tl.dot`` on the fp8 values widened to the activation dtype.
fp8 tables are separate files (``..._fp8w_{device}.json``).

fp8 experts with the activations quantised too (w8a8), in two ways, the config's ``A_FP8``:

* ``1``: each gathered ``[BLOCK_M, 128]`` tile of ``x`` (first kernel) or ``h`` (second) becomes e4m3 with one
  scale per row in the kernel, the per-token-group rule of the dense w8a8 paths
  (:func:`glm5_kernels.fp8_linear.quantize_rows`). Every program quantises the tiles it loads, so a row is
  quantised once per N tile: free at decode sizes, 2x the bf16 kernels' time at T = 4096.
* ``2`` (:data:`DEFAULT_A_FP8`): x is quantised once by the dense paths' quantiser and passed as
  :class:`QuantRows`; the gate/up kernel's N tiles are one 128-channel group each, so its epilogue quantises
  its SwiGLU output (rounded to the activation dtype first) and writes h as e4m3 with one scale per row and
  group, which the down kernel loads as it is. A tiles are one byte in shared memory too.

Either way ``tl.dot`` multiplies the e4m3 activation tile with the e4m3 weight tile as loaded and each 128-wide
K step's product is scaled by ``s_x[row] · s_w``; the weight tile never widens, so the kernels stream fp8 weights
as the bf16 kernels stream bf16. Reference: ``fused_moe_ref(..., quant_act=True)`` (both modes).

Launch configs come from a tuning table (``configs/fused_moe_E{E}_H{H}_I{I}_{dtype}_{device}.json``,
written by ``bench/tune_fused_moe.py``), keyed by token count; the nearest entry is used, else
:func:`default_config`.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from glm5_kernels.device import interpreting
from glm5_kernels.fp8_linear import (fp8_dot_acc, group_tile_k, per_token_group_quant_fp8, quantize_rows, swap_ab,
                                     w8a8_acc, w8a8_dot, w8a8_rows)
from glm5_kernels.fp8_ref import FP8_MAX, MIN_AMAX
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on H100/H200
TILE_KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
CONFIG_KEYS = ("BLOCK_SIZE_M",) + TILE_KEYS
#: What a config's ``down`` dict may override: the tiles, and whether the w8a8 dot runs swapped (``SWAP_AB``).
DOWN_KEYS = (*TILE_KEYS, "SWAP_AB")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128


def moe_forward_flops_bytes(t: int, e_touched: int, h: int, i: int, k: int, elem: int) -> tuple[int, int]:
    """(FLOPs, fewest bytes) of one routed-MoE forward: the touched experts' weights once, plus the
    activations (x read, h written + read, per-slot y written + read, output written)."""
    pairs = t * k
    flops = 2 * pairs * 3 * h * i
    weights = e_touched * 3 * h * i * elem
    acts = t * h * elem + 2 * pairs * i * elem + 2 * pairs * h * elem + t * h * elem + pairs * (4 + 8)
    return flops, weights + acts


# ----------------------------------------------------------------------------------------------
# token alignment (device-side, sync-free)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignedRouting:
    """(token, slot) pairs grouped by expert in ``block_m``-row blocks.

    ``sorted_ids[r]`` is the flat pair index ``token * top_k + slot`` of row ``r``, or ``num_pairs``
    for a padding row; ``block_expert[b]`` is the expert of rows ``[b*block_m, (b+1)*block_m)``;
    ``total_rows`` ([1], on the device) is the real padded row count — blocks at or beyond it are
    unused (their ``block_expert`` is clamped to a valid expert but never read)."""

    sorted_ids: torch.Tensor    # [max_rows] int32
    block_expert: torch.Tensor  # [max_rows // block_m] int32
    total_rows: torch.Tensor    # [1] int64
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.sorted_ids.numel() // self.block_m


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded row count: each non-empty expert (at most min(E, pairs) of them) wastes at
    most ``block_m - 1`` rows. Static in the shapes, so grids never depend on routing."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         num_computed_experts: int | None = None) -> AlignedRouting:
    """Sort the pairs of ``topk_ids [T, k]`` by expert (stable: token order within an expert) and pad
    each group to a multiple of ``block_m``; torch ops only, no host sync (graph capturable).

    Expert ids must lie in ``[0, num_experts)`` (not checked: checking would sync). ``num_computed_experts``
    (< ``num_experts``): only experts below it are computed — ``total_rows`` ends after their groups, so the
    kernels skip the pairs of the higher ids (expert parallelism: pairs routed to other ranks' experts)."""
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be positive")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=device, dtype=sorted_e.dtype))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + (block_m - 1)) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    rank = torch.arange(n, device=device) - bounds.index_select(0, sorted_e)
    dest = (pad_end - padded).index_select(0, sorted_e) + rank
    max_rows = max_padded_rows(n, num_experts, block_m)
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    computed = num_experts if num_computed_experts is None else num_computed_experts
    if not 1 <= computed <= num_experts:
        raise ValueError(f"num_computed_experts={num_computed_experts} must be in [1, num_experts={num_experts}]")
    block_starts = torch.arange(0, max_rows, block_m, device=device, dtype=pad_end.dtype)
    block_expert = torch.searchsorted(pad_end, block_starts, right=True).clamp_(max=computed - 1)
    return AlignedRouting(sorted_ids=sorted_ids, block_expert=block_expert.to(torch.int32),
                          total_rows=pad_end[computed - 1:computed],
                          block_m=block_m, num_pairs=n)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """:func:`moe_align_block_size`, in one Triton launch (:mod:`glm5_kernels.moe_align`) when the batch has at
    most ``MAX_PAIRS`` (token, slot) pairs and lives on CUDA (decode); the torch ops otherwise."""
    from glm5_kernels.moe_align import MAX_PAIRS, moe_align_small
    n = topk_ids.numel()
    if n == 0 or n > MAX_PAIRS or not (topk_ids.is_cuda or interpreting()):
        return moe_align_block_size(topk_ids, num_experts, block_m)
    sorted_ids, block_expert, total = moe_align_small(topk_ids, num_experts, block_m,
                                                      max_padded_rows(n, num_experts, block_m))
    return AlignedRouting(sorted_ids=sorted_ids, block_expert=block_expert, total_rows=total, block_m=block_m,
                          num_pairs=n)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _block_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks walk the N blocks together so their A tiles stay in L2."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _fold_scales(a, s_row_ptr, kk, k_ok, EVEN_K: tl.constexpr, SB: tl.constexpr):
    """``a [BM, BK] · s[k // SB]``: one fp8 weight-tile row's block scales folded into the activation tile."""
    if EVEN_K:
        sc = tl.load(s_row_ptr + kk // SB)
    else:
        sc = tl.load(s_row_ptr + kk // SB, mask=k_ok, other=0.0)
    return (a.to(tl.float32) * sc[None, :]).to(a.dtype)


@triton.jit
def _act_tile(a, s_ptrs, row_ok, A_PRE: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr):
    """The w8a8 modes' activation tile of one K step as (e4m3 ``[BM, BK]``, per-row scale ``[BM]``): as loaded
    with its scales read at ``s_ptrs`` (``A_PRE``), else quantised here (:func:`fp8_linear.quantize_rows`)."""
    if A_PRE:
        return a, tl.load(s_ptrs, mask=row_ok, other=0.0)
    return quantize_rows(a, FP8_MAX_, MIN_AMAX_)


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr,
                        sg_ptr, su_ptr, xs_ptr, hs_ptr,
                        num_pairs, num_pid_m, N, K, limit,
                        stride_xm, stride_we, stride_wn, stride_hm, stride_se, stride_sn, stride_xs, stride_hs,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        W_FP8: tl.constexpr = False, SB: tl.constexpr = 128, A_FP8: tl.constexpr = False,
                        FP8_MAX_: tl.constexpr = 448.0, MIN_AMAX_: tl.constexpr = 1e-12, FP8_ACC: tl.constexpr = 32,
                        SWAP_AB: tl.constexpr = False, A_PRE: tl.constexpr = False, H_FP16: tl.constexpr = False,
                        USE_PDL: tl.constexpr = False):
    """h[pair, n] = clamped_swiglu(x[token] · W_gate[e, n], x[token] · W_up[e, n]); N = I, K = H.
    ``W_FP8``: the weights are e4m3 with block scales ``s[e, n // SB, k // SB]`` (BLOCK_N divides SB).
    ``A_FP8`` (with ``W_FP8``): the x tile is quantised per row and K tile (BLOCK_K = SB, or all of a smaller K);
    ``SWAP_AB`` (with ``A_FP8``): the accumulators are ``[BLOCK_N, BLOCK_M]`` (``fp8_linear.w8a8_dot``).
    ``A_PRE`` (with ``A_FP8``): x arrives quantised (e4m3 with scales ``xs[token, k // SB]``) and h leaves so:
    each tile's SwiGLU output, rounded to bf16 (fp16 with ``H_FP16``) as the other modes store it, is one
    128-channel group per row (BLOCK_N = SB, or all of a smaller N), written as e4m3 with ``hs[pair, n // SB]``."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = _block_coords(pid, num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_pairs
    tok = (rows // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past N wrap onto valid weight rows (their results are never stored): no mask on B.
    w_off = expert * stride_we + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    xs_ptrs = xs_ptr + tok * stride_xs
    g_ptrs = wg_ptr + w_off
    u_ptrs = wu_ptr + w_off
    s_off = expert * stride_se + ((pid_n * BLOCK_N) // SB) * stride_sn
    acc_g = w8a8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = w8a8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if A_FP8:
            a8, sa = _act_tile(a, xs_ptrs + kb, row_ok, A_PRE, FP8_MAX_, MIN_AMAX_)
            s_k = (kb * BLOCK_K) // SB
            sg = tl.load(sg_ptr + s_off + s_k)
            su = tl.load(su_ptr + s_off + s_k)
            acc_g += w8a8_dot(a8, bg, sa, FP8_ACC, SWAP_AB) * sg
            acc_u += w8a8_dot(a8, bu, sa, FP8_ACC, SWAP_AB) * su
        elif W_FP8:
            kk = kb * BLOCK_K + offs_k
            ag = _fold_scales(a, sg_ptr + s_off, kk, k_ok, EVEN_K, SB)
            au = _fold_scales(a, su_ptr + s_off, kk, k_ok, EVEN_K, SB)
            if IEEE:
                acc_g = tl.dot(ag, bg.to(tl.float32), acc_g, input_precision="ieee")
                acc_u = tl.dot(au, bu.to(tl.float32), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(ag, bg.to(a.dtype), acc_g)
                acc_u = tl.dot(au, bu.to(a.dtype), acc_u)
        elif IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    g = tl.minimum(w8a8_rows(acc_g, SWAP_AB), limit)
    u = tl.minimum(tl.maximum(w8a8_rows(acc_u, SWAP_AB), -limit), limit)
    hid = g * tl.sigmoid(g) * u
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    h_ok = row_ok[:, None] & (offs_n < N)[None, :]
    if A_PRE:
        # columns past N hold products of wrapped weight rows: out of the group's absmax
        hid = tl.where((offs_n < N)[None, :], hid, 0.0)
        if H_FP16:
            hid = hid.to(tl.float16)
        else:
            hid = hid.to(tl.bfloat16)
        h8, hs = quantize_rows(hid, FP8_MAX_, MIN_AMAX_)
        tl.store(h_ptrs, h8, mask=h_ok)
        tl.store(hs_ptr + rows.to(tl.int64) * stride_hs + pid_n, hs, mask=row_ok)
    else:
        tl.store(h_ptrs, hid.to(h_ptr.dtype.element_ty), mask=h_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_down_kernel(h_ptr, wd_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, sd_ptr, hs_ptr,
                     num_pairs, num_pid_m, N, K,
                     stride_hm, stride_we, stride_wn, stride_ym, stride_se, stride_sn, stride_hs,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                     W_FP8: tl.constexpr = False, SB: tl.constexpr = 128, A_FP8: tl.constexpr = False,
                     FP8_MAX_: tl.constexpr = 448.0, MIN_AMAX_: tl.constexpr = 1e-12, FP8_ACC: tl.constexpr = 32,
                     SWAP_AB: tl.constexpr = False, A_PRE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """y[pair, n] = w[pair] · (h[pair] · W_down[e, n]); N = H, K = I (``W_FP8``, ``A_FP8``, ``SWAP_AB`` as in the
    gate/up kernel: with ``A_FP8`` the h tile is quantised; with ``A_PRE`` h is e4m3 with scales ``hs``)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = _block_coords(pid, num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_pairs
    rows64 = rows.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows64[:, None] * stride_hm + offs_k[None, :]
    hs_ptrs = hs_ptr + rows64 * stride_hs
    b_ptrs = wd_ptr + expert * stride_we + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_off = expert * stride_se + ((pid_n * BLOCK_N) // SB) * stride_sn
    acc = w8a8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if A_FP8:
            a8, sa = _act_tile(a, hs_ptrs + kb, row_ok, A_PRE, FP8_MAX_, MIN_AMAX_)
            sd = tl.load(sd_ptr + s_off + (kb * BLOCK_K) // SB)
            acc += w8a8_dot(a8, b, sa, FP8_ACC, SWAP_AB) * sd
        elif W_FP8:
            a = _fold_scales(a, sd_ptr + s_off, kb * BLOCK_K + offs_k, k_ok, EVEN_K, SB)
            if IEEE:
                acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.to(a.dtype), acc)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(topk_w_ptr + rows64, mask=row_ok, other=0.0)
    acc = w8a8_rows(acc, SWAP_AB) * w[:, None]
    y_ptrs = y_ptr + rows64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

def default_config(num_tokens: int, top_k: int, num_experts: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Heuristic when no tuning table exists: the block height follows the mean rows per expert
    (decode: 16-row blocks, the tl.dot minimum, wide K tiles to stream weights); prefill: big tiles.

    fp32 (the oracle mode, ieee dots without tensor cores) gets small tiles: the bf16 prefill tiles
    need 255 registers per thread in bf16 already and spill heavily in fp32 (checked with ptxas, sm_90)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if dtype == torch.float32:
        return {"BLOCK_SIZE_M": 16 if per_expert <= 4 else 32 if per_expert <= 32 else 64, "BLOCK_SIZE_N": 64,
                "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1 if per_expert <= 4 else 8, "num_warps": 4, "num_stages": 3}
    if per_expert <= 4:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 4}
    if per_expert <= 32:
        return {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 4,
                "num_warps": 4, "num_stages": 4}
    if per_expert <= 128:
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                "num_warps": 4, "num_stages": 4}
    return {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
            "num_warps": 8, "num_stages": 3,
            "down": {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 8, "num_stages": 4}}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"fused_moe dtype {dtype}: use bf16, fp16 or fp32")
    return _DTYPE_NAMES[dtype]


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return device_type
    return torch.cuda.get_device_name(index).replace(" ", "_")


def device_name(device: torch.device) -> str:
    """Name used in config file names, e.g. ``NVIDIA_H200``."""
    return _device_name(device.type, device.index)


def config_file_name(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, dev_name: str,
                     fp8_weights: bool = False) -> str:
    """``fused_moe_E{E}_H{H}_I{I}_{dtype}[_fp8w]_{device}.json`` (``_fp8w``: fp8 experts, ``dtype`` activations)."""
    tag = dtype_name(dtype) + ("_fp8w" if fp8_weights else "")
    return f"fused_moe_E{num_experts}_H{hidden}_I{inter}_{tag}_{dev_name}.json"


def validate_config(cfg: dict[str, Any]) -> None:
    """Raise ValueError naming the bad entry; ``cfg`` may carry a ``down`` dict overriding TILE_KEYS."""
    for key in CONFIG_KEYS:
        if key not in cfg:
            raise ValueError(f"fused_moe config {cfg} lacks {key!r} (needs {', '.join(CONFIG_KEYS)})")
    for src in (cfg, cfg.get("down", {})):
        for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            v = src.get(key)
            if v is not None and (not isinstance(v, int) or v < 16 or v & (v - 1)):
                raise ValueError(f"fused_moe config {key}={v!r}: must be a power of two >= 16 (tl.dot minimum)")
        for key in ("GROUP_SIZE_M", "num_warps", "num_stages"):
            v = src.get(key)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"fused_moe config {key}={v!r}: must be a positive int")
    if cfg.get("A_FP8", 0) not in (0, 1, 2):
        raise ValueError(f"fused_moe config A_FP8={cfg['A_FP8']!r}: must be 0 (fp8 weights only), 1 (w8a8, tiles "
                         "quantised in the kernels) or 2 (w8a8, x and h quantised once)")
    for src in (cfg, cfg.get("down", {})):
        if src.get("SWAP_AB", 0) not in (0, 1):
            raise ValueError(f"fused_moe config SWAP_AB={src['SWAP_AB']!r}: must be 0 or 1 (w8a8 dots as wᵀ · aᵀ)")
    unknown = set(cfg.get("down", {})) - set(DOWN_KEYS)
    if unknown:
        raise ValueError(f"fused_moe config 'down' has keys {sorted(unknown)}; only {', '.join(DOWN_KEYS)} "
                         "may differ (BLOCK_SIZE_M is shared by the alignment)")


@functools.lru_cache(maxsize=None)
def load_config_table(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                      dev_name: str, fp8_weights: bool = False) -> tuple[tuple[int, dict[str, Any]], ...] | None:
    """Tuning table for this shape/dtype/device as sorted ``(M, config)`` pairs, or None if absent.
    Non-numeric keys (e.g. ``"_meta"``) are ignored. Callers must not mutate the configs."""
    path = CONFIG_DIR / config_file_name(num_experts, hidden, inter, dtype, dev_name, fp8_weights)
    if not path.exists():
        logger.info("no fused_moe tuning table %s; using the default heuristic", path.name)
        return None
    raw = json.loads(path.read_text())
    table = []
    for key, cfg in raw.items():
        if key.isdigit():
            validate_config(cfg)
            table.append((int(key), cfg))
    if not table:
        raise ValueError(f"{path} has no numeric M entries; rerun bench/tune_fused_moe.py")
    logger.info("fused_moe: loaded %d tuned configs from %s", len(table), path.name)
    return tuple(sorted(table, key=lambda kv: kv[0]))


def select_config(table: tuple[tuple[int, dict[str, Any]], ...], num_tokens: int) -> dict[str, Any]:
    """The entry whose M is nearest ``num_tokens`` (ties → the smaller M), as a fresh dict."""
    _, cfg = min(table, key=lambda kv: (abs(kv[0] - num_tokens), kv[0]))
    return json.loads(json.dumps(cfg))


def get_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
               dtype: torch.dtype, device: torch.device, fp8_weights: bool = False) -> dict[str, Any]:
    """The tuned config nearest ``num_tokens`` (the fp8-weight table for fp8 experts), else the default."""
    table = load_config_table(num_experts, hidden, inter, dtype, device_name(device), fp8_weights)
    if table is None:
        return default_config(num_tokens, top_k, num_experts, dtype)
    return select_config(table, num_tokens)


def _fit(block: int, dim: int) -> int:
    """Never tile wider than the (power-of-two-rounded) dimension: saves work at small test shapes."""
    return min(block, max(16, triton.next_power_of_2(dim)))



def _fit_smem(block_m: int, block_n: int, block_k: int, stages: int, b_tiles: int, elem_a: int,
              elem_b: int, fixed_k: bool = False) -> tuple[int, int]:
    """Shrink (BLOCK_K, then stages) until ``stages`` buffered A+B tiles fit in shared memory, so a
    bf16-tuned config reused for fp32 (twice the bytes) degrades instead of failing to launch. ``fixed_k``
    (w8a8: a K tile is one activation quantisation group) shrinks only the stages."""
    while stages * (block_m * block_k * elem_a + b_tiles * block_k * block_n * elem_b) > SMEM_LIMIT:
        if block_k > 32 and not fixed_k:
            block_k //= 2
        elif stages > 2:
            stages -= 1
        else:
            break
    return block_k, stages


@dataclass(frozen=True)
class QuantRows:
    """Activation rows quantised per 128-channel group for the pre-quantised w8a8 mode (config ``"A_FP8": 2``):
    e4m3 ``q [R, C]`` with fp32 ``scale [R, ceil(C/128)]``, standing for rows of ``dtype``. x is quantised once
    by the dense paths' quantiser and h by the gate/up kernel's epilogue, instead of every program quantising
    the tiles it loads (mode 1), which at prefill sizes repeats each row's quantisation once per N tile."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @classmethod
    def of(cls, x: torch.Tensor) -> "QuantRows":
        """``x [R, C]`` quantised by :func:`glm5_kernels.fp8_linear.per_token_group_quant_fp8` (the reference's rule)."""
        q, s = per_token_group_quant_fp8(x)
        return cls(q, s, x.dtype)

    @classmethod
    def empty(cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> "QuantRows":
        return cls(torch.empty(rows, cols, device=device, dtype=FP8_DTYPE),
                   torch.empty(rows, triton.cdiv(cols, FP8_BLOCK), device=device, dtype=torch.float32), dtype)


#: The ``A_FP8`` :func:`fused_moe` (and the tuner) use for fp8 experts when the config has none: the pre-quantised
#: w8a8 mode, measured on the H200 (2026-12-03, ``bench/results/tune_fused_moe_fp8w.log``) faster than W8A16 and
#: than mode 1 at T = 64-16384 (at T = 4096: 3.9 ms against 7.0 ms W8A16, 9.2 ms mode 1 and 4.5 ms bf16).
DEFAULT_A_FP8 = 2


def quantises_activations(cfg: dict[str, Any], dtype: torch.dtype, fp8_weights: bool) -> bool:
    """Whether the kernels run w8a8 (activation tiles quantised in the kernel): fp8 experts, bf16/fp16
    activations (fp32, the oracle mode, is never quantised) and the config's ``A_FP8`` (absent: 0;
    :func:`fused_moe` sets :data:`DEFAULT_A_FP8`)."""
    return fp8_weights and dtype != torch.float32 and bool(cfg.get("A_FP8", 0))


def _launch_tiles(cfg: dict[str, Any], n: int, k: int, block_m: int, b_tiles: int, act_dtype: torch.dtype,
                  fp8_weights: bool, pre: bool = False, group_n: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_stages, w8a8) of one MoE kernel over ``[n, k]`` weight tiles: the config's tiles
    fitted to the shape; fp8 tiles at most 128 wide in N (one scale row each); in the w8a8 modes one
    128-channel activation group per K step (``pre``: the activations arrive quantised, one byte each) and, with
    ``group_n`` (the gate/up kernel quantising its output), one group per N tile; then stages (and, unless w8a8,
    BLOCK_K) cut to shared memory."""
    bn, bk = _fit(cfg["BLOCK_SIZE_N"], n), _fit(cfg["BLOCK_SIZE_K"], k)
    a_fp8 = pre or quantises_activations(cfg, act_dtype, fp8_weights)
    if fp8_weights:
        bn = min(bn, FP8_BLOCK)
    if a_fp8:
        bk = group_tile_k(k)
    if group_n:
        bn = group_tile_k(n)
    # w8a8 tiles stay e4m3 in shared memory; a widened (W8A16) tile also takes the activation's width there
    elem = act_dtype.itemsize
    bk, stages = _fit_smem(block_m, bn, bk, cfg["num_stages"], b_tiles, 1 if pre else elem, 1 if a_fp8 else elem,
                           fixed_k=a_fp8)
    return bn, bk, stages, a_fp8


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def _scale_args(scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(pointer, expert stride, row-block stride) of an fp8 stack's scales; the weight itself as a dummy."""
    if scale is None:
        return w, 0, 0
    return scale, scale.stride(0), scale.stride(1)


def moe_gate_up(x: torch.Tensor | QuantRows, w_gate: torch.Tensor, w_up: torch.Tensor, routing: AlignedRouting,
                top_k: int, swiglu_limit: float, cfg: dict[str, Any], out: torch.Tensor | QuantRows | None = None,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | QuantRows:
    """First GEMM + clamped SwiGLU: ``h [T*k, I]`` in ``x.dtype`` (pair order; rows of unrouted pairs
    are never written, but every pair is routed). ``scales``: (gate, up) block scales of fp8 weights. ``x`` as
    :class:`QuantRows` (fp8 weights only: the pre-quantised w8a8 mode) gives ``h`` as :class:`QuantRows` too."""
    pre = isinstance(x, QuantRows)
    if pre and scales is None:
        raise ValueError("moe_gate_up: quantised activations (QuantRows) need fp8 experts with their scales")
    xq = x.q if pre else x
    t, hidden = xq.shape
    inter = w_gate.shape[1]
    h = out if out is not None else QuantRows.empty(t * top_k, inter, x.dtype, x.device) if pre else \
        torch.empty(t * top_k, inter, device=x.device, dtype=x.dtype)
    hq = h.q if pre else h
    bn, bk, stages, a_fp8 = _launch_tiles(cfg, inter, hidden, routing.block_m, 2, x.dtype, scales is not None,
                                          pre=pre, group_n=pre)
    sg, se, sn = _scale_args(None if scales is None else scales[0], w_gate)
    su, _, _ = _scale_args(None if scales is None else scales[1], w_up)
    xs, hs = (x.scale, h.scale) if pre else (sg, sg)
    grid = (routing.num_blocks * triton.cdiv(inter, bn),)
    _moe_gate_up_kernel[grid](
        xq, w_gate, w_up, hq, routing.sorted_ids, routing.block_expert, routing.total_rows, sg, su, xs, hs,
        routing.num_pairs, routing.num_blocks, inter, hidden, float(swiglu_limit),
        xq.stride(0), w_gate.stride(0), w_gate.stride(1), hq.stride(0), se, sn,
        xs.stride(0) if pre else 0, hs.stride(0) if pre else 0,
        TOP_K=top_k, BLOCK_M=routing.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_SIZE_M"],
        EVEN_K=hidden % bk == 0, IEEE=x.dtype == torch.float32, W_FP8=scales is not None, SB=FP8_BLOCK,
        A_FP8=a_fp8, FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX,
        FP8_ACC=fp8_dot_acc(bk), SWAP_AB=swap_ab(cfg, a_fp8), A_PRE=pre, H_FP16=x.dtype == torch.float16,
        num_warps=cfg["num_warps"], num_stages=stages, **pdl_kwargs(x.device))
    return h


@triton.jit
def _moe_sum_kernel(y_ptr, add_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ADD: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    """out[t, h] = Σ_k y[t, k, h] (fp32, slot order, rounded to out's dtype) [+ add[t, h], rounded again]."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * H + offs, mask=m, other=0.0).to(tl.float32)
    out = acc.to(dt)
    if HAS_ADD:
        out = (out.to(tl.float32) + tl.load(add_ptr + t * H + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
    tl.store(out_ptr + t * H + offs, out, mask=m)


def moe_sum(y: torch.Tensor, top_k: int, add: torch.Tensor | None = None, block_h: int = 1024) -> torch.Tensor:
    """``y [T·k, H]`` (token-major slots) → ``[T, H]``: the sum over each token's ``k`` slots, plus ``add``
    ``[T, H]`` when given, in one launch (``y.view(T, k, H).sum(1) + add`` takes two). Reference:
    :func:`glm5_kernels.moe_ref.moe_sum_ref` (equal bit for bit)."""
    tk, h = y.shape
    if tk % top_k:
        raise ValueError(f"moe_sum: {tk} rows are not whole tokens of top_k={top_k} slots")
    t = tk // top_k
    if add is not None and (add.shape != (t, h) or add.dtype != y.dtype):
        raise ValueError(f"moe_sum: add must be [{t}, {h}] {y.dtype}, got {add.dtype} {tuple(add.shape)}")
    y = y.contiguous()
    add = add.contiguous() if add is not None else None
    out = torch.empty(t, h, device=y.device, dtype=y.dtype)
    if t == 0:
        return out
    block_h = min(block_h, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block_h))](y, add if add is not None else y, out, h, TOP_K=top_k,
                                                   BLOCK_H=block_h, HAS_ADD=add is not None, num_warps=4,
                                                   **pdl_kwargs(y.device))
    return out


def moe_down(h: torch.Tensor | QuantRows, w_down: torch.Tensor, topk_weights: torch.Tensor, routing: AlignedRouting,
             cfg: dict[str, Any], out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """Second GEMM times the routing weight: ``y [T*k, H]`` in ``h.dtype`` (pair order). ``scale``: the block
    scales of fp8 ``w_down``; ``h`` as :class:`QuantRows` (with ``scale``): the pre-quantised w8a8 mode."""
    pre = isinstance(h, QuantRows)
    if pre and scale is None:
        raise ValueError("moe_down: quantised activations (QuantRows) need fp8 experts with their scales")
    hq = h.q if pre else h
    pairs, inter = hq.shape
    hidden = w_down.shape[1]
    y = out if out is not None else torch.empty(pairs, hidden, device=h.device, dtype=h.dtype)
    bn, bk, stages, a_fp8 = _launch_tiles(cfg, hidden, inter, routing.block_m, 1, h.dtype, scale is not None,
                                          pre=pre)
    sd, se, sn = _scale_args(scale, w_down)
    hs = h.scale if pre else sd
    grid = (routing.num_blocks * triton.cdiv(hidden, bn),)
    _moe_down_kernel[grid](
        hq, w_down, y, topk_weights, routing.sorted_ids, routing.block_expert, routing.total_rows, sd, hs,
        routing.num_pairs, routing.num_blocks, hidden, inter,
        hq.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), se, sn, hs.stride(0) if pre else 0,
        BLOCK_M=routing.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_SIZE_M"],
        EVEN_K=inter % bk == 0, IEEE=h.dtype == torch.float32, W_FP8=scale is not None, SB=FP8_BLOCK,
        A_FP8=a_fp8, FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX,
        FP8_ACC=fp8_dot_acc(bk), SWAP_AB=swap_ab(cfg, a_fp8), A_PRE=pre, num_warps=cfg["num_warps"],
        num_stages=stages, **pdl_kwargs(h.device))
    return y


def down_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The second kernel's tiles: ``cfg`` with its optional ``down`` overrides applied (``A_FP8`` kept: both
    kernels quantise their activations or neither does)."""
    shared = {k: cfg[k] for k in (*CONFIG_KEYS, "A_FP8", "SWAP_AB") if k in cfg}
    return {**shared, **cfg.get("down", {})}


def _check_inputs(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; flatten it to [tokens, hidden]")
    t, hidden = x.shape
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} / w_up {tuple(w_up.shape)} must both be [E, I, H]")
    e, inter, h2 = w_gate.shape
    if h2 != hidden or tuple(w_down.shape) != (e, hidden, inter):
        raise ValueError(f"expert shapes w_gate {tuple(w_gate.shape)}, w_down {tuple(w_down.shape)} do not fit "
                         f"x {tuple(x.shape)}: need [E, I, H] and [E, H, I] with H={hidden}")
    if hidden % 16 or inter % 16:
        raise ValueError(f"fused_moe needs H and I to be multiples of 16 (tl.dot tiles), got H={hidden}, I={inter}; "
                         "use the torch MoE backend for this shape")
    want_w = FP8_DTYPE if scales is not None else x.dtype
    for i, (name, w) in enumerate((("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))):
        if w.dtype != want_w:
            raise ValueError(f"{name} dtype {w.dtype} != {want_w} ({'fp8 experts: scales given' if scales is not None else 'x dtype'}); "
                             "cast x to the model dtype, or pass scales only with float8_e4m3fn experts")
        if scales is not None:
            s = scales[i]
            want = (w.shape[0], triton.cdiv(w.shape[1], FP8_BLOCK), triton.cdiv(w.shape[2], FP8_BLOCK))
            if tuple(s.shape) != want or s.dtype != torch.float32 or s.stride(-1) != 1 or s.device != x.device:
                raise ValueError(f"{name} block scales {s.dtype} {tuple(s.shape)} do not fit {tuple(w.shape)}: need a "
                                 f"row-major float32 {want} on {x.device}")
        if w.stride(-1) != 1 or w.stride(1) != w.shape[2] or w.device != x.device:
            raise ValueError(f"{name} must be a row-major [E, rows, cols] tensor on {x.device} (strides "
                             f"{w.stride()}); load the experts contiguously (a copy would not fit at full size)")
    if w_up.stride() != w_gate.stride():
        raise ValueError(f"w_up strides {w_up.stride()} != w_gate strides {w_gate.stride()}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must both be "
                         f"[T={t}, top_k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids dtype {topk_ids.dtype}: use int32 or int64")
    dtype_name(x.dtype)


def _nothing() -> None:
    return None


def fused_moe(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, swiglu_limit: float | None,
              config: dict[str, Any] | None = None,
              scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              expert_map: torch.Tensor | None = None, add: torch.Tensor | None = None,
              before_add: Callable[[], None] | None = None) -> torch.Tensor:
    """Routed-expert forward of ``x [T, H]`` → ``[T, H]`` in ``x.dtype`` (see module docstring), plus ``add``
    ``[T, H]`` (the shared expert's output) when given, added in the slot-sum launch. ``before_add`` is called
    before the first launch that reads ``add`` (a caller computing ``add`` on another stream joins it there,
    so that its kernels overlap the routed experts').

    ``w_gate``/``w_up`` ``[E, I, H]`` and ``w_down`` ``[E, H, I]`` in ``x.dtype``, or float8_e4m3fn with
    ``scales`` = their fp32 128 x 128 block scales (gate, up, down); ``topk_weights``
    ``[T, k]`` (any float dtype, used in fp32) and ``topk_ids`` ``[T, k]`` (distinct per token, in
    ``[0, E)``). ``config`` overrides the tuned/default launch config. No host sync.

    ``expert_map`` (expert parallelism): int ``[E_global]`` mapping the ids in ``topk_ids`` to this rank's
    local experts ``[0, E)``, ``-1`` for experts held elsewhere; those pairs contribute nothing (the result is
    this rank's partial sum) and cost no GEMM work."""
    if expert_map is not None:
        local = expert_map.index_select(0, topk_ids.reshape(-1).long()).view(topk_ids.shape)
        topk_ids = torch.where(local >= 0, local, torch.full_like(local, w_gate.shape[0]))
    _check_inputs(x, w_gate, w_up, w_down, topk_weights, topk_ids, scales)
    t, hidden = x.shape
    e, inter, _ = w_gate.shape
    top_k = topk_ids.shape[1]
    before_add = before_add or _nothing
    if t == 0 or top_k == 0:
        before_add()
        return torch.zeros_like(x) if add is None else add.clone()
    if config is None:
        config = get_config(t, top_k, e, hidden, inter, x.dtype, x.device, fp8_weights=scales is not None)
    else:
        validate_config(config)
    config = {"A_FP8": DEFAULT_A_FP8, **config}
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    x = x.contiguous()
    pre = quantises_activations(config, x.dtype, scales is not None) and config["A_FP8"] == 2
    weights = topk_weights.to(torch.float32).contiguous()
    if expert_map is None:
        routing = align_routing(topk_ids, e, config["BLOCK_SIZE_M"])
        y_out = None
    else:  # id e = "elsewhere": sorted last and never computed, so its rows of y must read as 0
        routing = moe_align_block_size(topk_ids, e + 1, config["BLOCK_SIZE_M"], num_computed_experts=e)
        y_out = torch.zeros(t * top_k, hidden, device=x.device, dtype=x.dtype)
    h = moe_gate_up(QuantRows.of(x) if pre else x, w_gate, w_up, routing, top_k, limit, config,
                    scales=None if scales is None else (scales[0], scales[1]))
    y = moe_down(h, w_down, weights, routing, down_config(config), out=y_out,
                 scale=None if scales is None else scales[2])
    before_add()
    if top_k == 1 and add is None:
        return y
    return moe_sum(y, top_k, add)


__all__ = ["AlignedRouting", "QuantRows", "align_routing", "fused_moe", "moe_align_block_size", "moe_forward_flops_bytes",
           "get_config", "default_config", "select_config", "load_config_table", "config_file_name",
           "max_padded_rows", "moe_gate_up", "moe_down", "moe_sum", "down_config", "quantises_activations",
           "DEFAULT_A_FP8", "CONFIG_DIR"]
