"""Triton-independent parsing of glm5 model requests (unit-testable without a server).

``backend/model.py`` reads the tensors with ``pb_utils`` and hands plain Python values to these
functions, which either return clean values or raise ``RequestError`` with a message that names
the bad input and how to fix it (it becomes an ``INVALID_ARG`` response).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

#: Request parameters that Triton or its clients add and that are not sampling parameters (2.51's HTTP
#: ``/generate`` also hands the request's top-level ``id`` to the model as a parameter).
RESERVED_PARAMETERS = frozenset({"sequence_id", "priority", "timeout", "sequence_start", "sequence_end",
                                 "headers", "id"})

_B64_RE = re.compile(rb"^[A-Za-z0-9+/_\-=\s]+$")


class RequestError(ValueError):
    """A request input is invalid; the message says which and why."""


class DuplicateRequestIdError(RequestError):
    """A request reuses the id of a request that is still running (Triton ``ALREADY_EXISTS``)."""


def decode_media_item(item: bytes | str, *, name: str, index: int) -> bytes:
    """Return the encoded file bytes of one ``image``/``video`` element.

    gRPC clients send raw file bytes; HTTP ``/generate`` can only carry JSON strings, so those are
    base64 (optionally a ``data:<mime>;base64,`` URL). Raw image/video files always contain bytes
    outside the base64 alphabet (magic numbers such as ``\\x89PNG``/``\\xff\\xd8``), so an element
    made only of base64 characters is decoded and anything else is taken as raw bytes.
    """
    data = item.encode() if isinstance(item, str) else bytes(item)
    if not data:
        raise RequestError(f"{name}[{index}] is empty; send the encoded file bytes (or base64 over HTTP)")
    stripped = data.strip()
    if stripped.startswith(b"data:"):
        head, sep, payload = stripped.partition(b",")
        if not sep or b";base64" not in head:
            raise RequestError(f"{name}[{index}] is a data URL without ';base64,' payload")
        stripped = payload
    elif not _B64_RE.match(stripped):
        return data
    try:
        compact = re.sub(rb"\s+", b"", stripped)
        if b"-" in compact or b"_" in compact:
            return base64.urlsafe_b64decode(compact + b"=" * (-len(compact) % 4))
        return base64.b64decode(compact + b"=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{name}[{index}] looks like base64 but does not decode ({exc}); send raw "
                           "bytes over gRPC or valid base64 over HTTP") from exc


def parse_json_object(text: str | bytes | None, *, name: str) -> dict[str, Any]:
    """Parse a JSON object input (``sampling_parameters``); empty/absent gives ``{}``."""
    if text is None:
        return {}
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not text.strip():
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{name} is not valid JSON ({exc.msg} at position {exc.pos}): "
                           f"{text[:80]!r}") from exc
    if not isinstance(obj, dict):
        raise RequestError(f"{name} must be a JSON object like {{\"max_tokens\": 64}}, got {type(obj).__name__}")
    return obj


def request_parameters(params_json: str | None) -> dict[str, Any]:
    """Sampling parameters from ``request.parameters()`` (HTTP ``parameters``), minus reserved keys."""
    params = parse_json_object(params_json, name="request parameters")
    return {k: v for k, v in params.items() if k not in RESERVED_PARAMETERS and not k.startswith("triton_")}


def check_finite_numbers(params: dict[str, Any]) -> None:
    """Reject NaN/inf floats early: JSON accepts ``NaN`` and they would poison sampling."""
    for k, v in params.items():
        f = None
        if isinstance(v, float):
            f = v
        elif isinstance(v, str):
            try:
                f = float(v)
            except ValueError:
                continue
        if f is not None and not math.isfinite(f):
            raise RequestError(f"sampling parameter {k}={v!r} is not a finite number")


def parse_messages(text: str | bytes | None) -> list[dict[str, Any]] | None:
    """Validate the ``messages`` input: a JSON list of ``{"role", "content"}`` chat messages."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"messages is not valid JSON ({exc.msg} at position {exc.pos})") from exc
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty JSON list of {\"role\": .., \"content\": ..} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content', got {m!r:.80}")
        c = m["content"]
        if not isinstance(c, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") not in ("text", "image", "video"):
                    raise RequestError(f"messages[{i}].content[{j}] must be a part of type text, image "
                                       f"or video, got {part!r:.80}")
    return msgs


@dataclass
class OutputFlags:
    """Which optional outputs a request asked for, and how text is returned."""

    stream: bool = False
    prepend_input: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    return_num_cached_tokens: bool = False
    # what non-streaming responses prepend: ``text_input`` when the request has one (vllm_backend's
    # rule, the same on the direct and the ensemble path), else the engine's rendered prompt
    prompt_prefix: str | None = None


def output_flags(stream: bool | None, exclude_input_in_output: bool | None, **returns: bool | None) -> OutputFlags:
    """Resolve vllm_backend's conventions: without streaming the prompt is prepended unless
    ``exclude_input_in_output`` is true; streaming with an explicit ``false`` is rejected
    (deltas cannot meaningfully start with the whole prompt)."""
    s = bool(stream)
    if exclude_input_in_output is None:
        prepend = not s
    else:
        prepend = not exclude_input_in_output
    if s and prepend:
        raise RequestError("exclude_input_in_output=false is not supported with stream=true; "
                           "omit it or set it to true")
    return OutputFlags(stream=s, prepend_input=prepend, **{k: bool(v) for k, v in returns.items()})


def check_sequences(params: Any, flags: OutputFlags) -> None:
    """``best_of`` > ``n`` picks the best candidates at the end, so it cannot stream (vLLM's rule)."""
    if params.num_sequences > params.n and flags.stream:
        raise RequestError(f"best_of={params.best_of} > n={params.n} ranks the candidates when they finish and "
                           "cannot stream; set stream=false or best_of=n")


#: Accepted length of a ``stop_key``: long enough that it cannot be guessed when random.
STOP_KEY_MIN_LEN = 16
STOP_KEY_MAX_LEN = 256


def check_stop_key(key: str | None) -> str | None:
    """Validate an optional ``stop_key`` input (None: the request cannot be stopped by a stop request)."""
    if key is None or key == "":
        return None
    if not STOP_KEY_MIN_LEN <= len(key) <= STOP_KEY_MAX_LEN:
        raise RequestError(f"stop_key has {len(key)} characters; use {STOP_KEY_MIN_LEN} to {STOP_KEY_MAX_LEN} "
                           "random characters (e.g. secrets.token_hex(16))")
    return key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass
class _Live:
    engine_id: str
    key_digest: bytes | None


@dataclass
class LiveRequests:
    """Running requests by client request id, with the ownership rule of ``stop`` requests.

    Triton 2.51 tells a model nothing about who sent a request (no connection or stream identity),
    so ownership is a secret: a request that may later be stopped carries a ``stop_key`` it chose,
    and a stop request must name the same request id *and* present the same key. Only a digest of
    the key is kept and compared in constant time. A request id is live from admission until its
    final response is queued; a second request with a live id is refused, so one id always names at
    most one request and a stop aborts at most one. Requests without an id are not registered.
    """

    active: dict[str, _Live] = field(default_factory=dict)

    def register(self, client_id: str, engine_id: str, stop_key: str | None) -> None:
        if not client_id:
            return
        if client_id in self.active:
            raise DuplicateRequestIdError(f"request id {client_id!r} belongs to a request that is still running; "
                                          "use a unique id per request (e.g. a UUID)")
        self.active[client_id] = _Live(engine_id, None if stop_key is None else _digest(stop_key))

    def release(self, client_id: str, engine_id: str) -> None:
        live = self.active.get(client_id)
        if live is not None and live.engine_id == engine_id:
            del self.active[client_id]

    def authorize_stop(self, client_id: str, stop_key: str) -> str | None:
        """The engine id a stop request may abort, or None (unknown id, no key on the request, wrong key:
        indistinguishable to the caller, so a stop request cannot probe which ids are running)."""
        live = self.active.get(client_id)
        if live is None or live.key_digest is None:
            return None
        return live.engine_id if hmac.compare_digest(live.key_digest, _digest(stop_key)) else None
