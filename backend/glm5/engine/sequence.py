"""A request inside the engine: its tokens, cache ownership, sampling state and timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from glm5.cache.prefix_keys import MediaSpan, TokenChain
from glm5.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class MultiModalData:
    """Vision inputs of one request and where their embeddings go in the prompt."""

    pixel_values: torch.Tensor | None = None        # images, [N, C·t·p·p]
    image_grid_thw: torch.Tensor | None = None      # [n_img, 3]
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    image_positions: torch.Tensor | None = None     # prompt positions of image placeholders
    video_positions: torch.Tensor | None = None
    embeds: torch.Tensor | None = None              # filled by the runner: [M, H], rows in ``positions`` order
    positions: torch.Tensor | None = None           # all placeholder positions, sorted
    # per image / video, in tower order (images, then videos): content hash and placeholder span; the
    # encoder cache and the prefix cache's block keys both use them (computed once, at add_request)
    item_hashes: list[str] | None = None
    spans: list[MediaSpan] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_order: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    mm: MultiModalData | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    # per-output-token logprob records (when params.logprobs is set)
    logprobs: list[dict] = field(default_factory=list)
    # per-prompt-token logprob records (params.prompt_logprobs; None for token 0); see engine.prompt_logprobs
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    # params.bad_words as token sequences (tokenized at admission; glm5.sampler.bad_word_token_ids)
    bad_words_token_ids: list[list[int]] | None = None
    # speculative decoding: drafts proposed for the next step (``draft_tokens``, below: kept as a list, or as a
    # row of a batched proposal still on its way to the host) and the distributions they came from
    _draft_list: list[int] = field(default_factory=list, repr=False)
    _draft_pending: tuple | None = field(default=None, repr=False)   # (HostCopy, row, count)
    draft_probs: torch.Tensor | None = None
    spec_stats: object | None = None
    # prefix caching (glm5.engine.kv_cache_manager)
    num_cached_tokens: int | None = None        # tokens reused at the first admission (None: not admitted yet)
    prefix_chain: TokenChain | None = None       # chained block keys of the tokens so far
    num_registered_blocks: int = 0               # leading blocks of block_table that are registered / shared
    checkpoints: dict[int, str] = field(default_factory=dict)  # prefill positions where a snapshot is planned → kind
    # snapshots on this request's own path that its request-end snapshot supersedes (evicted first)
    superseded_snapshots: list[bytes] = field(default_factory=list)
    # batched speculation: the seed of the request's counter-based random streams (glm5.engine.spec_sampling)
    # and the target hidden rows the MTP layer has not seen yet (glm5.engine.spec_batched.MTPBacklog)
    noise_seed: int = 0
    mtp_backlog: object | None = None
    # the MTP layer stopped following this request: its backlog filled while speculation could not pay at the
    # running batch size, or the policy held no rows back (AdaptiveK.holds_mtp), so its MTP cache has a gap and
    # it drafts no more (until its caches are freed for a recompute: forget_speculation)
    mtp_off: bool = False

    def forget_speculation(self) -> None:
        """Drop what speculation keeps for the request's cached rows (drafts, the MTP backlog, the dropped-MTP
        mark) when its caches are freed for a recompute (preemption, or eviction after a failed step): its
        states are rebuilt from its tokens, the MTP layer's with them, so rows held back before would be
        replayed at positions the rebuilt request no longer has."""
        self.draft_tokens, self.draft_probs = [], None
        self.mtp_backlog, self.mtp_off = None, False

    @property
    def draft_tokens(self) -> list[int]:
        """The drafts proposed for the next step. Reading them waits for a pending proposal's copy to the host
        (:meth:`set_pending_drafts`); ``num_draft_tokens`` and ``pending_drafts`` do not."""
        if self._draft_pending is not None:
            copy, row, count = self._draft_pending
            self._draft_list = copy.tolist()[row][:count]
            self._draft_pending = None
        return self._draft_list

    @draft_tokens.setter
    def draft_tokens(self, tokens: list[int]) -> None:
        self._draft_list, self._draft_pending = tokens, None

    def set_pending_drafts(self, copy, row: int, count: int) -> None:
        """The first ``count`` values of row ``row`` of ``copy`` (a :class:`~glm5.layers.batch.HostCopy` of a
        batched proposal) are this request's drafts: the next verification reads them on the device, and the
        host waits for them only where it reads ``draft_tokens``."""
        self._draft_list, self._draft_pending = [], (copy, row, count)

    @property
    def pending_drafts(self) -> tuple | None:
        """``(HostCopy, row)`` while the drafts are a row of a batched proposal not read on the host yet."""
        return None if self._draft_pending is None else self._draft_pending[:2]

    @property
    def num_draft_tokens(self) -> int:
        return self._draft_pending[2] if self._draft_pending is not None else len(self._draft_list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``start .. end-1`` (prompt, then output), without copying the rest."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
