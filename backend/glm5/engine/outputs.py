"""What the engine hands back: per-request output deltas, prompt inputs, engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glm5.engine.sequence import RequestMetrics


@dataclass
class PromptInput:
    """One request's prompt: exactly one of ``text``, ``token_ids``, ``messages``, plus optional media."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    mm_inputs: dict[str, Any] | None = None  # preprocessed by the Triton `preprocess` model


@dataclass
class RequestOutput:
    request_id: str
    text: str                      # new text since the previous output
    token_ids: list[int]           # new token ids since the previous output
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[dict] | None = None
    prompt_text: str | None = None
    metrics: RequestMetrics | None = None
    stop_reason: str | int | None = None
    # every prompt token's logprob record (None for token 0), on the request's first output only
    prompt_logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0     # prompt tokens reused from the prefix cache (vLLM's name)
    error: str | None = None       # set with finish_reason "error": why the engine failed this request


@dataclass
class EngineStats:
    running: int
    waiting: int
    preempted_total: int
    aborted_total: int
    finished_total: int
    cache_usage: float          # fraction of cache blocks in use
    free_state_slots: int
    prompt_tokens_total: int
    generation_tokens_total: int
    failed_total: int = 0       # requests failed by an engine step (finish_reason "error")
    encoder_cache_hits: int = 0
    vision_calls: int = 0
    # prefix caching, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): looked up at admissions,
    # and of those found in the cache
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding (None when off): SpecStats.to_dict()
    speculative: dict | None = None


@dataclass
class CompletionOutput:
    """Offline result of :meth:`LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict | None] | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
