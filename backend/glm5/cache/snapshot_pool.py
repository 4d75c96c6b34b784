"""State snapshots for prefix caching on the hybrid model: a byte-bounded pool with LRU eviction.

Shared MLA blocks alone cannot resume a request: its 34 KDA layers carry a recurrent state (and a
short-conv history) that summarises *every* earlier token, and its MLA layers carry the kpool tail
of the pool in progress. A snapshot at position ``P`` is a copy of everything of a request's state
after its first ``P`` tokens that does not live in full shared blocks:

* per KDA layer: conv state ``[K-1, 3D]`` and recurrent state ``[H, dk, dv]`` fp32;
* per MLA layer (MTP layer included): the kpool tail ``[kpool, 2d]`` and, when ``P`` is not on a
  block boundary, the computed rows of the partial block (``P % bs`` latent rows and the
  ``P % bs // kpool`` pooled keys completed inside it).

Copying the partial block's rows (a few hundred KiB on the real model, next to ~140 MiB of KDA
state) is what lets a hit resume at *any* position, not just on the block grid: restoring writes
them into the new request's own fresh block, and the request continues from ``P`` exactly as a full
prefill that had stopped at ``P`` would.

Every snapshot slot is always free in the :class:`~glm5.cache.allocator.FreeList` sense: a saved
snapshot is cached data in the free pool, reused by lookups and evicted least recently used
when a new snapshot needs its slot. The pool is sized in bytes by the engine
(``prefix_cache_snapshot_memory_gb``); :meth:`StateSnapshotPool.bytes_per_snapshot` is the unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.cache.allocator import FreeList
from glm5.cache.hybrid_cache import HybridCache


@dataclass(frozen=True)
class Snapshot:
    """What a saved snapshot is: its key, position, the key of the full blocks before it and the
    tokens from there to ``position + lookahead`` (to find where a new prompt diverges)."""

    key: bytes
    position: int
    chain: bytes
    tokens: tuple[int, ...]
    kind: str = ""      # why it was taken (request_end, preempted, prompt_end, junction, interval): statistics


class StateSnapshotPool:
    def __init__(self, cache: HybridCache, num_snapshots: int):
        self.cache = cache
        s, dev = num_snapshots, cache.device

        def like(t: torch.Tensor, *shape: int) -> torch.Tensor:
            # zeros, not empty: on a CPU the pages of an empty tensor become resident only when a snapshot
            # first lands on them, so the process grew by the whole pool over a long run (the 10-minute soak:
            # ~100 MB of its RSS drift); committed here, the pool costs what the memory plan says from the start
            return torch.zeros((s, *shape), dtype=t.dtype, device=dev)

        bs, ppb = cache.block_size, cache.pools_per_block
        self.conv = {i: like(t, *t.shape[1:]) for i, t in cache.conv.items()}
        self.recurrent = {i: like(t, *t.shape[1:]) for i, t in cache.recurrent.items()}
        self.tail = {i: like(t, *t.shape[1:]) for i, t in cache.tail.items()}
        self.latent = {i: like(t, bs, t.shape[1]) for i, t in cache.latent.items()}
        self.pool_keys = {i: like(t, ppb, t.shape[1]) for i, t in cache.pool_keys.items()}
        self.pool_scales = {i: like(t, ppb, t.shape[1]) for i, t in cache.pool_scales.items()}
        self.free_list = FreeList(s, "state snapshot", "raise prefix_cache_snapshot_memory_gb",
                                  on_evict=self._forget)
        self.entries: list[Snapshot | None] = [None] * s
        self._by_key: dict[bytes, int] = {}
        self._by_chain: dict[bytes, set[int]] = {}
        self.saved = 0      # snapshots written (statistics)
        self.restored = 0

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def bytes_per_snapshot(cache: HybridCache) -> int:
        """Device bytes one snapshot takes for ``cache``'s layers and shapes."""
        def row(t: torch.Tensor, n: int | None = None) -> int:
            per = t[0].numel() * t.element_size()
            return per * (n if n is not None else 1)

        total = sum(row(t) for g in (cache.conv, cache.recurrent, cache.tail) for t in g.values())
        total += sum(row(t, cache.block_size) for t in cache.latent.values())
        total += sum(row(t, cache.pools_per_block) for g in (cache.pool_keys, cache.pool_scales) for t in g.values())
        return total

    @property
    def capacity(self) -> int:
        return self.free_list.capacity

    @property
    def num_free(self) -> int:
        return self.free_list.num_free

    @property
    def num_saved(self) -> int:
        """Snapshots currently held (each evictable)."""
        return len(self._by_key)

    def nbytes(self) -> int:
        groups = (self.conv, self.recurrent, self.tail, self.latent, self.pool_keys, self.pool_scales)
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())

    # ------------------------------------------------------------------ index
    def find(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def under(self, chain: bytes) -> list[tuple[int, Snapshot]]:
        """Saved snapshots whose full blocks are the prefix ``chain``."""
        return [(i, self.entries[i]) for i in self._by_chain.get(chain, ())]  # type: ignore[misc]

    def demote(self, key: bytes) -> None:
        """Make the snapshot with ``key`` (if still held) the next one evicted."""
        i = self._by_key.get(key)
        if i is not None:
            self.free_list.demote(i)

    def _forget(self, i: int) -> None:
        snap = self.entries[i]
        if snap is None:
            return
        del self._by_key[snap.key]
        ids = self._by_chain[snap.chain]
        ids.discard(i)
        if not ids:
            del self._by_chain[snap.chain]
        self.entries[i] = None

    # ------------------------------------------------------------------ copies
    def save(self, snap: Snapshot, state_slot: int, partial_block: int | None) -> int:
        """Copy state slot ``state_slot`` (and the partial block's computed rows) into a snapshot slot,
        evicting the least recently used snapshot if none is empty; an existing snapshot with the same
        key is only marked used. Returns the snapshot slot."""
        existing = self._by_key.get(snap.key)
        if existing is not None:
            self.free_list.touch(existing)
            return existing
        i = self.free_list.allocate_one()
        rows = snap.position % self.cache.block_size
        if rows and partial_block is None:
            raise ValueError(f"a snapshot at position {snap.position} needs the request's partial block")
        self.move(i, state_slot, partial_block, rows, to_snapshot=True)
        self.entries[i] = snap
        self._by_key[snap.key] = i
        self._by_chain.setdefault(snap.chain, set()).add(i)
        self.free_list.free([i], cached=True)
        self.saved += 1
        return i

    def restore(self, i: int, state_slot: int, partial_block: int | None) -> None:
        """Write snapshot ``i`` into state slot ``state_slot`` and, for a mid-block position, into the
        first rows of the request's fresh block ``partial_block``."""
        snap = self.entries[i]
        if snap is None:
            raise ValueError(f"state snapshot slot {i} holds no snapshot")
        rows = snap.position % self.cache.block_size
        if rows and partial_block is None:
            raise ValueError(f"restoring a snapshot at position {snap.position} needs a block for its partial rows")
        self.move(i, state_slot, partial_block, rows, to_snapshot=False)
        self.free_list.touch(i)
        self.restored += 1

    def move(self, i: int, state_slot: int, partial_block: int | None, rows: int, to_snapshot: bool) -> None:
        """The data side of :meth:`save` / :meth:`restore`: copy state slot ``state_slot`` (and ``rows`` rows of
        ``partial_block``) into snapshot slot ``i`` or back. Kept apart from the bookkeeping so that a distributed
        engine can replay exactly these copies on every rank (each holds its own heads' states)."""
        c = self.cache
        for pool, cache_group in ((self.conv, c.conv), (self.recurrent, c.recurrent), (self.tail, c.tail)):
            for layer, t in cache_group.items():
                if to_snapshot:
                    pool[layer][i].copy_(t[state_slot])
                else:
                    t[state_slot].copy_(pool[layer][i])
        if rows:
            self._copy_partial(i, partial_block, rows, to_snapshot)

    def _copy_partial(self, i: int, block: int, rows: int, to_snapshot: bool) -> None:
        c = self.cache
        lat = slice(block * c.block_size, block * c.block_size + rows)
        pools = rows // c.kpool
        pl = slice(block * c.pools_per_block, block * c.pools_per_block + pools)
        pairs = [(self.latent, c.latent, lat, rows), (self.pool_keys, c.pool_keys, pl, pools),
                 (self.pool_scales, c.pool_scales, pl, pools)]
        for snap_group, cache_group, sl, n in pairs:
            if n == 0:
                continue
            for layer, t in cache_group.items():
                if to_snapshot:
                    snap_group[layer][i, :n].copy_(t[sl])
                else:
                    t[sl].copy_(snap_group[layer][i, :n])
