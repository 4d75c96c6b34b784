"""Cache ownership of the requests: blocks, state slots and the prefix cache of the hybrid model.

Without prefix caching this hands out blocks and a zeroed state slot per request. With it
(``enable_prefix_caching``, the default), a request at admission resumes from the longest prefix
for which *both* of these exist:

* the full MLA blocks before it, found by chained content key and shared (reference counted);
* a state snapshot (:mod:`glm5.cache.snapshot_pool`) at exactly that position: KDA conv and
  recurrent states, kpool tails, and the partial block's rows, copied into the request's slot and
  its own fresh block.

The request then computes only the rest; its output is what a full prefill would give, because
everything it reads for positions before the hit is bit-for-bit what it would have written.

Snapshots are taken where later requests are likely to resume (why these, with measurements:
``docs/prefix-caching.md``):

* **request end** — when a request finishes, is aborted or preempted, at its last computed
  position: the next chat turn (previous prompt + answer + new message) resumes there, and a
  preempted request re-admits there;
* **prompt end** — after the last prefill chunk;
* **junction** — where a new prompt leaves the cached path (found by comparing its tokens with the
  cached blocks and snapshots that follow its last matching block): its prefill is split there and
  the state saved, so that the next request sharing that prefix (e.g. the third with one system
  prompt) resumes at exactly the end of the shared part, wherever it falls in a block;
* optionally every ``prefix_cache_checkpoint_interval`` blocks of a prefill.

Blocks are registered (made shareable) once their content is final: every position computed and,
with MTP on, the MTP layer's rows too (:mod:`glm5.cache.prefix_keys`, "lookahead").
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from glm5.cache.allocator import FreeList
from glm5.cache.block_manager import BlockManager
from glm5.cache.hybrid_cache import HybridCache
from glm5.cache.prefix_keys import TokenChain
from glm5.cache.snapshot_pool import Snapshot, StateSnapshotPool
from glm5.engine.prompt_logprobs import wants_prompt_logprobs
from glm5.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class PrefixCacheConfig:
    num_snapshots: int
    lookahead: int = 0              # 1 with MTP (the MTP row at p depends on token p+1)
    checkpoint_interval: int = 0    # blocks between prefill checkpoints; 0 = none
    points: frozenset[str] = frozenset({"request_end", "preempted", "prompt_end", "junction"})
    #: a junction snapshot is planned only when it would save later requests at least this many tokens
    #: beyond the best existing snapshot (the split costs this request one more prefill step)
    min_junction_gain: int = 1


@dataclass
class PrefixMatch:
    """What an admission can reuse: the first ``num_cached_tokens`` positions, from the shared
    ``blocks`` (the full blocks before that position) and snapshot slot ``snapshot``."""

    num_cached_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    snapshot: int | None = None
    junction: int | None = None     # where the prompt leaves the cached path (a snapshot is planned there)


def _common_prefix(a: list[int], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCacheManager:
    """Blocks, state slots and (with ``prefix``) the prefix cache of one engine. The scheduler calls
    :meth:`match` / :meth:`admit` at admission, :meth:`grow` for running requests and :meth:`release`
    when a request leaves; the engine calls :meth:`after_step` once a step's rows are final."""

    def __init__(self, cache: HybridCache, num_blocks: int, num_slots: int, prefix: PrefixCacheConfig | None,
                 pool_cls: type[StateSnapshotPool] = StateSnapshotPool):
        """``cache`` / ``pool_cls``: the cache this manager mutates (slot resets, snapshot copies) and the snapshot
        pool type; a distributed engine hands views that replay those mutations on every rank."""
        self.cache = cache
        self.block_size = cache.block_size
        self.blocks = BlockManager(num_blocks)
        self.slots = FreeList(num_slots, "state slot", "raise max_num_seqs")
        self.prefix = prefix
        self.snapshots = pool_cls(cache, prefix.num_snapshots) if prefix is not None else None
        self.lookahead = prefix.lookahead if prefix is not None else 0
        self.queries = 0   # tokens looked up at admissions (vLLM's prefix_cache_queries)
        self.hits = 0      # of those, tokens reused
        self.hits_by_kind: Counter[str] = Counter()    # tokens reused, by the kind of snapshot hit
        self.saved_by_kind: Counter[str] = Counter()   # snapshots written, by kind

    @property
    def enabled(self) -> bool:
        return self.prefix is not None

    # ------------------------------------------------------------------ lookup
    def _chain(self, seq: Sequence) -> TokenChain:
        if seq.prefix_chain is None:
            spans = seq.mm.spans if seq.mm is not None else []
            seq.prefix_chain = TokenChain(self.block_size, self.lookahead, list(spans))
        seq.prefix_chain.update(seq.tokens, seq.num_tokens)
        return seq.prefix_chain

    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest reusable prefix of ``seq`` (always leaving its last token to compute) and
        where it leaves the cached path. A request that still needs prompt logprobs reads nothing from the
        cache: its prompt rows must be computed to be scored."""
        if self.prefix is None or self.snapshots is None or wants_prompt_logprobs(seq):
            return PrefixMatch()
        bs, la, n = self.block_size, self.lookahead, seq.num_tokens
        chain = self._chain(seq)
        cached = self.blocks.lookup(chain.keys)
        best: tuple[int, int] | None = None          # (snapshot slot, position)
        for k in range(len(cached), -1, -1):         # snapshots behind k full blocks lie in [k*bs, (k+1)*bs)
            for i, snap in self.snapshots.under(chain.prefix(k)):
                p = snap.position
                if p <= n - 1 and (best is None or p > best[1]) and chain.snapshot_key(seq.tokens, p) == snap.key:
                    best = (i, p)
            if best is not None:
                break
        hit = best[1] if best is not None else 0
        # where the prompt leaves the cached path: past the matching blocks, compare with what follows them
        m = len(cached)
        rest = seq.tokens(m * bs, min(n, (m + 1) * bs + la))
        follow = self.blocks.children(chain.prefix(m)) + [s.tokens for _, s in self.snapshots.under(chain.prefix(m))]
        diverge = m * bs + max((_common_prefix(rest, t) for t in follow), default=0)
        # equal placeholder ids need not mean equal media: the path is known only up to a new item's start
        diverge = min([diverge] + [s.start for s in chain.media if m * bs <= s.start < diverge])
        junction = min(diverge - la, n - 1)
        planned = "junction" in self.prefix.points and junction - hit >= self.prefix.min_junction_gain
        return PrefixMatch(num_cached_tokens=hit, blocks=cached[: hit // bs],
                           snapshot=best[0] if best is not None else None, junction=junction if planned else None)

    # ------------------------------------------------------------------ admission and growth
    def admission_cost(self, seq: Sequence, m: PrefixMatch, end: int) -> int:
        """Free blocks that admitting ``seq`` with cache positions up to ``end`` consumes (fresh
        blocks plus cached blocks that are taken out of the free pool)."""
        fresh = max(0, -(-end // self.block_size) - len(m.blocks))
        return fresh + sum(1 for b in m.blocks if self.blocks.ref_count[b] == 0)

    def admit(self, seq: Sequence, m: PrefixMatch, end: int) -> None:
        """Give ``seq`` a state slot and blocks up to position ``end``, resuming at ``m`` (restored
        snapshot, shared blocks) or from a zero state."""
        bs = self.block_size
        seq.state_slot = self.slots.allocate_one()
        for b in m.blocks:
            self.blocks.acquire(b)
        seq.block_table = list(m.blocks) + self.blocks.allocate(max(0, -(-end // bs) - len(m.blocks)))
        p = m.num_cached_tokens
        if m.snapshot is not None and self.snapshots is not None:
            self.snapshots.restore(m.snapshot, seq.state_slot, seq.block_table[p // bs] if p % bs else None)
            resumed = self.snapshots.entries[m.snapshot]
            if resumed is not None and resumed.kind in ("request_end", "preempted"):
                seq.superseded_snapshots.append(resumed.key)
        else:
            self.cache.reset_slot(seq.state_slot)
        seq.num_computed_tokens = p
        seq.num_registered_blocks = len(m.blocks)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = p
        if self.prefix is not None:
            self.queries += seq.num_tokens
            self.hits += p
            if m.snapshot is not None and self.snapshots is not None:
                self.hits_by_kind[self.snapshots.entries[m.snapshot].kind] += p  # type: ignore[union-attr]

    def plan_checkpoints(self, seq: Sequence, m: PrefixMatch) -> dict[int, str]:
        """Prefill positions past the hit where ``seq`` will leave snapshots, with their kind: the
        junction, the interval checkpoints and the prompt end."""
        if self.prefix is None:
            return {}
        p, n = m.num_cached_tokens, seq.num_tokens
        points: dict[int, str] = {}
        step = self.prefix.checkpoint_interval * self.block_size
        if step:
            points.update((c, "interval") for c in range(step * (p // step + 1), n, step))
        if n == seq.num_prompt_tokens and "prompt_end" in self.prefix.points:
            points[n] = "prompt_end"   # a re-admitted request's prompt end is long computed
        if m.junction is not None:
            points[m.junction] = "junction"
        return {c: points[c] for c in sorted(points) if c > p}

    def next_checkpoint(self, seq: Sequence) -> int | None:
        """The next position where ``seq``'s prefill must stop for a snapshot."""
        for c in seq.checkpoints:
            if c > seq.num_computed_tokens:
                return c
        return None

    def blocks_needed(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.block_size) - len(seq.block_table))

    def grow(self, seq: Sequence, end: int) -> None:
        n = self.blocks_needed(seq, end)
        if n:  # (most decode steps need none: 63 of every 64 at block size 64)
            seq.block_table.extend(self.blocks.allocate(n))

    # ------------------------------------------------------------------ after a step
    def after_step(self, seq: Sequence) -> None:
        """Register ``seq``'s newly completed blocks and take a planned snapshot if its prefill
        reached one. Called once the step's rows are final (after the MTP catch-up)."""
        if self.prefix is None or seq.state_slot is None:
            return
        ready = seq.num_computed_tokens
        if ready // self.block_size <= seq.num_registered_blocks and ready not in seq.checkpoints:
            return  # no block completed and no snapshot planned here (a decode step's usual case)
        chain = self._chain(seq)
        for k in range(seq.num_registered_blocks, min(ready // self.block_size, len(chain.keys))):
            lo, hi = chain.block_tokens_span(k)
            self.blocks.register(seq.block_table[k], chain.keys[k], chain.prefix(k), seq.tokens(lo, hi))
            seq.num_registered_blocks = k + 1
        kind = seq.checkpoints.pop(ready, None)
        if kind is not None:
            self._save(seq, ready, kind)

    def _save(self, seq: Sequence, position: int, kind: str) -> None:
        assert self.snapshots is not None
        bs, la = self.block_size, self.lookahead
        if position <= 0 or position + la > seq.num_tokens:
            return
        if kind in ("request_end", "preempted"):
            # superseded on this request's own path: its prompt-end snapshot (which only serves prompts that
            # extend this prompt without the answer) and the previous turn's end it resumed from (which only
            # serves edits of that turn) are evicted first when the pool is full
            for key in seq.superseded_snapshots:
                self.snapshots.demote(key)
        chain = self._chain(seq)
        k = position // bs
        snap = Snapshot(key=chain.snapshot_key(seq.tokens, position), position=position, chain=chain.prefix(k),
                        tokens=tuple(seq.tokens(k * bs, position + la)), kind=kind)
        before = self.snapshots.saved
        self.snapshots.save(snap, seq.state_slot, seq.block_table[k] if position % bs else None)
        if self.snapshots.saved > before:
            self.saved_by_kind[kind] += 1
        if kind == "prompt_end":
            seq.superseded_snapshots.append(snap.key)

    def release(self, seq: Sequence, snapshot: str | None = "request_end") -> None:
        """Free ``seq``'s blocks (registered ones stay cached) and slot; with ``snapshot`` (its kind:
        ``request_end`` for a finished or aborted request, ``preempted``), first save its state at its
        last computed position."""
        if self.prefix is not None and snapshot in self.prefix.points and seq.state_slot is not None:
            self.after_step(seq)
            self._save(seq, seq.num_computed_tokens, snapshot)
        if seq.block_table:
            # last block first: of a request's cached blocks, the tail (least likely shared) is evicted first
            self.blocks.free(reversed(seq.block_table))
            seq.block_table = []
        if seq.state_slot is not None:
            self.slots.free([seq.state_slot])
            seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.checkpoints = {}
