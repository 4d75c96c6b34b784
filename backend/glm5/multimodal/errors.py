"""Errors raised while validating and preprocessing request media.

Every error is a ``ValueError`` (a bad request, not a server fault), so the serving layer can map the
whole family to one client-error status. Messages name the offending value and, for caps, the cap's
field name in :class:`~glm5.multimodal.caps.MediaCaps` and its limit, so an operator knows which knob
to turn and a client knows what to shrink.
"""

from __future__ import annotations

import re

__all__ = [
    "MediaError",
    "MediaDecodeError",
    "UnsupportedMediaError",
    "EmptyMediaError",
    "MediaCapExceededError",
    "PlaceholderMismatchError",
]


class MediaError(ValueError):
    """Base class: the request's image or video cannot be used."""


class MediaDecodeError(MediaError):
    """The bytes are not a decodable image/video (corrupt, truncated, random data)."""


class UnsupportedMediaError(MediaError):
    """Well-formed media in a format, container or codec that we deliberately do not accept."""


class EmptyMediaError(MediaError):
    """The media is empty: 0 bytes, a zero-sized image, or a video without decodable frames."""


class MediaCapExceededError(MediaError):
    """A hard cap was exceeded; raised before the memory the input asks for is allocated.

    Attributes:
        cap: the :class:`~glm5.multimodal.caps.MediaCaps` field that was exceeded.
        value: the value the input asked for.
        limit: the cap's value.
    """

    def __init__(self, what: str, *, cap: str, value: float, limit: float, hint: str = "") -> None:
        self.cap = cap
        self.value = value
        self.limit = limit
        message = f"{what}: {_number(value)} exceeds the cap {cap}={_number(limit)}"
        if hint:
            message += f"; {hint}"
        super().__init__(message)


class PlaceholderMismatchError(MediaError):
    """The prompt's ``<|image|>``/``<|video|>`` placeholders do not match the media passed."""


_OBJECT_REPR = re.compile(r"<[^<>]*\bobject at 0x[0-9a-fA-F]+>")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def describe(exc: BaseException, limit: int = 300) -> str:
    """A decoder's exception as text fit for a client: the last line, without Python object reprs or
    memory addresses (pillow says "cannot identify image file <_io.BytesIO object at 0x7f..>")."""
    lines = str(exc).strip().splitlines()
    text = lines[-1] if lines else type(exc).__name__
    text = " ".join(_ADDRESS.sub("", _OBJECT_REPR.sub("", text)).split())
    return (text or type(exc).__name__)[:limit]


def _number(value: float) -> str:
    """Readable numbers in messages: ``400,000,000`` rather than ``4e+08``."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return f"{int(value):,}"
    return f"{value:.6g}"


def check_encoded_size(kind: str, data: bytes, cap: str, limit: int, hint: str) -> None:
    """Reject empty or over-cap encoded media before anything is parsed."""
    if len(data) == 0:
        raise EmptyMediaError(f"{kind} is empty (0 bytes)")
    if len(data) > limit:
        raise MediaCapExceededError(f"encoded {kind} size in bytes", cap=cap, value=len(data), limit=limit, hint=hint)
