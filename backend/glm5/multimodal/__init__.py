"""Image and video preprocessing with hard caps, and prompt placeholder expansion.

One module tree serves both the Triton ``preprocess`` model and the engine's in-process path:

* :func:`preprocess_image` / :func:`preprocess_video` -- encoded bytes -> tower inputs;
* :class:`MultiModalProcessor` -- rendered chat prompt + media -> expanded token ids + tensors;
* :class:`MediaCaps` -- operator limits, checked from headers before memory is allocated;
* :class:`MediaError` and subclasses -- ``ValueError`` s naming the cap or problem and the value.

Outputs equal transformers' ``Glm5NextImageProcessorPil``, ``Glm5NextVideoProcessor`` and
``Glm5NextProcessor`` whenever the caps do not bind.
"""

from .caps import MediaCaps, ProcessorSettings
from .errors import (
    EmptyMediaError,
    MediaCapExceededError,
    MediaDecodeError,
    MediaError,
    PlaceholderMismatchError,
    UnsupportedMediaError,
)
from .image import ImageInputs, preprocess_image
from .placeholders import SpecialTokens, mm_token_type_ids
from .processor import MultiModalProcessor, ProcessedPrompt
from .video import VideoInputs, VideoMetadata, preprocess_video, sample_frame_indices

__all__ = [
    "MediaCaps",
    "ProcessorSettings",
    "MediaError",
    "MediaDecodeError",
    "UnsupportedMediaError",
    "EmptyMediaError",
    "MediaCapExceededError",
    "PlaceholderMismatchError",
    "ImageInputs",
    "preprocess_image",
    "VideoInputs",
    "VideoMetadata",
    "preprocess_video",
    "sample_frame_indices",
    "MultiModalProcessor",
    "ProcessedPrompt",
    "SpecialTokens",
    "mm_token_type_ids",
]
