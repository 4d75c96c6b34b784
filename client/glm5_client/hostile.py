"""Hostile requests for the soak tool: what a careless or malicious client sends.

Each :class:`HostileKind` builds one request and says what a healthy server must do with it:
refuse it with an error (bad parameters, corrupt media, token ids outside the vocabulary, an
oversized HTTP body) or survive it without stalling everyone else (a 10 MB prompt, an 8-second
720p video). ``heavy`` kinds are the ones whose effect on other streams' inter-token gaps the soak
tool measures.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import numpy as np

#: Names of the kinds, in the order the soak tool cycles through them.
KINDS = ("bad_params", "bad_media", "token_ids_out_of_range", "out_of_range_params", "oversized_http",
         "huge_prompt", "video_720p")
#: Wrong types, ranges and names: every server must refuse these.
BAD_PARAMS = ({"max_tokens": -1}, {"temperature": "hot"}, {"top_p": 7}, {"no_such_parameter": 1}, {"stop": 5},
              {"top_k": 1.5}, {"temperature": float("nan")})
#: Values of the right type that cannot be honoured: a seed outside 0..2**64-1 (would wrap around
#: silently) and more new tokens than any context holds.
OUT_OF_RANGE_PARAMS = ({"seed": -1}, {"seed": 2**64}, {"max_tokens": 10**12})
HEAVY_KINDS = frozenset({"huge_prompt", "video_720p"})


@dataclass
class HostileOutcome:
    kind: str
    ok: bool            # the server did what it must (refused, or served without harm)
    detail: str
    started: float
    finished: float


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(seconds: float = 8.0, width: int = 1280, height: int = 720, fps: int = 25) -> bytes:
    """A synthetic H.264 mp4 (moving gradients; needs PyAV: ``pip install av``)."""
    try:
        import av
    except ImportError as exc:
        raise RuntimeError("the video_720p hostile request needs PyAV (pip install av), or leave it out with "
                           "--hostile-kinds") from exc
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(int(seconds * fps)):
            frame = np.stack([(xx + i * 8) % 256, (yy + i * 4) % 256, ((xx + yy) // 2 + i) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def huge_prompt(megabytes: float = 10.0) -> str:
    return "lorem ipsum dolor sit amet " * int(megabytes * 1e6 / 27)


def oversized_http_body(http_url: str, model: str, megabytes: int = 8) -> tuple[bool, str]:
    """POST an 8 MB body to ``generate``: a guarded server answers 413 (or another 4xx) and stays up."""
    body = b'{"text_input": "' + b"x" * (megabytes * 1024 * 1024) + b'"}'
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (operator-given URL)
            return False, f"accepted with HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return 400 <= e.code < 500, f"HTTP {e.code}"
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return False, f"connection failed: {e}"


@dataclass
class HostileRequest:
    """One hostile request for the gRPC client: ``kwargs`` for ``generate`` and whether it must fail."""

    kind: str
    kwargs: dict[str, Any]
    must_fail: bool
    raw_inputs: Callable[[], list[tuple[str, np.ndarray, str]]] | None = None   # tensors the client cannot build


class HostileFactory:
    """Builds the requests once (the video and the 10 MB prompt are expensive to make)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._video: bytes | None = None
        self._prompt: str | None = None
        self._n = 0

    def video(self) -> bytes:
        if self._video is None:
            self._video = mp4_bytes()
        return self._video

    def prompt(self) -> str:
        if self._prompt is None:
            self._prompt = huge_prompt()
        return self._prompt

    def build(self, kind: str) -> HostileRequest:
        self._n += 1
        small = {"max_tokens": 4, "temperature": 0}
        if kind == "bad_params":
            bad = BAD_PARAMS[self._n % len(BAD_PARAMS)]
            return HostileRequest(kind, {"prompt": "hello", "sampling": bad}, must_fail=True)
        if kind == "out_of_range_params":
            bad = OUT_OF_RANGE_PARAMS[self._n % len(OUT_OF_RANGE_PARAMS)]
            return HostileRequest(kind, {"prompt": "hello", "sampling": bad}, must_fail=True)
        if kind == "bad_media":
            corrupt = b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 64
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
            return HostileRequest(kind, {"messages": msgs, "images": [corrupt], "sampling": small}, must_fail=True)
        if kind == "token_ids_out_of_range":
            def tensors() -> list[tuple[str, np.ndarray, str]]:
                return [("input_ids", np.array([5, 999_999, 7], dtype=np.int64), "INT64"),
                        ("sampling_parameters", np.array([json.dumps(small).encode()], dtype=np.object_), "BYTES"),
                        ("stream", np.array([True]), "BOOL")]
            return HostileRequest(kind, {}, must_fail=True, raw_inputs=tensors)
        if kind == "huge_prompt":
            return HostileRequest(kind, {"prompt": self.prompt(), "sampling": small}, must_fail=True)
        if kind == "video_720p":
            msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
            # A valid request: served or refused by a cap, either is fine as long as nobody else stalls.
            return HostileRequest(kind, {"messages": msgs, "videos": [self.video()], "sampling": small},
                                  must_fail=False)
        raise ValueError(f"unknown hostile kind {kind!r}; choose from {', '.join(KINDS)}")
