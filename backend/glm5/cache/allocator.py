"""Block and state-slot allocation for the paged hybrid cache.

Blocks hold ``block_size`` tokens of MLA latent and ``block_size / kpool`` pooled index keys of every
MLA layer; state slots hold one running request's KDA conv/recurrent states and kpool tails.
Both are handed out from free lists; the scheduler admits a request only when both are available.
"""

from __future__ import annotations

from collections import deque


class CacheFullError(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler preempts instead of failing."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the cache needs at least one block; raise the cache size")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} cache blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: need at least one state slot; raise max_num_seqs")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError("no free state slot")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)
