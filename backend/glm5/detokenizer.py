"""Streaming-safe incremental detokenization, stop strings and finish reasons.

Three layers, each usable alone:

* :class:`IncrementalDetokenizer` turns token ids into text deltas. It decodes only a small
  window per call: the tokens since the last emitted delta plus the tokens of that previous
  delta as left context (vLLM's prefix-offset / read-offset scheme); the delta is the window's
  text minus the context's text decoded on its own. Context matters for decoders whose output depends on what precedes a
  token (e.g. a SentencePiece/Metaspace decoder strips the leading space of the first token).
  A byte-level BPE splits one emoji or CJK character over several tokens, and decoding a prefix
  of its bytes yields U+FFFD, so text is emitted only up to the last token boundary where the
  decoded text does not end in U+FFFD; the tokens of the incomplete character stay pending.
  Pending tokens can only pile up when the bytes are genuinely invalid (or in a pathological
  run of tokens that each straddle a character boundary); after ``MAX_PENDING_TOKENS`` they are
  emitted as U+FFFD so the work per call stays bounded.
* :class:`StopChecker` finds stop strings across delta boundaries, never emits text that could
  still become the start of a stop string (it holds back the longest suffix that is a proper
  prefix of a stop string, emitted as soon as the next text rules the stop string out),
  truncates at the match (the stop string itself is excluded unless
  ``include_stop_str_in_output``) and reports which stop string matched. When several match,
  the one that *ends* first wins (what token-by-token streaming would have seen first), then the
  one that starts first.
* :class:`RequestOutputProcessor` combines both with token-level stopping for one request:
  EOS (unless ``ignore_eos``) and ``stop_token_ids`` finish with ``"stop"`` and their text is
  not part of the output (a stop token's text is included when ``include_stop_str_in_output``),
  ``max_tokens`` finishes with ``"length"``. Stops are active only once more than
  ``min_tokens`` tokens exist (the sampler already masks EOS/stop ids before that; stop strings
  are searched only in text produced after that point).

Decoding always passes ``clean_up_tokenization_spaces=False``: that cleanup is a lossy,
English-specific heuristic that is not stable under streaming.

With a fast HF tokenizer (one backed by a ``tokenizers.Tokenizer``) the detokenizer steps the library's own
streaming decoder (``tokenizers.decoders.DecodeStream``, the same prefix / read-offset scheme in Rust, one call
per token) and keeps the window bookkeeping above only for what that decoder does not do: emitting genuinely
invalid bytes after ``MAX_PENDING_TOKENS``, :meth:`IncrementalDetokenizer.flush`, a prompt whose text ends
mid-character (the library decoder would take none of it as context) and a decoder whose text stops extending
its prefix (the library raises; the window path cuts by length). The window path's two HF
``decode`` calls per token run on the host between decode steps, for every request of the batch: about five
times the stream's cost per token (18 against 3.8 µs in one run) on the project's 2-core CPU machine with the
tiny checkpoint's tokenizer and the README's text (``bench/host_cost.py``, ``bench/results/host_cost_cpu.json``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, Sequence

from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the window decoder alone
    _RustTokenizer = _DecodeStream = None

#: Prompt tokens decoded as left context for the first output token.
INITIAL_CONTEXT_TOKENS = 5

#: Held-back tokens after which text still ending in U+FFFD is emitted anyway (invalid bytes).
MAX_PENDING_TOKENS = 32

_REPLACEMENT_CHAR = "\ufffd"


class FinishReason(str, Enum):
    """Why a request finished (the strings clients see; vLLM/OpenAI vocabulary)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the engine

    def __str__(self) -> str:
        return self.value


