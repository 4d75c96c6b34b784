"""The engine's cache memory budget: every cache it allocates, in bytes, in one plan.

``cache_memory_gb`` is the budget for *all* request-state memory the engine holds beside the
weights. The plan splits it into groups that grow with different units:

* per cache block (``block_size`` tokens): the MLA latent rows and the pooled index keys of every
  MLA layer, decoder layers and the MTP layer alike (an fp8 index cache adds one fp32 scale per
  pool);
* per state slot (one running request): the kpool tail of every MLA layer and the KDA short-conv
  and recurrent states of every KDA layer (fp32 recurrent state: 64 heads x 128 x 128 x 4 bytes x
  34 layers = 136 MiB per slot at the real shape, which dominates small-block budgets);
* fixed: the vision embedding cache (an LRU bounded in bytes);
* per state snapshot (prefix caching): a copy of one slot's states plus one block's rows, so that a
  later request can resume at any position (:mod:`glm5.cache.snapshot_pool`); the pool is sized from
  its own byte budget, which is part of ``cache_memory_gb``.

One block and one state slot beyond the configured counts are always allocated (the scratch rows
that padded CUDA-graph decode rows point at; :mod:`glm5.cache.hybrid_cache`), so they are counted.
Fixed and per-slot memory is taken first; what remains is cut into blocks unless the block count
is given. A configuration that does not fit (the fixed part alone, or not even one
``max_model_len`` request's worth of blocks) is refused before anything is allocated, with the
numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from glm5.config import TextConfig

logger = logging.getLogger(__name__)

MIB = 2**20
GIB = 2**30
#: Share of the budget for the prefix cache's state snapshots when ``prefix_cache_snapshot_memory_gb`` is unset.
SNAPSHOT_POOL_SHARE = 0.10


class CacheBudgetError(ValueError):
    """The configured cache sizes do not fit the memory budget; the message names every number."""


@dataclass(frozen=True)
class CacheGroup:
    """One kind of cache memory: ``units`` of ``unit`` (block, slot, or one fixed pool) of
    ``bytes_per_unit`` bytes each."""

    name: str
    unit: str                # "block" | "slot" | "snapshot" | "fixed"
    bytes_per_unit: int
    units: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_unit * self.units


@dataclass
class CacheMemoryPlan:
    """Bytes per cache group for a configuration, and the block/slot counts derived from it."""

    budget_bytes: int
    block_size: int
    num_blocks: int           # blocks handed out to requests (one more is allocated as scratch)
    num_state_slots: int      # slots handed out (= max_num_seqs; one more is allocated as scratch)
    groups: list[CacheGroup] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(g.total_bytes for g in self.groups)

    def bytes_of(self, name: str) -> int:
        return sum(g.total_bytes for g in self.groups if g.name == name)

    def units_of(self, name: str) -> int:
        return sum(g.units for g in self.groups if g.name == name)

    def describe(self) -> str:
        """A readable table (logged at start)."""
        lines = [f"cache memory plan: {self.total_bytes / MIB:.1f} MiB of the {self.budget_bytes / MIB:.1f} MiB "
                 f"budget; {self.num_blocks} blocks x {self.block_size} tokens, {self.num_state_slots} state slots "
                 "(+1 scratch each)"]
        for g in self.groups:
            lines.append(f"  {g.name:<22} {g.units:>8} x {g.unit:<5} x {g.bytes_per_unit / MIB:10.4f} MiB = "
                         f"{g.total_bytes / MIB:10.1f} MiB")
        return "\n".join(lines)


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def cache_groups(text: TextConfig, *, dtype: torch.dtype, block_size: int, mla_layers: list[int],
                 index_fp8: bool, num_blocks: int, num_state_slots: int,
                 encoder_cache_bytes: int) -> list[CacheGroup]:
    """The groups of a :class:`~glm5.cache.hybrid_cache.HybridCache` built with these arguments
    (``num_blocks`` / ``num_state_slots`` *without* the scratch block and slot)."""
    e = _elem(dtype)
    pools_per_block = block_size // text.index_kpool
    key_bytes = (1 if index_fp8 else e) * text.index_head_dim + (4 if index_fp8 else 0)  # fp8: + fp32 scale
    mtp = set(text.mtp_layer_ids)
    decoder_mla = [i for i in mla_layers if i not in mtp]
    mtp_mla = [i for i in mla_layers if i in mtp]
    blocks, slots = num_blocks + 1, num_state_slots + 1
    d = text.linear_num_heads * text.linear_head_dim
    n_kda = len(text.kda_layer_ids)
    groups = []
    for prefix, layers in (("mla", decoder_mla), ("mtp", mtp_mla)):
        if not layers:
            continue
        n = len(layers)
        groups += [
            CacheGroup(f"{prefix}_latent", "block", n * block_size * text.kv_lora_rank * e, blocks),
            CacheGroup(f"{prefix}_index_pool_keys", "block", n * pools_per_block * key_bytes, blocks),
            CacheGroup(f"{prefix}_index_tail", "slot", n * text.index_kpool * 2 * text.index_head_dim * e, slots),
        ]
    if n_kda:
        groups += [
            CacheGroup("kda_conv_state", "slot", n_kda * (text.linear_conv_kernel_dim - 1) * 3 * d * e, slots),
            CacheGroup("kda_recurrent_state", "slot",
                       n_kda * text.linear_num_heads * text.linear_head_dim * text.linear_head_dim * 4, slots),
        ]
    groups.append(CacheGroup("vision_encoder_cache", "fixed", encoder_cache_bytes, 1))
    return groups


def snapshot_bytes(groups: list[CacheGroup]) -> int:
    """Bytes of one prefix-cache state snapshot: one slot's states and one block's rows
    (:meth:`glm5.cache.snapshot_pool.StateSnapshotPool.bytes_per_snapshot` of the same cache)."""
    return sum(g.bytes_per_unit for g in groups if g.unit in ("slot", "block"))


def plan_cache_memory(text: TextConfig, *, dtype: torch.dtype, block_size: int, max_num_seqs: int,
                      max_model_len: int, budget_bytes: int, mla_layers: list[int], index_fp8: bool = False,
                      encoder_cache_bytes: int = 0, num_blocks: int | None = None,
                      device_free_bytes: int | None = None, prefix_caching: bool = False,
                      snapshot_budget_bytes: int | None = None) -> CacheMemoryPlan:
    """Size the cache within ``budget_bytes`` or raise :class:`CacheBudgetError` naming the numbers.

    ``num_blocks`` None: as many blocks as the budget leaves after the per-slot and fixed groups,
    which must be at least one ``max_model_len`` request's worth. Given: the whole plan must fit.
    ``device_free_bytes`` (CUDA: free memory after the weights) also bounds the budget.
    ``prefix_caching``: state snapshots, taken from the budget like the fixed groups:
    ``snapshot_budget_bytes`` of them when given (it must hold at least one), else
    :data:`SNAPSHOT_POOL_SHARE` of the budget and at least one.
    """
    if device_free_bytes is not None and budget_bytes > device_free_bytes:
        raise CacheBudgetError(
            f"cache_memory_gb={budget_bytes / GIB:.3f} GiB exceeds the free device memory after loading the "
            f"weights ({device_free_bytes / GIB:.3f} GiB); lower cache_memory_gb")
    probe = cache_groups(text, dtype=dtype, block_size=block_size, mla_layers=mla_layers, index_fp8=index_fp8,
                         num_blocks=0, num_state_slots=max_num_seqs, encoder_cache_bytes=encoder_cache_bytes)
    snapshots: list[CacheGroup] = []
    if prefix_caching:
        per_snapshot = snapshot_bytes(probe)
        if snapshot_budget_bytes is None:
            snapshot_budget_bytes = max(int(budget_bytes * SNAPSHOT_POOL_SHARE), per_snapshot)
        n_snap = snapshot_budget_bytes // per_snapshot
        if n_snap < 1:
            raise CacheBudgetError(
                f"prefix_cache_snapshot_memory_gb={snapshot_budget_bytes / GIB:.3g} holds no state snapshot "
                f"({per_snapshot / MIB:.1f} MiB each on this model); raise it to at least {per_snapshot / GIB:.3f} "
                "or set enable_prefix_caching=false")
        snapshots = [CacheGroup("prefix_cache_snapshots", "snapshot", per_snapshot, int(n_snap))]
        probe += snapshots
    per_block = sum(g.bytes_per_unit for g in probe if g.unit == "block")
    fixed = sum(g.total_bytes for g in probe if g.unit != "block") + per_block  # + the scratch block
    slot_bytes = sum(g.bytes_per_unit for g in probe if g.unit == "slot")
    needed_blocks = -(-max_model_len // block_size)
    fixed_desc = (f"{max_num_seqs + 1} state slots (max_num_seqs + 1 scratch) x {slot_bytes / MIB:.2f} MiB = "
                  f"{(max_num_seqs + 1) * slot_bytes / MIB:.1f} MiB, the vision encoder cache "
                  f"({encoder_cache_bytes / MIB:.1f} MiB), "
                  + (f"{snapshots[0].units} prefix-cache state snapshots ({snapshots[0].total_bytes / MIB:.1f} MiB) "
                     if snapshots else "") + f"and one scratch block ({per_block / MIB:.3f} MiB)")
    budget_desc = f"cache_memory_gb={budget_bytes / GIB:.3f} ({budget_bytes / MIB:.1f} MiB)"
    if num_blocks is None:
        left = budget_bytes - fixed
        num_blocks = max(0, left // max(per_block, 1))
        if num_blocks < needed_blocks:
            raise CacheBudgetError(
                f"{budget_desc} does not fit the cache: {fixed_desc} leave {max(left, 0) / MIB:.1f} MiB, i.e. "
                f"{num_blocks} blocks of {per_block / MIB:.3f} MiB, but max_model_len={max_model_len} needs "
                f"{needed_blocks} blocks ({needed_blocks * per_block / MIB:.1f} MiB). Raise cache_memory_gb to at "
                f"least {(fixed + needed_blocks * per_block) / GIB:.3f}, or lower max_num_seqs / max_model_len")
    else:
        total = fixed + num_blocks * per_block
        if total > budget_bytes:
            raise CacheBudgetError(
                f"{budget_desc} does not fit the cache: num_cache_blocks={num_blocks} x {per_block / MIB:.3f} MiB = "
                f"{num_blocks * per_block / MIB:.1f} MiB plus {fixed_desc} is {total / MIB:.1f} MiB. Raise "
                f"cache_memory_gb to at least {total / GIB:.3f}, or lower num_cache_blocks / max_num_seqs")
    groups = cache_groups(text, dtype=dtype, block_size=block_size, mla_layers=mla_layers, index_fp8=index_fp8,
                          num_blocks=num_blocks, num_state_slots=max_num_seqs,
                          encoder_cache_bytes=encoder_cache_bytes) + snapshots
    return CacheMemoryPlan(budget_bytes=budget_bytes, block_size=block_size, num_blocks=int(num_blocks),
                           num_state_slots=max_num_seqs, groups=groups)
