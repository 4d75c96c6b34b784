"""The fused MoE's token alignment in one launch for decode-sized batches. Torch reference:
:func:`glm5_kernels.fused_moe.moe_align_block_size` (the same outputs, element for element).

The reference is ~20 small torch kernels (sort, two searchsorted, cumsum, index_select, scatter, ...) per MoE
layer: at batch 1 it was a fifth of the decode step's launches. For up to ``MAX_PAIRS`` (token, slot) pairs one
program does it all: a histogram of the expert ids, the padded group offsets (cumsum), a stable order by
(expert, pair) — ``tl.sort`` of ``expert * P + pair`` — the destination row of every pair, the padding-filled
row buffer and each row block's expert (how many group ends lie at or before the block's first row, clamped).
Sync-free, shapes from the arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

#: Largest number of (token, slot) pairs the one-program kernel takes (decode batches up to 128 × top-8).
MAX_PAIRS = 1024


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, bexp_ptr, total_ptr, scratch_ptr, P, max_rows, n_blocks,
                  E: tl.constexpr, E_PAD: tl.constexpr, P_PAD: tl.constexpr, BM: tl.constexpr,
                  FILL: tl.constexpr, NB: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    p = tl.arange(0, P_PAD)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=E).to(tl.int32)                 # padding pairs sort last
    bins = tl.arange(0, E_PAD)
    counts = tl.where(bins < E, tl.histogram(e, E_PAD), 0)
    padded = (counts + (BM - 1)) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    shift = (pad_end - padded) - (tl.cumsum(counts, 0) - counts)            # pad_start[e] - first sorted index
    tl.store(scratch_ptr + bins, shift)
    for r0 in range(0, max_rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + r, tl.full([FILL], 0, tl.int32) + P, mask=r < max_rows)
    tl.debug_barrier()                                                      # fill and offsets before the scatter
    key = tl.sort(e * P_PAD + p)
    se = key // P_PAD
    valid = se < E
    dest = p + tl.load(scratch_ptr + se, mask=valid, other=0)
    tl.store(sorted_ptr + dest, key % P_PAD, mask=valid)
    for b0 in range(0, n_blocks, NB):
        b = b0 + tl.arange(0, NB)
        ends_before = (pad_end[None, :] <= (b * BM)[:, None]) & (bins < E)[None, :]
        tl.store(bexp_ptr + b, tl.minimum(tl.sum(ends_before.to(tl.int32), 1), E - 1), mask=b < n_blocks)
    tl.store(total_ptr, tl.sum(padded, 0).to(tl.int64))


def moe_align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    max_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids ``[max_rows]`` int32, block_expert ``[max_rows // block_m]`` int32, total_rows ``[1]`` int64)
    for ``topk_ids [T, k]`` with ``T*k <= MAX_PAIRS``: what ``moe_align_block_size`` returns in its
    :class:`~glm5_kernels.fused_moe.AlignedRouting` (``max_rows``: its ``max_padded_rows``)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    if n > MAX_PAIRS:
        raise ValueError(f"{n} (token, slot) pairs > {MAX_PAIRS}: use moe_align_block_size")
    if max_rows % block_m:
        raise ValueError(f"max_rows={max_rows} is not a multiple of block_m={block_m}")
    dev = topk_ids.device
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=dev)
    n_blocks = max_rows // block_m
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int64, device=dev)
    e_pad = triton.next_power_of_2(num_experts + 1)
    scratch = torch.empty(e_pad, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat if flat.is_contiguous() else flat.contiguous(), sorted_ids, block_expert, total, scratch,
                        n, max_rows, n_blocks, E=num_experts, E_PAD=e_pad,
                        P_PAD=max(16, triton.next_power_of_2(n)), BM=block_m, FILL=1024, NB=16, num_warps=4,
                        **pdl_kwargs(sorted_ids.device))
    return sorted_ids, block_expert, total


__all__ = ["MAX_PAIRS", "moe_align_small"]
