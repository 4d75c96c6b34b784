"""One free list for every kind of cache storage: paged blocks, state slots, state snapshots.

Blocks hold ``block_size`` tokens of MLA latent and ``block_size / kpool`` pooled index keys of every
MLA layer; state slots hold one running request's KDA conv/recurrent states and kpool tails;
snapshots (:mod:`glm5.cache.snapshot_pool`) hold copies of those states for prefix caching. All three
are ids ``0 .. capacity-1`` handed out by :class:`FreeList`.

A free id is either *empty* (nothing worth keeping) or *cached*: it still holds data that a later
request may reuse (a hashed block, a saved snapshot). Allocation takes empty ids first and only
then evicts the least recently freed cached id, telling the owner through ``on_evict`` so that it
forgets what the id held. Cached data therefore lives in the free pool: it costs no capacity of its
own and disappears only when the space is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class CacheFullError(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler preempts instead of failing."""


class FreeList:
    """Ids ``0 .. capacity-1``; free ids wait as *empty* (FIFO) or *cached* (least recently freed first).

    ``what`` names the storage in errors ("cache block", "state slot"); ``fix`` says how to get more.
    """

    def __init__(self, capacity: int, what: str, fix: str, on_evict: Callable[[int], None] | None = None):
        if capacity < 1:
            raise ValueError(f"{what} capacity {capacity}: need at least one; {fix}")
        self.capacity = capacity
        self.what, self.fix = what, fix
        self.on_evict = on_evict
        self._empty: deque[int] = deque(range(capacity))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._free = bytearray(b"\x01") * capacity  # 1 where the id is free (empty or cached): O(1) checks

    @property
    def num_free(self) -> int:
        """Ids an allocation can get: empty ones plus cached ones (evicted on demand)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def is_free(self, i: int) -> bool:
        return bool(self._free[i])

    def is_cached(self, i: int) -> bool:
        return i in self._cached

    def allocate(self, n: int) -> list[int]:
        """``n`` ids: empty ones first, then the least recently freed cached ones (evicted)."""
        if n > self.num_free:
            raise CacheFullError(f"need {n} {self.what}s, {self.num_free} free; {self.fix}")
        out = []
        for _ in range(n):
            if self._empty:
                i = self._empty.popleft()
            else:
                i, _ = self._cached.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(i)
            self._free[i] = 0
            out.append(i)
        return out

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free(self, ids: Iterable[int], cached: bool = False) -> None:
        """Return ids in the given order; ``cached=True`` keeps their data for reuse (evicted last)."""
        for i in ids:
            if not 0 <= i < self.capacity or self.is_free(i):
                raise ValueError(f"{self.what} {i} freed twice or out of range 0..{self.capacity - 1}")
            self._free[i] = 1
            if cached:
                self._cached[i] = None
            else:
                self._empty.append(i)

    def take(self, i: int) -> None:
        """Take one specific cached id out of the free pool (a cache hit on data that is still there)."""
        if i not in self._cached:
            raise ValueError(f"{self.what} {i} is not a free cached {self.what}")
        del self._cached[i]
        self._free[i] = 0

    def touch(self, i: int) -> None:
        """Mark a cached free id as just used: it is evicted after every other cached id."""
        self._cached.move_to_end(i)

    def demote(self, i: int) -> None:
        """Mark a cached free id as least valuable: it is the next one evicted."""
        self._cached.move_to_end(i, last=False)

    def forget(self, i: int) -> None:
        """A cached free id no longer holds anything useful: move it to the empty ids."""
        if i in self._cached:
            del self._cached[i]
            self._empty.append(i)