class SupportsDecode(Protocol):
    """The part of an HF tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> Any: ...


class IncrementalDetokenizer:
    """Per-request streaming decoder of output tokens (see the module docstring).

    ``add_tokens`` returns the new text; the concatenation of all deltas plus :meth:`flush`
    equals ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    for tokenizers whose decoding is context-free beyond the window (byte-level BPE is).
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the last few prompt tokens are kept: they are the context of the first delta.
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]) if INITIAL_CONTEXT_TOKENS else []
        # ``_ids`` = context tokens (``[:_read_offset]``: the last emitted delta's tokens, or the
        # prompt's tail) + pending tokens; never the whole sequence.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix: str | None = None  # the context decoded on its own, computed when the window path runs
        self.output_token_ids: list[int] = []
        self.output_text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if _DecodeStream is not None and isinstance(backend, _RustTokenizer) else None
        # the library's streaming decoder, its context the prompt's tail as the window's. The window path stays
        # for a context whose text ends mid-character (a prompt cut inside a character, garbled text: the stream
        # would ignore that context and emit its text as output) and for a DecodeStream without context ids.
        self._stream = None
        if self._backend is not None and not self._backend.decode(
                context, skip_special_tokens=self._skip).endswith(_REPLACEMENT_CHAR):
            try:
                self._stream = _DecodeStream(ids=context, skip_special_tokens=self._skip)
            except TypeError:
                pass
        if self._stream is None:
            self._backend = None

    @property
    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._ids[: self._read_offset])
        return self._prefix

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False))

    @property
    def num_pending_tokens(self) -> int:
        """Tokens received but not yet reflected in ``output_text`` (incomplete UTF-8)."""
        return len(self._ids) - self._read_offset

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens and return the newly completed text (possibly ``""``)."""
        new = list(new_token_ids)
        if not new:
            return ""
        if self._stream is None:
            self.output_token_ids.extend(new)
            self._ids.extend(new)
            return self._advance(force=False)
        out = []
        for i, tok in enumerate(new):
            self.output_token_ids.append(tok)
            self._ids.append(tok)
            try:
                chunk = self._stream.step(self._backend, tok)
                # genuinely invalid bytes piling up: the window path emits them (a stream restarted on a
                # context that ends mid-character would re-emit that context)
                fallback = chunk is None and self.num_pending_tokens > MAX_PENDING_TOKENS
            except Exception as e:  # the decoded text stopped extending the stream's prefix (InvalidPrefix)
                logger.debug("detokenizer: %s; the window path takes over", e)
                chunk, fallback = None, True
            if fallback:  # the window path keeps the request from here on
                out.append(self._advance(force=False))
                self._stream = self._backend = None
                out.append(self.add_tokens(new[i + 1:]))
                break
            if chunk is None:  # an incomplete character: pending
                continue
            # everything up to this token is out: those tokens become the window's context
            self._ids = self._ids[self._read_offset :]
            self._read_offset = len(self._ids)
            self._prefix = None
            self.output_text += chunk
            out.append(chunk)
        return "".join(out)

    def flush(self) -> str:
        """Emit held-back text (U+FFFD included) at the end of the request."""
        if self.num_pending_tokens == 0:
            return ""
        return self._advance(force=True)

    def _advance(self, *, force: bool) -> str:
        ids = self._ids
        end = len(ids)
        window = self._decode(ids)
        if not force and window.endswith(_REPLACEMENT_CHAR):
            if self.num_pending_tokens > MAX_PENDING_TOKENS:
                logger.debug("detokenizer: %d tokens still end in U+FFFD; emitting invalid bytes", self.num_pending_tokens)
            else:
                # Emit up to the last token boundary that ends on a complete character. The
                # incomplete character (<= 3 bytes so far) lies in the last 3 tokens, so only
                # those boundaries are tried; the tokens after the cut stay pending.
                for k in range(end - 1, max(self._read_offset, end - 4), -1):
                    text = self._decode(ids[:k])
                    if not text.endswith(_REPLACEMENT_CHAR):
                        window, end = text, k
                        break
                else:
                    return ""
        if not window.startswith(self._prefix_text):
            # The context decoded differently once extended; cut by length as the best guess.
            logger.debug("detokenizer context changed: %r -> %r", self._prefix_text, window)
        delta = window[len(self._prefix_text) :]
        # Slide the window: the tokens just emitted become the next call's context, and the
        # list is trimmed so memory and work stay proportional to the new tokens.
        self._ids = ids[self._read_offset :]
        self._read_offset = end - (len(ids) - len(self._ids))
        # The context text must be decoded exactly as the next window will start (without any
        # left context of its own), which can differ from ``delta`` (e.g. a Metaspace decoder
        # drops the leading space of the first token).
        self._prefix = self._decode(self._ids[: self._read_offset])
        self.output_text += delta
        return delta


class StopChecker:
    """Incremental stop-string matcher with hold-back (see the module docstring)."""

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = list(dict.fromkeys(stop))
        self.include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        # Proper prefixes of all stop strings, for the hold-back test.
        self._prefixes = {s[:k] for s in self.stop for k in range(1, len(s))}
        self._tail = ""  # last (max_len - 1) chars already emitted
        self._held = ""  # text received but not emitted (a possible stop-string start)

    @property
    def held_text(self) -> str:
        """Text currently held back (emitted by :meth:`flush` if no stop string follows)."""
        return self._held

    def process(self, text: str) -> tuple[str, str | None]:
        """Feed new text; return ``(text to emit now, matched stop string or None)``.

        After a match the request is finished: the caller must not feed more text.
        """
        if not self.stop:
            return text, None
        window = self._tail + self._held + text
        old = len(self._tail) + len(self._held)  # every match must end after this position
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = window.find(s, max(0, old - len(s) + 1))
            if start >= 0:
                key = (start + len(s), start, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            end, start, s = best
            cut = end if self.include else start
            emit = window[len(self._tail) : max(cut, len(self._tail))]
            self._held = ""
            return emit, s
        hold = 0
        if not self.include:
            pending = len(self._held) + len(text)
            for k in range(min(self._max_len - 1, pending), 0, -1):
                if window[-k:] in self._prefixes:
                    hold = k
                    break
        emit_end = len(window) - hold
        emit = window[len(self._tail) : emit_end]
        self._held = window[emit_end:]
        if self._max_len > 1:
            self._tail = (self._tail + emit)[-(self._max_len - 1) :]
        return emit, None

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        held, self._held = self._held, ""
        return held


@dataclass
class StepOutput:
    """What one :meth:`RequestOutputProcessor.add_tokens` call produced.

    ``num_accepted``: how many of the given tokens belong to the output (tokens after a
    finishing token, e.g. the rest of a speculative-decoding chunk, are dropped; the finishing
    token itself counts). ``stop_reason``: the matched stop string or stop token id; ``None`` for
    EOS, length or unfinished.
    """

    text: str
    num_accepted: int
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutputProcessor:
    """Tokens in, text deltas and finish reason out, for one request.

    Args:
        tokenizer: HF tokenizer (``PreTrainedTokenizerFast``) or anything with ``decode``.
        prompt_token_ids: the request's prompt (context for the first delta).
        params: the request's sampling parameters.
        eos_token_ids: the model's EOS ids (GLM-5 has several).
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.params = params
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopChecker(params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        self._emitted: list[str] = []   # the deltas emitted so far (one join when asked: no copy of the text per step)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    def add_tokens(self, new_token_ids: Sequence[int]) -> StepOutput:
        """Process newly sampled tokens in order, stopping at the first finishing one."""
        if self.finish_reason is not None:
            raise RuntimeError(f"request already finished ({self.finish_reason}); no more tokens may be added")
        p = self.params
        parts: list[str] = []
        accepted = 0
        for tok in new_token_ids:
            self.output_token_ids.append(tok)
            accepted += 1
            n = len(self.output_token_ids)
            stops_active = n > p.min_tokens
            is_eos = stops_active and not p.ignore_eos and tok in self._eos
            is_stop_id = stops_active and tok in self._stop_ids
            if is_eos or is_stop_id:
                if is_stop_id and p.include_stop_str_in_output:
                    parts.append(self._feed_text(self.detok.add_tokens([tok]), stops_active))
                    if self.finish_reason is not None:
                        break
                parts.append(self._finish_flush())
                self.finish_reason = FinishReason.STOP
                self.stop_reason = tok if is_stop_id else None
                break
            parts.append(self._feed_text(self.detok.add_tokens([tok]), stops_active))
            if self.finish_reason is not None:
                break
            if n >= p.max_tokens:
                parts.append(self._finish_flush())
                self.finish_reason = FinishReason.LENGTH
                break
        text = "".join(parts)
        if text:
            self._emitted.append(text)
        return StepOutput(text=text, num_accepted=accepted, finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def abort(self) -> StepOutput:
        """Finish with ``"abort"``; held-back text is dropped (the client stopped listening)."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT
        return StepOutput(text="", num_accepted=0, finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def _feed_text(self, delta: str, stops_active: bool) -> str:
        if not stops_active:
            # Stop strings are searched only after min_tokens; nothing before is held back.
            return delta
        emit, matched = self.stops.process(delta)
        if matched is not None:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = matched
        return emit

    def _finish_flush(self) -> str:
        """Text still held (partial UTF-8, possible stop prefix) at a non-stop-string finish."""
        tail = self.detok.flush()
        if tail:
            emit, matched = self.stops.process(tail) if len(self.output_token_ids) > self.params.min_tokens else (tail, None)
            if matched is not None:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = matched
                return emit
            return emit + self.stops.flush()
        return self.stops.flush()
