"""vllm_backend's output conventions, Triton-independent (``backend/model.py`` turns them into tensors).

vllm_backend (``src/utils/request.py`` ``create_response``) answers with one element per output
sequence in every output tensor, and a request with ``n`` > 1 has ``n`` sequences:

* ``text_output``: the text each sequence produced since the previous response (the prompt is
  prepended to every sequence of a non-streamed response unless ``exclude_input_in_output``);
* ``finish_reason``: ``str(output.finish_reason)``, i.e. ``"None"`` for a sequence that is still
  running and ``"stop"`` / ``"length"`` / ``"abort"`` once it finished;
* ``cumulative_logprob``: the sum of the sampled tokens' logprobs so far (FP32);
* ``logprobs``: a JSON list, one entry per token new in this response, each a dict from the token id
  (a JSON string key) to ``{"logprob", "rank", "decoded_token"}`` holding the sampled token and the
  requested top alternatives; ``"null"`` when no logprobs were computed;
* ``num_output_tokens``: the tokens each sequence produced since the previous response;
  ``num_input_tokens``: the prompt length (one value).

:class:`SequenceSet` keeps that per-sequence state while the engine's outputs for the ``n``
sequences of one request arrive in any order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

#: What vllm_backend sends as ``finish_reason`` for a sequence that has not finished.
RUNNING_FINISH_REASON = "None"


def finish_reason_text(reason: str | None) -> str:
    """``str(reason)`` as vllm_backend sends it (``"None"`` while the sequence runs)."""
    return RUNNING_FINISH_REASON if reason is None else str(reason)


def vllm_logprob_entries(records: Iterable[dict], decode: Callable[[int], str]) -> list[dict[str, dict]]:
    """Engine logprob records (``token_id``, ``logprob``, ``rank``, ``top``) in vLLM's shape.

    Each token becomes ``{str(token_id): {"logprob", "rank", "decoded_token"}}`` with the sampled
    token first, then the top alternatives by rank (a sampled token that is also among the top keeps
    its entry); ``decoded_token`` is ``decode(token_id)`` (vLLM decodes each token on its own).
    """
    out = []
    for rec in records:
        d: dict[str, dict] = {str(rec["token_id"]): {"logprob": rec["logprob"], "rank": rec["rank"],
                                                     "decoded_token": decode(rec["token_id"])}}
        for rank, (tok, lp) in enumerate(rec.get("top") or (), start=1):
            d.setdefault(str(tok), {"logprob": lp, "rank": rank, "decoded_token": decode(tok)})
        out.append(d)
    return out


def vllm_prompt_logprobs(records: list[dict | None], decode: Callable[[int], str]) -> list[dict | None]:
    """Prompt logprob records in vLLM's ``RequestOutput.prompt_logprobs`` shape (``None`` first)."""
    return [None if r is None else vllm_logprob_entries([r], decode)[0] for r in records]


@dataclass
class SequenceState:
    """One output sequence of a request: what was produced and what is not yet sent."""

    text: str = ""
    pending_text: str = ""
    num_tokens: int = 0
    pending_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    pending_logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    finished: bool = False
    has_logprobs: bool = False


@dataclass
class SequenceSet:
    """The ``n`` (or ``best_of``) sequences of one request, fed with engine outputs in any order."""

    size: int
    seqs: list[SequenceState] = field(init=False)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    prompt_text: str | None = None
    metrics: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.seqs = [SequenceState() for _ in range(self.size)]

    def add(self, index: int, out: Any) -> None:
        """Record one engine ``RequestOutput`` of sequence ``index``."""
        s = self.seqs[index]
        s.text += out.text
        s.pending_text += out.text
        n = len(out.token_ids)
        s.num_tokens += n
        s.pending_tokens += n
        if out.logprobs is not None:
            s.has_logprobs = True
            s.logprobs.extend(out.logprobs)
            s.pending_logprobs.extend(out.logprobs)
            s.cumulative_logprob += sum(float(r["logprob"]) for r in out.logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, int(getattr(out, "num_cached_tokens", 0) or 0))
        if getattr(out, "prompt_logprobs", None) is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.prompt_text is not None and self.prompt_text is None:
            self.prompt_text = out.prompt_text
        if out.finished:
            s.finished, s.finish_reason = True, out.finish_reason
            if getattr(out, "metrics", None) is not None:
                self.metrics.append((out.metrics, out.num_prompt_tokens, s.num_tokens, out.finish_reason))

    def take_prompt_logprobs(self) -> bool:
        """True once, when the prompt logprobs have arrived and were not sent yet."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return False
        self.prompt_logprobs_sent = True
        return True

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def has_news(self) -> bool:
        return any(s.pending_tokens or s.pending_text for s in self.seqs)

    def best(self, n: int) -> list[int]:
        """Indices of the ``n`` sequences with the highest cumulative logprob (``best_of``), in that order."""
        order = sorted(range(self.size), key=lambda i: -self.seqs[i].cumulative_logprob)
        return order[:n]

    def take(self, indices: list[int] | None = None, *, whole: bool = False) -> list[dict[str, Any]]:
        """Per selected sequence: text / tokens / logprobs since the last ``take`` (or everything
        when ``whole``), cumulative logprob and finish reason; resets the pending parts."""
        rows = []
        for i in indices if indices is not None else range(self.size):
            s = self.seqs[i]
            rows.append({"text": s.text if whole else s.pending_text,
                         "num_tokens": s.num_tokens if whole else s.pending_tokens,
                         "logprobs": (s.logprobs if whole else s.pending_logprobs) if s.has_logprobs else None,
                         "cumulative_logprob": s.cumulative_logprob,
                         "finish_reason": s.finish_reason if s.finished else None})
            s.pending_text, s.pending_tokens, s.pending_logprobs = "", 0, []
        return rows


def logprobs_json(entries: list[dict] | None) -> str:
    """One sequence's ``logprobs`` element: the JSON list, or ``"null"`` (vllm_backend's value)."""
    return "null" if entries is None else json.dumps(entries)
