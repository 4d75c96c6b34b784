"""Prompt placeholder expansion for Glm5Next images and videos (what ``Glm5NextProcessor`` does).

The chat template renders one ``<|image|>`` per image, wrapped as
``<|begin_of_image|><|image|><|end_of_image|>``, and one ``<|video|>`` per video, wrapped as
``<|begin_of_video|><|video|><|end_of_video|>``. Expansion replaces, in order of appearance:

* each ``<|image|>`` with ``<|image|>`` x (grid_h * grid_w / merge^2) -- one per tower output row;
* each ``<|video|>`` with, per temporal slice t, ``<|begin_of_image|>`` + ``<|image|>`` x
  (grid_h * grid_w / merge^2) + ``<|end_of_image|>`` + ``"{timestamp_t:.1f} seconds"``.

The image token is reused inside videos; whether an ``<|image|>`` belongs to a video is decided by
its position between ``<|begin_of_video|>`` and ``<|end_of_video|>`` (:func:`mm_token_type_ids`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "SpecialTokens",
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "BEGIN_OF_IMAGE",
    "END_OF_IMAGE",
    "BEGIN_OF_VIDEO",
    "END_OF_VIDEO",
    "image_replacement_text",
    "video_replacement_text",
    "image_replacement_ids",
    "video_replacement_ids",
    "expand_text",
    "expand_ids",
    "mm_token_type_ids",
]

IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
BEGIN_OF_IMAGE = "<|begin_of_image|>"
END_OF_IMAGE = "<|end_of_image|>"
BEGIN_OF_VIDEO = "<|begin_of_video|>"
END_OF_VIDEO = "<|end_of_video|>"


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Ids of the multimodal special tokens in the checkpoint's vocabulary."""

    image: int
    video: int
    begin_of_image: int
    end_of_image: int
    begin_of_video: int
    end_of_video: int

    @classmethod
    def from_lookup(cls, token_to_id: Callable[[str], int | None]) -> "SpecialTokens":
        names = {
            "image": IMAGE_TOKEN, "video": VIDEO_TOKEN, "begin_of_image": BEGIN_OF_IMAGE,
            "end_of_image": END_OF_IMAGE, "begin_of_video": BEGIN_OF_VIDEO, "end_of_video": END_OF_VIDEO,
        }
        ids = {}
        for field, token in names.items():
            token_id = token_to_id(token)
            if token_id is None:
                raise ValueError(f"the tokenizer has no {token} token; is this a GLM-5 vision checkpoint?")
            ids[field] = int(token_id)
        return cls(**ids)


def timestamp_text(seconds: float) -> str:
    """The per-slice time label written after each video frame block."""
    return f"{seconds:.1f} seconds"


def image_replacement_text(num_tokens: int) -> str:
    return IMAGE_TOKEN * num_tokens


def video_replacement_text(tokens_per_slice: int, timestamps: Sequence[float]) -> str:
    block = BEGIN_OF_IMAGE + IMAGE_TOKEN * tokens_per_slice + END_OF_IMAGE
    return "".join(block + timestamp_text(t) for t in timestamps)


def image_replacement_ids(num_tokens: int, tokens: SpecialTokens) -> list[int]:
    return [tokens.image] * num_tokens


def video_replacement_ids(
    tokens_per_slice: int, timestamps: Sequence[float], tokens: SpecialTokens, encode: Callable[[str], list[int]]
) -> list[int]:
    """Id form of :func:`video_replacement_text`; ``encode`` tokenizes plain text without specials."""
    out: list[int] = []
    block = [tokens.begin_of_image, *([tokens.image] * tokens_per_slice), tokens.end_of_image]
    for t in timestamps:
        out.extend(block)
        out.extend(encode(timestamp_text(t)))
    return out


def expand_text(text: str, image_replacements: Sequence[str], video_replacements: Sequence[str]) -> str:
    """Replace the i-th ``<|image|>`` / ``<|video|>`` of ``text`` by the i-th replacement, in one pass."""
    pieces: list[str] = []
    images = iter(image_replacements)
    videos = iter(video_replacements)
    pos = 0
    while True:
        next_image = text.find(IMAGE_TOKEN, pos) if image_replacements else -1
        next_video = text.find(VIDEO_TOKEN, pos) if video_replacements else -1
        candidates = [(i, t) for i, t in ((next_image, IMAGE_TOKEN), (next_video, VIDEO_TOKEN)) if i >= 0]
        if not candidates:
            break
        index, token = min(candidates)
        pieces.append(text[pos:index])
        pieces.append(next(images) if token == IMAGE_TOKEN else next(videos))
        pos = index + len(token)
    pieces.append(text[pos:])
    return "".join(pieces)


def expand_ids(
    ids: Sequence[int], tokens: SpecialTokens, image_replacements: Sequence[list[int]],
    video_replacements: Sequence[list[int]],
) -> list[int]:
    """Id form of :func:`expand_text`."""
    images = iter(image_replacements)
    videos = iter(video_replacements)
    out: list[int] = []
    for token_id in ids:
        if token_id == tokens.image and image_replacements:
            out.extend(next(images))
        elif token_id == tokens.video and video_replacements:
            out.extend(next(videos))
        else:
            out.append(int(token_id))
    return out


def mm_token_type_ids(ids: Sequence[int], tokens: SpecialTokens) -> np.ndarray:
    """Per token: 0 text, 1 image placeholder, 2 video placeholder (inside a begin/end-of-video span)."""
    array = np.asarray(ids, dtype=np.int64)
    inside_video = np.cumsum(array == tokens.begin_of_video) > np.cumsum(array == tokens.end_of_video)
    is_placeholder = array == tokens.image
    types = np.zeros(array.shape, dtype=np.int8)
    types[is_placeholder & ~inside_video] = 1
    types[is_placeholder & inside_video] = 2
    return types
