"""Prompt admission: a request's prompt -> validated token ids and vision inputs.

Everything here is the slow, request-proportional part of admitting a request: rendering the chat
template, tokenizing, decoding and resizing images and video frames, validating preprocessed
tensors and hashing media. :class:`PromptProcessor` holds no engine state and is safe to call from
several threads at once, so the async engine runs it on a bounded worker pool and the engine loop
only ever sees finished :class:`PreparedPrompt` s.

Over-long text is refused *before* it is tokenized: a prompt that fits ``max_model_len`` tokens has
at most ``max_model_len x L`` UTF-8 bytes, where ``L`` is the longest token of the vocabulary in
bytes (added/special tokens included; each token covers at most that many bytes of the text it was
cut from). A tokenizer with a normalizer may shrink text before cutting it (NFC composition, strip),
so the bound is then widened 4x. Text above the bound is rejected in O(1) without tokenizing it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glm5.config import ModelConfig
from glm5.engine.media_items import describe_media
from glm5.engine.outputs import PromptInput
from glm5.engine.sequence import MultiModalData

logger = logging.getLogger(__name__)

#: Widening of the byte bound for tokenizers that normalize text before cutting it into tokens.
NORMALIZER_BYTES_FACTOR = 4


class PromptTooLongError(ValueError):
    """The prompt cannot fit ``max_model_len``; raised before tokenizing when its size already shows it."""


@dataclass
class PreparedPrompt:
    """A prompt ready for the scheduler: ids, vision inputs (placeholder positions set) and the text."""

    token_ids: list[int]
    mm: MultiModalData | None
    prompt_text: str | None


def max_token_bytes(tokenizer: Any) -> int:
    """UTF-8 length of the vocabulary's longest token string (an upper bound on the text bytes one token
    covers: byte-level alphabets map each text byte to one character of at most 2 UTF-8 bytes)."""
    vocab = tokenizer.get_vocab()
    return max((len(t.encode("utf-8")) for t in vocab), default=1) or 1


def _has_normalizer(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return getattr(backend, "normalizer", None) is not None


class PromptProcessor:
    """Validates and prepares prompts (thread-safe; see the module docstring)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, model_dir: str, media_caps: dict | None,
                 max_model_len: int):
        from glm5.multimodal import MediaCaps
        from glm5.multimodal.tensors import TensorLayout

        self.config = model_config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.caps = MediaCaps.from_dict(media_caps) if media_caps else MediaCaps()
        self.max_model_len = max_model_len
        self.vocab_size = model_config.text.vocab_size
        v = model_config.vision
        self.layout = TensorLayout(
            vocab_size=self.vocab_size, image_token_id=model_config.image_token_id,
            video_token_id=model_config.video_token_id, video_start_token_id=model_config.video_start_token_id,
            video_end_token_id=model_config.video_end_token_id,
            patch_dim=None if v is None else v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
            merge_size=2 if v is None else v.spatial_merge_size)
        self.max_prompt_bytes: int | None = None
        self.max_token_bytes: int | None = None
        if tokenizer is not None:
            self.max_token_bytes = max_token_bytes(tokenizer)
            factor = NORMALIZER_BYTES_FACTOR if _has_normalizer(tokenizer) else 1
            self.max_prompt_bytes = max_model_len * self.max_token_bytes * factor
        self._mm_processor = None
        self._mm_lock = threading.Lock()

    @property
    def mm_processor(self):
        with self._mm_lock:
            if self._mm_processor is None:
                from glm5.multimodal import MultiModalProcessor
                self._mm_processor = MultiModalProcessor.from_checkpoint(self.model_dir, caps=self.caps,
                                                                         tokenizer=self.tokenizer)
            return self._mm_processor

    # ------------------------------------------------------------------ entry point
    def process(self, prompt: PromptInput) -> PreparedPrompt:
        """Raises ``ValueError`` (incl. ``MediaError``, :class:`PromptTooLongError`) naming what is wrong."""
        if prompt.mm_inputs is not None:
            return self._from_preprocessed(prompt.mm_inputs)
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise ValueError("a prompt needs exactly one of text, token_ids or messages")
        if prompt.token_ids is not None:
            if prompt.images or prompt.videos:
                raise ValueError("images/videos need a text or chat prompt (placeholders are expanded from text)")
            # raw ids keep transformers' semantics: without pixels a placeholder id is embedded as a plain
            # token (the oracle tests draw random ids over the whole vocabulary); preprocessed input_ids,
            # whose placeholders stand for media, are held to the media (validate_preprocessed)
            return PreparedPrompt(self._check_ids([int(t) for t in prompt.token_ids]), None, None)
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: send prompt token ids")
        if prompt.messages is not None:
            from glm5.tokenizer import render_chat
            text = render_chat(self.tokenizer, prompt.messages)
            what = "the rendered chat prompt"
        else:
            text = prompt.text
            what = "text_input"
        self.check_text_size(text, what)
        if prompt.images or prompt.videos:
            p = self.mm_processor.process(text, images=prompt.images, videos=prompt.videos)
            ids = self._check_ids([int(x) for x in p.token_ids])
            mm = self._mm_from_arrays(ids, p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
            return PreparedPrompt(ids, mm, text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._check_no_orphan_placeholders(ids)
        return PreparedPrompt(ids, None, text)

    # ------------------------------------------------------------------ checks
    def check_text_size(self, text: str, what: str = "text_input") -> None:
        """Refuse text that cannot fit ``max_model_len`` tokens, without tokenizing it (module docstring)."""
        bound = self.max_prompt_bytes
        if bound is None or len(text) * 4 <= bound:  # a character is at most 4 UTF-8 bytes
            return
        n = len(text) if len(text) > bound else len(text.encode("utf-8"))
        if n > bound:
            raise PromptTooLongError(
                f"{what} is {n:,} bytes (at least); a prompt that fits max_model_len={self.max_model_len} tokens "
                f"has at most {bound:,} bytes with this tokenizer (longest token {self.max_token_bytes} bytes); "
                "shorten the prompt or raise max_model_len")

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len} leaves no room to generate; "
                "shorten the prompt or raise max_model_len (and the cache: num_cache_blocks / cache_memory_gb)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_no_orphan_placeholders(self, ids: list[int]) -> None:
        """A prompt without media must not hold media placeholders (they would be embedded as plain
        tokens: the model would answer about an image it never saw)."""
        from glm5.multimodal import PlaceholderMismatchError

        c = self.config
        n_img, n_vid = ids.count(c.image_token_id), ids.count(c.video_token_id)
        if n_img or n_vid:
            raise PlaceholderMismatchError(
                f"the prompt has {n_img} <|image|> and {n_vid} <|video|> placeholder(s) but no image or video was "
                "sent: attach one image/video per placeholder (an image part in messages needs an `image` input "
                "element) or remove the placeholders")

    # ------------------------------------------------------------------ multimodal tensors
    def _from_preprocessed(self, d: dict) -> PreparedPrompt:
        from glm5.multimodal.tensors import validate_preprocessed

        if "input_ids" not in d:
            raise ValueError("preprocessed inputs need 'input_ids'")
        raw = d.get("input_ids")
        n = int(np.prod(getattr(raw, "shape", (len(raw),)))) if raw is not None else 0
        if n >= self.max_model_len:  # before converting a huge array
            raise PromptTooLongError(f"prompt has {n} tokens but max_model_len={self.max_model_len} leaves no room "
                                     "to generate; shorten the prompt or raise max_model_len")
        v = validate_preprocessed(d, self.layout, self.caps)
        ids = self._check_ids(v.input_ids.tolist())
        mm = self._mm_from_arrays(ids, v.pixel_values, v.image_grid_thw, v.pixel_values_videos, v.video_grid_thw)
        return PreparedPrompt(ids, mm, d.get("prompt_text"))

    def _placeholder_positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        is_img = ids == c.image_token_id
        in_video = torch.cumsum((ids == c.video_start_token_id).long(), 0) > torch.cumsum(
            (ids == c.video_end_token_id).long(), 0)
        return (is_img & ~in_video).nonzero().squeeze(1), (is_img & in_video).nonzero().squeeze(1)

    def _mm_from_arrays(self, ids: list[int], pv, igrid, pvv, vgrid) -> MultiModalData | None:
        def t(x, dtype):
            if x is None or (hasattr(x, "shape") and x.shape[0] == 0):
                return None
            return torch.as_tensor(x).to(dtype)
        pv, pvv = t(pv, torch.float32), t(pvv, torch.float32)
        if pv is None and pvv is None:
            return None
        img_pos, vid_pos = self._placeholder_positions(torch.tensor(ids))
        mm = MultiModalData(pixel_values=pv, image_grid_thw=None if pv is None else t(igrid, torch.long),
                            pixel_values_videos=pvv, video_grid_thw=None if pvv is None else t(vgrid, torch.long),
                            image_positions=img_pos, video_positions=vid_pos)
        if self.config.vision is not None:
            describe_media(mm, self.config.vision.spatial_merge_size ** 2)
        return mm
