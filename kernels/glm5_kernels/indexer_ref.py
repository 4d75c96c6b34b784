"""Torch references of the batched indexer scoring and token selection (:mod:`glm5_kernels.indexer`).

They are also the engine's torch path (sync-free, so the batched decode step can use them on any device); no
Triton import.
"""

from __future__ import annotations

from typing import Sequence

import torch

from glm5_kernels.fp8_index_ref import fp8_index_scores


def pool_rows(block_tables: torch.Tensor, pools: torch.Tensor, ppb: int) -> torch.Tensor:
    """Pool-key rows of pool ids ``pools`` for block-table row(s) ``block_tables`` (HybridCache.pool_slots)."""
    return block_tables.long()[..., pools // ppb] * ppb + pools % ppb


def index_scores_ref(q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                     softmax_scale: float) -> torch.Tensor:
    """Scores ``[n, P]`` fp32 of queries ``q [n, heads, d]`` over pooled keys ``keys [P, d]``:
    ``Σ_h head_w[n,h] · relu(softmax_scale · q[n,h]·k_p)`` with ``head_w [n, heads]`` fp32 (already × heads^-0.5).
    Exact mode (keys in the model dtype, fp32 dots) when ``key_scales`` is None, else fp8 mode (e4m3 keys with
    ``key_scales [P, 1]``, :func:`glm5_kernels.fp8_index_ref.fp8_index_scores`)."""
    if key_scales is not None:
        return fp8_index_scores(q, head_w, keys, key_scales, softmax_scale)
    scores = torch.relu(torch.matmul(q.float(), keys.float().t()) * softmax_scale)      # [n, h, P]
    return torch.matmul(head_w.float().unsqueeze(-2), scores).squeeze(-2)


def indexer_scores_ref(q: torch.Tensor, head_w: torch.Tensor, pool_keys: torch.Tensor,
                       pool_scales: torch.Tensor | None, block_tables: torch.Tensor, row_seq: torch.Tensor,
                       n_complete: torch.Tensor, ppb: int, softmax_scale: float, max_pools: int) -> torch.Tensor:
    """Reference of :func:`indexer_scores`: per row, gather its pools and score them as
    :meth:`KPoolIndexer.visible` does; ``[N, max_pools]`` fp32 with ``-inf`` at ``p >= n_complete``."""
    n = q.shape[0]
    pools = torch.arange(max_pools, device=q.device)
    out = torch.empty(n, max_pools, device=q.device, dtype=torch.float32)
    for i in range(n):
        bt = block_tables[row_seq[i].long()]
        rows = pool_rows(bt, pools.clamp(max=block_tables.shape[1] * ppb - 1), ppb)
        out[i] = index_scores_ref(q[i: i + 1], head_w[i: i + 1], pool_keys[rows],
                                  None if pool_scales is None else pool_scales[rows], softmax_scale)[0]
    return out.masked_fill(pools[None, :] >= n_complete.long()[:, None], float("-inf"))


def select_token_slots_ref(scores: torch.Tensor, n_complete: torch.Tensor, positions: torch.Tensor,
                           block_tables: torch.Tensor, row_seq: torch.Tensor, n_select: int, kpool: int,
                           block_size: int) -> torch.Tensor:
    """Reference of :func:`select_token_slots`, by way of :meth:`KPoolIndexer.visible`'s boolean mask:
    stable descending sort → chosen pools → chosen token positions (pools ∪ tail) → their latent rows,
    compacted to the front (in position order), ``-1`` after. Sync-free, so it also serves as the torch path."""
    n, max_pools = scores.shape
    device = scores.device
    nc, pos = n_complete.long(), positions.long()
    pools = torch.arange(max_pools, device=device)
    candidate = pools[None, :] < nc[:, None]
    masked = scores.masked_fill(~candidate, float("-inf"))
    top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(n_select, max_pools)]
    chosen = torch.zeros_like(candidate).scatter_(1, top, True) & candidate               # [N, P]
    n_tok = (max_pools + 1) * kpool                                   # positions a row can see: < (nc+1)*kpool
    tok = torch.arange(n_tok, device=device)
    chosen_tok = torch.zeros(n, n_tok, dtype=torch.bool, device=device)
    chosen_tok[:, : max_pools * kpool] = chosen.repeat_interleave(kpool, dim=1)
    chosen_tok |= (tok[None, :] >= (nc * kpool)[:, None]) & (tok[None, :] <= pos[:, None])
    width = n_select * kpool + kpool - 1
    order = torch.sort((~chosen_tok).to(torch.int8), dim=1, stable=True).indices[:, :width]   # chosen first
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros(n, width - order.shape[1])], dim=1)
    keep = torch.gather(chosen_tok, 1, order) & (torch.arange(width, device=device) < n_tok)[None, :]
    bt = block_tables.long()[row_seq.long()]
    blk_col = (order // block_size).clamp(max=bt.shape[1] - 1)
    slots = torch.gather(bt, 1, blk_col) * block_size + order % block_size
    return torch.where(keep, slots, torch.full_like(slots, -1)).to(torch.int32)


def count_selected(positions: torch.Tensor | Sequence[int] | int, n_select: int,
                   kpool: int) -> torch.Tensor | list[int] | int:
    """Valid entries per row of :func:`select_token_slots` for queries at ``positions``:
    ``min((pos+1)//kpool, n_select)*kpool + (pos+1) % kpool``. Pure arithmetic on the positions, so a host
    planner (FlashInfer) can size its work without reading the device."""
    def one(p: int) -> int:
        return min((p + 1) // kpool, n_select) * kpool + (p + 1) % kpool
    if isinstance(positions, torch.Tensor):
        p1 = positions.long() + 1
        return torch.clamp(torch.div(p1, kpool, rounding_mode="floor"), max=n_select) * kpool + p1 % kpool
    if isinstance(positions, int):
        return one(positions)
    return [one(int(p)) for p in positions]


__all__ = ["count_selected", "index_scores_ref", "indexer_scores_ref", "pool_rows", "select_token_slots_ref"]
