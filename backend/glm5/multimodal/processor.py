"""Request-level multimodal preprocessing: caps, media, and placeholder expansion in one call.

:class:`MultiModalProcessor` is the single entry point shared by the Triton ``preprocess`` model and
the engine's in-process path. ``process(prompt, images, videos)`` takes the *already rendered* chat
prompt (text or token ids) and the raw media bytes, and returns token ids with every placeholder
expanded plus the tower inputs -- the same ids and tensors as transformers' ``Glm5NextProcessor``.

Work is ordered so that a request is refused before it costs memory: media counts are checked, then
every image and video is *probed* (headers, frame counts, sampling, canvas plan) and the request's
total visual tokens compared with :attr:`MediaCaps.max_visual_tokens`, and only then is anything
decoded. Videos share what the images leave of the token budget (evenly, in order), shrinking their
canvas if needed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .caps import MediaCaps, ProcessorSettings
from .errors import MediaCapExceededError, PlaceholderMismatchError
from .image import ImageInputs, decode_probed_image, probe_image
from .placeholders import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    SpecialTokens,
    expand_ids,
    expand_text,
    image_replacement_ids,
    image_replacement_text,
    mm_token_type_ids,
    video_replacement_ids,
    video_replacement_text,
)
from .video import VideoInputs, decode_probed_video, probe_video

logger = logging.getLogger(__name__)

__all__ = ["MultiModalProcessor", "ProcessedPrompt", "TextTokenizer"]


class TextTokenizer(Protocol):
    """What the processor needs from a tokenizer (``tokenizers.Tokenizer`` or a transformers one)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """Expanded prompt and tower inputs for one request.

    Arrays are never ``None``: without images ``pixel_values`` is ``[0, 1176]`` and ``image_grid_thw``
    ``[0, 3]`` (same for videos), so consumers can concatenate and ship them unconditionally.

    Attributes:
        token_ids: prompt ids, one ``<|image|>`` per tower output row.
        pixel_values: ``[sum_i grid_h*grid_w, 1176]`` float32, images in prompt order.
        image_grid_thw: ``[num_images, 3]`` int64.
        pixel_values_videos: ``[sum_v grid_t*grid_h*grid_w, 1176]`` float32, videos in prompt order.
        video_grid_thw: ``[num_videos, 3]`` int64.
        mm_token_type_ids: ``[len(token_ids)]`` int8: 0 text, 1 image row, 2 video row.
        video_timestamps: per video, the seconds printed for each temporal slice.
        video_frame_indices: per video, the sampled frame indices.
    """

    token_ids: list[int]
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray
    mm_token_type_ids: np.ndarray
    video_timestamps: list[list[float]]
    video_frame_indices: list[np.ndarray]

    @property
    def num_visual_tokens(self) -> int:
        return int(np.count_nonzero(self.mm_token_type_ids))


