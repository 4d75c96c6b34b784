"""Paged cache blocks with reference counts and a content-keyed table of cached blocks.

A block is *referenced* while some request's block table holds it (``ref_count`` > 0). A block whose
content is final (every position computed) can be *registered* under its chained content key
(:mod:`glm5.cache.prefix_keys`); other requests with the same prefix then share it (``acquire``)
instead of recomputing it. When its last reference goes, a registered block stays cached in the
free pool (:class:`~glm5.cache.allocator.FreeList`) and is evicted, least recently freed first,
only when a fresh block is needed; an unregistered block is simply free. Shared blocks are never
written: a request writes only positions past its cached prefix, which lie in its own blocks.

The token ids behind each key are kept too: when a new prompt leaves the cached path inside a
block, the engine compares its tokens with the cached children of the last matching block to find
exactly where it diverges (the position of its junction snapshot).
"""

from __future__ import annotations

from collections.abc import Iterable

from glm5.cache.allocator import FreeList


class BlockManager:
    def __init__(self, num_blocks: int):
        self.free_list = FreeList(num_blocks, "cache block",
                                  "raise num_cache_blocks / cache_memory_gb or lower max_num_seqs",
                                  on_evict=self._forget)
        self.ref_count = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self._parent: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._children: dict[bytes, set[int]] = {}

    # ------------------------------------------------------------------ counts
    @property
    def num_blocks(self) -> int:
        return self.free_list.capacity

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get, cached unreferenced blocks included."""
        return self.free_list.num_free

    @property
    def num_used(self) -> int:
        return self.free_list.num_used

    @property
    def num_cached(self) -> int:
        """Registered blocks (referenced or not)."""
        return len(self._by_key)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (each with one reference), evicting cached blocks if no empty ones are left."""
        ids = self.free_list.allocate(n)
        for b in ids:
            self.ref_count[b] = 1
        return ids

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference of each block, in the given order: a registered block that nobody
        references any more stays cached, and of several the one freed first is evicted first."""
        for b in blocks:
            if self.ref_count[b] <= 0:
                raise ValueError(f"cache block {b} freed without a reference")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_list.free([b], cached=self.key[b] is not None)

    def acquire(self, b: int) -> None:
        """One more reference to a registered block (a prefix hit), taking it out of the free pool if needed."""
        if self.key[b] is None:
            raise ValueError(f"cache block {b} is not registered: only cached blocks can be shared")
        if self.ref_count[b] == 0:
            self.free_list.take(b)
        self.ref_count[b] += 1

    # ------------------------------------------------------------------ content keys
    def lookup(self, keys: list[bytes]) -> list[int]:
        """Cached blocks for the longest leading run of ``keys`` (one chained key per block)."""
        out = []
        for key in keys:
            b = self._by_key.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, b: int, key: bytes, parent: bytes, tokens: list[int]) -> bool:
        """Record that referenced block ``b`` holds the final content of ``key`` (whose parent key is
        ``parent``, covering ``tokens``). False when another block already holds that key: ``b``
        then stays private and is simply freed later."""
        if self.ref_count[b] <= 0:
            raise ValueError(f"cache block {b} must be referenced by the request that filled it")
        if key in self._by_key or self.key[b] is not None:
            return False
        self.key[b], self._parent[b], self._tokens[b] = key, parent, tuple(tokens)
        self._by_key[key] = b
        self._children.setdefault(parent, set()).add(b)
        return True

    def is_cached(self, b: int) -> bool:
        return self.key[b] is not None

    def children(self, parent: bytes) -> list[tuple[int, ...]]:
        """Token ids of the cached blocks that directly follow the prefix ``parent``."""
        return [self._tokens[b] for b in self._children.get(parent, ())]  # type: ignore[misc]

    def _forget(self, b: int) -> None:
        """Eviction: block ``b`` is being reused, so its content key must stop pointing at it."""
        key, parent = self.key[b], self._parent[b]
        if key is None:
            return
        del self._by_key[key]
        kids = self._children.get(parent)  # type: ignore[arg-type]
        if kids is not None:
            kids.discard(b)
            if not kids:
                del self._children[parent]  # type: ignore[arg-type]
        self.key[b] = self._parent[b] = self._tokens[b] = None
