"""Continuous batching with chunked prefill and recompute preemption.

Each step packs, in FCFS order, every running request's next tokens (one decode token, or the next
prefill chunk), then admits waiting requests while the token budget (``max_num_batched_tokens``),
the sequence budget (``max_num_seqs``), free state slots and free cache blocks allow. When a
running request needs a block and none is free, the newest running request is preempted: its
blocks and state slot are freed and it goes back to the front of the waiting queue, to be
recomputed later from its prompt plus the tokens it already produced (identical output, because
sampling state — the generator — lives on the request, not in the cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from glm5.cache.allocator import BlockAllocator, SlotAllocator
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


class Scheduler:
    def __init__(self, blocks: BlockAllocator, slots: SlotAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, on_slot_allocated=None):
        self.blocks, self.slots = blocks, slots
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_slot_allocated = on_slot_allocated or (lambda slot: None)
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

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its cache at once (used for stop, length and abort)."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def evict(self, seq: Sequence) -> None:
        """Free a request's cache and take it off both queues, keeping its tokens (the engine re-queues it
        after a failed step: its states are recomputed from its tokens, as after a preemption)."""
        self._release(seq)
        seq.draft_tokens, seq.draft_probs = [], None
        seq.status = SeqStatus.WAITING
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0

    def ensure_blocks(self, seq: Sequence, num_positions: int) -> bool:
        """Make ``seq``'s block table cover ``num_positions`` positions if blocks are free (MTP drafts)."""
        need = max(0, -(-num_positions // self.block_size) - len(seq.block_table))
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self._release(seq)
        seq.draft_tokens, seq.draft_probs = [], None
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
            drafts = len(seq.draft_tokens) if pending == 1 else 0
            drafts = min(drafts, budget - 1)
            n = min(pending, budget) + drafts
            need = self._blocks_needed(seq, n)
            if drafts and need > self.blocks.num_free:  # drop the speculation before preempting anyone
                n, drafts = n - drafts, 0
                need = self._blocks_needed(seq, n)
            while need > self.blocks.num_free and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
            if need > self.blocks.num_free:  # it is the newest itself: give way
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            seq.block_table.extend(self.blocks.allocate(need))
            out.chunks.append(ScheduledChunk(seq, n, drafts))
            budget -= n
            i += 1
        # admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.slots.num_free:
            seq = self.waiting[0]
            n = min(seq.num_tokens, budget)
            need = self._blocks_needed(seq, n)
            if need > self.blocks.num_free:
                break
            self.waiting.popleft()
            seq.state_slot = self.slots.allocate()
            self.on_slot_allocated(seq.state_slot)
            seq.block_table = self.blocks.allocate(need)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return out
