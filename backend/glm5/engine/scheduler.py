"""Continuous batching with chunked prefill and recompute preemption.

Each step packs, in FCFS order, every running request's next tokens (one decode token, or the next
prefill chunk), then admits waiting requests while the token budget (``max_num_batched_tokens``),
the sequence budget (``max_num_seqs``), free state slots and free cache blocks allow. When a
running request needs a block and none is free, the newest running request is preempted: its
blocks and state slot are freed and it goes back to the front of the waiting queue, to be
recomputed later from its prompt plus the tokens it already produced (identical output, because
sampling state — the generator — lives on the request, not in the cache).

With prefix caching an admission starts at the request's longest cached prefix
(:meth:`KVCacheManager.match`), and a preempted request leaves a snapshot behind, so that its
re-admission goes through the cache too. A prefill chunk never runs past a planned snapshot
position (:meth:`KVCacheManager.next_checkpoint`): the state there must exist after some step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from glm5.engine.kv_cache_manager import KVCacheManager
from glm5.engine.sequence import Sequence, SeqStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int       # rows this step, drafts included
    num_drafts: int = 0   # speculative rows after the last accepted token (verification)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token, so its logits give a new token."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_drafts == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def decode_only(self) -> bool:
        """Every chunk is one request's next token plus its drafts (no prompt chunk)."""
        return all(c.num_tokens == 1 + c.num_drafts for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.blocks, self.slots = kv.blocks, kv.slots
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: str, release: bool = True) -> None:
        """Mark finished and (unless ``release`` is False) release its cache at once (stop, length,
        abort). The engine defers the release of requests that finish inside a step until the step's
        rows are final, so that their end state can be snapshotted (:meth:`release_finished`)."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        if release:
            self.kv.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def release_finished(self, seq: Sequence, snapshot: bool = True) -> None:
        """Release a request finished with ``release=False`` (snapshotting its end state unless told not to)."""
        self.kv.release(seq, snapshot="request_end" if snapshot else None)

    def evict(self, seq: Sequence) -> None:
        """Free a request's cache and take it off both queues, keeping its tokens (the engine re-queues it
        after a failed step: its states are recomputed from its tokens, as after a preemption). No
        snapshot: the failed step may have half-written its states."""
        self.kv.release(seq, snapshot=None)
        seq.forget_speculation()
        seq.status = SeqStatus.WAITING
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def ensure_blocks(self, seq: Sequence, num_positions: int) -> bool:
        """Make ``seq``'s block table cover ``num_positions`` positions if blocks are free (MTP drafts)."""
        if self.kv.blocks_needed(seq, num_positions) > self.blocks.num_free:
            return False
        self.kv.grow(seq, num_positions)
        return True

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.kv.blocks_needed(seq, seq.num_computed_tokens + num_tokens)

    def _chunk(self, seq: Sequence, pending: int, budget: int) -> int:
        """Rows of ``seq``'s next prefill chunk: the budget's share, stopping at a planned snapshot."""
        n = min(pending, budget)
        stop = self.kv.next_checkpoint(seq)
        if stop is not None and seq.num_computed_tokens < stop < seq.num_computed_tokens + n:
            n = stop - seq.num_computed_tokens
        return n

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self.kv.release(seq, snapshot="preempted")  # its re-admission resumes there if the blocks survive
        seq.forget_speculation()
        seq.status = SeqStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # running requests first, oldest first; preempt from the newest end when blocks run out
        self.running.sort(key=lambda s: s.arrival_order)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_tokens - seq.num_computed_tokens
            drafts = seq.num_draft_tokens if pending == 1 else 0
            drafts = min(drafts, budget - 1)
            n = self._chunk(seq, pending, budget) + drafts
            need = self._blocks_needed(seq, n)
            if drafts and need > self.blocks.num_free:  # drop the speculation before preempting anyone
                n, drafts = n - drafts, 0
                need = self._blocks_needed(seq, n)
            while need and need > self.blocks.num_free and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
            if need and need > self.blocks.num_free:  # it is the newest itself: give way
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            self.kv.grow(seq, seq.num_computed_tokens + n)
            out.chunks.append(ScheduledChunk(seq, n, drafts))
            budget -= n
            i += 1
        # admit waiting requests, each from its longest cached prefix
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.slots.num_free:
            seq = self.waiting[0]
            match = self.kv.match(seq)
            seq.num_computed_tokens = match.num_cached_tokens
            seq.checkpoints = self.kv.plan_checkpoints(seq, match)
            n = self._chunk(seq, seq.num_tokens - match.num_cached_tokens, budget)
            if self.kv.admission_cost(seq, match, match.num_cached_tokens + n) > self.blocks.num_free:
                seq.num_computed_tokens, seq.checkpoints = 0, {}
                break
            self.waiting.popleft()
            self.kv.admit(seq, match, match.num_cached_tokens + n)
            seq.status = SeqStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return out