class MultiModalProcessor:
    """Glm5Next prompt + media preprocessing with hard caps (see module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        settings: ProcessorSettings | None = None,
        caps: MediaCaps | None = None,
        special_tokens: SpecialTokens | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.settings = settings or ProcessorSettings()
        self.caps = caps or MediaCaps()
        self.tokens = special_tokens or SpecialTokens.from_lookup(self._token_to_id)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, caps: MediaCaps | None = None, tokenizer: Any = None) -> "MultiModalProcessor":
        """Tokenizer (``tokenizer.json``) and processor settings from a checkpoint directory."""
        root = Path(checkpoint_dir)
        if tokenizer is None:
            from tokenizers import Tokenizer

            path = root / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: pass tokenizer= or point at a checkpoint with tokenizer.json")
            tokenizer = Tokenizer.from_file(str(path))
        return cls(tokenizer, ProcessorSettings.from_checkpoint(root), caps)

    # -- tokenizer adapter ------------------------------------------------------------------------

    def _token_to_id(self, token: str) -> int | None:
        tok = self.tokenizer
        if hasattr(tok, "token_to_id"):
            return tok.token_to_id(token)
        token_id = tok.convert_tokens_to_ids(token)
        return None if token_id is None or token_id == getattr(tok, "unk_token_id", object()) else token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenize text; ``add_special_tokens`` follows the tokenizer's post-processor (BOS etc.)."""
        encoded = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoded.ids if hasattr(encoded, "ids") else encoded)

    # -- main entry point -------------------------------------------------------------------------

    def process(
        self,
        prompt: str | Sequence[int],
        images: Sequence[bytes] = (),
        videos: Sequence[bytes] = (),
        *,
        add_special_tokens: bool = False,
    ) -> ProcessedPrompt:
        """Expand the rendered prompt's placeholders and preprocess its media.

        ``prompt`` is the chat-template output as text (tokenized here, after expansion, exactly
        like transformers) or as token ids (expanded in id space; timestamps tokenized on their own,
        which gives the same ids because they sit between special tokens). ``add_special_tokens`` is
        passed to the tokenizer for text prompts; GLM templates already contain ``[gMASK]<sop>``.

        Raises a :class:`~glm5.multimodal.errors.MediaError` (a ``ValueError``) on any bad input.
        """
        images, videos = list(images), list(videos)
        self._check_counts(prompt, len(images), len(videos))

        image_probes = [probe_image(data, self.caps, self.settings) for data in images]
        image_tokens = sum(p.num_tokens for p in image_probes)
        if image_tokens > self.caps.max_visual_tokens:
            raise MediaCapExceededError(
                f"visual tokens of {len(images)} image(s)", cap="max_visual_tokens", value=image_tokens,
                limit=self.caps.max_visual_tokens, hint="send fewer or smaller images",
            )
        video_probes = []
        remaining = self.caps.max_visual_tokens - image_tokens
        for index, data in enumerate(videos):
            share = remaining // (len(videos) - index)
            if share < 1:
                raise MediaCapExceededError(
                    "visual tokens of the request before its videos", cap="max_visual_tokens",
                    value=self.caps.max_visual_tokens - remaining, limit=self.caps.max_visual_tokens,
                    hint="no token budget is left for the videos; send fewer images",
                )
            probe = probe_video(data, self.caps, self.settings, token_budget=share)
            video_probes.append(probe)
            remaining -= probe.num_tokens

        image_inputs = [decode_probed_image(p, self.settings) for p in image_probes]
        video_inputs = [decode_probed_video(p, self.caps, self.settings) for p in video_probes]
        token_ids = self._expand(prompt, image_inputs, video_inputs, add_special_tokens)
        types = mm_token_type_ids(token_ids, self.tokens)
        self._check_expansion(types, image_inputs, video_inputs)
        return ProcessedPrompt(
            token_ids=token_ids,
            pixel_values=_concat([i.pixel_values for i in image_inputs], self.settings.patch_dim),
            image_grid_thw=_grid([i.image_grid_thw for i in image_inputs]),
            pixel_values_videos=_concat([v.pixel_values_videos for v in video_inputs], self.settings.patch_dim),
            video_grid_thw=_grid([v.video_grid_thw for v in video_inputs]),
            mm_token_type_ids=types,
            video_timestamps=[v.timestamps for v in video_inputs],
            video_frame_indices=[v.frame_indices for v in video_inputs],
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _check_counts(self, prompt: str | Sequence[int], num_images: int, num_videos: int) -> None:
        caps = self.caps
        if num_images > caps.max_images:
            raise MediaCapExceededError("images in the request", cap="max_images", value=num_images, limit=caps.max_images)
        if num_videos > caps.max_videos:
            raise MediaCapExceededError("videos in the request", cap="max_videos", value=num_videos, limit=caps.max_videos)
        if isinstance(prompt, str):
            n_image, n_video = prompt.count(IMAGE_TOKEN), prompt.count(VIDEO_TOKEN)
        else:
            ids = list(prompt)
            n_image, n_video = ids.count(self.tokens.image), ids.count(self.tokens.video)
        if (n_image, n_video) != (num_images, num_videos):
            raise PlaceholderMismatchError(
                f"the prompt has {n_image} {IMAGE_TOKEN} and {n_video} {VIDEO_TOKEN} placeholders but "
                f"{num_images} image(s) and {num_videos} video(s) were sent; render the prompt with the "
                "chat template, which writes one placeholder per media item"
            )

    def _expand(
        self, prompt: str | Sequence[int], images: list[ImageInputs], videos: list[VideoInputs],
        add_special_tokens: bool,
    ) -> list[int]:
        if isinstance(prompt, str):
            text = expand_text(
                prompt,
                [image_replacement_text(i.num_tokens) for i in images],
                [video_replacement_text(v.tokens_per_slice, v.timestamps) for v in videos],
            )
            return self.encode(text, add_special_tokens=add_special_tokens)
        return expand_ids(
            list(prompt), self.tokens,
            [image_replacement_ids(i.num_tokens, self.tokens) for i in images],
            [video_replacement_ids(v.tokens_per_slice, v.timestamps, self.tokens, self.encode) for v in videos],
        )

    @staticmethod
    def _check_expansion(types: np.ndarray, images: list[ImageInputs], videos: list[VideoInputs]) -> None:
        """Every tower row must land on a placeholder of its own kind, or the engine would misplace it."""
        want_image = sum(i.num_tokens for i in images)
        want_video = sum(v.num_tokens for v in videos)
        got_image = int(np.count_nonzero(types == 1))
        got_video = int(np.count_nonzero(types == 2))
        if (got_image, got_video) != (want_image, want_video):
            raise PlaceholderMismatchError(
                f"after expansion the prompt has {got_image} image and {got_video} video placeholder tokens, "
                f"expected {want_image} and {want_video}: each {VIDEO_TOKEN} must sit inside "
                "<|begin_of_video|>...<|end_of_video|> and no <|image|> may (as the chat template renders them)"
            )


def _concat(arrays: list[np.ndarray], patch_dim: int) -> np.ndarray:
    if not arrays:
        return np.zeros((0, patch_dim), dtype=np.float32)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


def _grid(grids: list[np.ndarray]) -> np.ndarray:
    if not grids:
        return np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(grids, axis=0).astype(np.int64, copy=False)
