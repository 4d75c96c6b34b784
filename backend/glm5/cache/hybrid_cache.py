"""Storage of the hybrid cache: per-layer tensors, the pool-slot mapping and its invariants.

Per MLA layer (decoder MLA layers and MTP layers alike):
  * ``latent``     [num_blocks * block_size, kv_lora_rank]       one row per token (slot = block * bs + offset)
  * ``pool_keys``  [num_blocks * block_size / kpool, index_dim]  one row per *complete* pool
  * ``tail``       [num_slots, kpool, 2 * index_dim]             raw (key | gate score) of the pool in progress
Per KDA layer:
  * ``conv``       [num_slots, K - 1, 3 * D]                     last K-1 pre-conv q|k|v inputs
  * ``recurrent``  [num_slots, heads, d_k, d_v] fp32

Pool ``p`` of a request lives in the block that holds its first token ``p * kpool``; because
``block_size % kpool == 0`` a pool never straddles two blocks, so its slot is
``block_table[p*kpool // bs] * (bs / kpool) + (p*kpool % bs) / kpool``. The upstream bug where
pool entries of different requests overwrote each other came from a mismatch here; the
invariant is checked when the cache is built.

One extra block and one extra state slot past the configured counts (``scratch_block``,
``scratch_slot``) are never handed out: the padding rows of a CUDA-graph decode batch point at
them, so a replayed graph can run a fixed batch size without touching any request's cache.

Prefix caching shares blocks between requests (:mod:`glm5.cache.block_manager`) and copies a request's
slot state in and out of the state-snapshot pool (:mod:`glm5.cache.snapshot_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.config import TextConfig


@dataclass
class CacheConfig:
    block_size: int = 64
    num_blocks: int = 256
    num_state_slots: int = 64


def check_block_size(block_size: int, kpool: int) -> None:
    if block_size < 1 or block_size % kpool != 0:
        raise ValueError(
            f"block_size={block_size} must be a positive multiple of index_kpool={kpool} so that a pool never "
            f"straddles two blocks; use e.g. block_size={max(1, block_size // kpool) * kpool or kpool}")


class HybridCache:
    def __init__(self, cfg: TextConfig, cache_cfg: CacheConfig, device: torch.device | str, dtype: torch.dtype,
                 mla_layers: list[int] | None = None, index_fp8: bool = False, kda_heads: int | None = None):
        """``kda_heads``: KDA heads whose conv / recurrent states this cache holds (a tensor-parallel rank's
        share, ``linear_num_heads / TP``; default all). MLA latent, pooled keys and tails are per token / pool
        and shared by every head, so they are always whole."""
        check_block_size(cache_cfg.block_size, cfg.index_kpool)
        self.cfg = cfg
        self.cache_cfg = cache_cfg
        self.block_size = cache_cfg.block_size
        self.kpool = cfg.index_kpool
        self.pools_per_block = cache_cfg.block_size // cfg.index_kpool
        self.device = torch.device(device)
        self.dtype = dtype
        self.scratch_block, self.scratch_slot = cache_cfg.num_blocks, cache_cfg.num_state_slots
        nb, bs, ns = cache_cfg.num_blocks + 1, cache_cfg.block_size, cache_cfg.num_state_slots + 1
        mla_layers = cfg.mla_layer_ids if mla_layers is None else mla_layers
        self.latent = {i: torch.zeros(nb * bs, cfg.kv_lora_rank, device=device, dtype=dtype) for i in mla_layers}
        # exact mode: pooled keys in the model dtype; fp8 mode (glm5_kernels.fp8_index_ref): Hadamard-rotated
        # e4m3 keys plus one fp32 power-of-two scale per pool
        self.index_fp8 = index_fp8
        key_dtype = torch.float8_e4m3fn if index_fp8 else dtype
        self.pool_keys = {i: torch.zeros(nb * self.pools_per_block, cfg.index_head_dim, device=device, dtype=key_dtype)
                          for i in mla_layers}
        self.pool_scales = {i: torch.ones(nb * self.pools_per_block, 1, device=device, dtype=torch.float32)
                            for i in mla_layers} if index_fp8 else {}
        self.tail = {i: torch.zeros(ns, cfg.index_kpool, 2 * cfg.index_head_dim, device=device, dtype=dtype)
                     for i in mla_layers}
        self.kda_heads = cfg.linear_num_heads if kda_heads is None else kda_heads
        d = self.kda_heads * cfg.linear_head_dim
        self.conv = {i: torch.zeros(ns, cfg.linear_conv_kernel_dim - 1, 3 * d, device=device, dtype=dtype)
                     for i in cfg.kda_layer_ids}
        self.recurrent = {i: torch.zeros(ns, self.kda_heads, cfg.linear_head_dim, cfg.linear_head_dim,
                                         device=device, dtype=torch.float32) for i in cfg.kda_layer_ids}

    # ------------------------------------------------------------------ slot mapping
    def token_slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latent rows of ``positions`` for a request whose blocks are ``block_table``."""
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def pool_slots(self, block_table: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
        """Pooled-key rows of pool ids ``pools`` (pool p covers tokens p*kpool .. p*kpool+kpool-1)."""
        first = pools * self.kpool
        return block_table[first // self.block_size] * self.pools_per_block + (first % self.block_size) // self.kpool

    def reset_slot(self, slot: int) -> None:
        """Zero a state slot before a new request uses it (KDA starts from a zero state)."""
        for t in self.conv.values():
            t[slot].zero_()
        for t in self.recurrent.values():
            t[slot].zero_()
        for t in self.tail.values():
            t[slot].zero_()

    def nbytes(self) -> int:
        groups = (self.latent, self.pool_keys, self.pool_scales, self.tail, self.conv, self.recurrent)
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())
