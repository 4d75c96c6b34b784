"""Hard resource caps for request media, and the Glm5Next processor settings.

Two different things live here on purpose, side by side:

* :class:`MediaCaps` are *safety* limits chosen by the operator. Exceeding one is an error
  (:class:`~glm5.multimodal.errors.MediaCapExceededError`) raised from header-level information,
  before decoding, so a hostile request cannot make the server allocate what it asks for.
  The only two caps that shape output instead of rejecting are ``max_video_frames`` and
  ``max_visual_tokens`` for a *single video*: they tighten the processor's own ``max_frames`` and
  video token budget (uniform frame subsampling and a smaller canvas, exactly how Glm5Next applies its
  own settings), because rejecting every long video would make video input useless.
* :class:`ProcessorSettings` are the model's preprocessing hyper-parameters (what transformers'
  ``Glm5NextImageProcessor``/``Glm5NextVideoProcessor`` read from the checkpoint's
  ``preprocessor_config.json`` / ``video_preprocessor_config.json``). With the defaults below and
  caps that do not bind, our output equals transformers' output.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MediaCaps", "ProcessorSettings", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD"]

#: CLIP normalisation constants used by every GLM vision processor.
OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MediaCaps:
    """Per-request limits on media; all checked before the corresponding memory is allocated.

    Defaults are sized for a 2-core / 24 GiB host: one request at the caps needs well under 2 GB
    (the largest item is ``pixel_values`` for ``max_visual_tokens`` tokens: 4 patches x 1176 float32
    per token, i.e. ~300 MB at 16384 tokens).
    """

    #: Encoded size of one image (bytes).
    max_image_bytes: int = 20 * _MIB
    #: Encoded size of one video (bytes); decord copies the buffer once more when it opens it.
    max_video_bytes: int = 128 * _MIB
    #: Decoded pixel count (width x height, as the header claims) of one image: decompression bombs.
    max_image_pixels: int = 40_000_000
    #: Pixel count of one video frame (from the container header): 4096x2304 admits 4K, refuses 8K.
    max_video_frame_pixels: int = 4096 * 2304
    #: Longest video (seconds, frame count / fps as the container reports) accepted at all.
    max_video_duration_s: float = 3600.0
    #: Most frames sampled (and decoded) from one video; tightens the processor's ``max_frames``.
    max_video_frames: int = 512
    #: Visual placeholder tokens per request (all images and videos together); also the ceiling
    #: of one video's token budget.
    max_visual_tokens: int = 16384
    #: Images per request.
    max_images: int = 16
    #: Videos per request.
    max_videos: int = 2
    #: Bytes of raw decoded frames held at once while a video is decoded and resized in chunks.
    video_decode_chunk_bytes: int = 256 * _MIB

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"MediaCaps.{field.name} must be a positive number, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MediaCaps":
        """Build caps from a (config-file) mapping, rejecting unknown keys so typos do not pass silently."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown MediaCaps keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | None) -> "MediaCaps | None":
        """Caps from the ``media_caps`` setting (a JSON object of field overrides); empty means defaults.

        Every model that takes media (``glm5`` and ``preprocess``) reads its caps through this one
        function from the same setting, so both paths enforce the same limits.
        """
        if text is None or not str(text).strip():
            return None
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"media_caps is not valid JSON ({exc.msg} at position {exc.pos}): {text[:80]!r}; "
                             'expected an object such as {"max_images": 4}') from exc
        if not isinstance(values, dict):
            raise ValueError(f'media_caps must be a JSON object such as {{"max_images": 4}}, got {text[:80]!r}')
        return cls.from_dict(values)


@dataclasses.dataclass(frozen=True)
class ProcessorSettings:
    """Glm5Next image/video preprocessing hyper-parameters (transformers' defaults)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_min_tokens: int = 16
    image_max_tokens: int = 8000
    video_min_tokens: int = 16
    video_max_tokens: int = 240000
    #: Frames sampled per second of video.
    video_fps: float = 2.0
    #: Most frames the processor samples from one video (uniformly re-spaced above this).
    video_max_frames: int = 2048
    #: Seconds of video the sampling budget is based on; 0 means the whole video.
    video_max_duration: float = 0.0
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    video_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    video_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1.0 / 255.0

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "video_max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProcessorSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.video_fps <= 0:
            raise ValueError(f"ProcessorSettings.video_fps must be > 0, got {self.video_fps}")

    @property
    def factor(self) -> int:
        """Canvas alignment in pixels: one merged patch (28 for 14 px patches merged 2x2)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row: 3 channels x temporal x patch x patch (1176)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ProcessorSettings":
        """Read the settings a checkpoint ships, falling back to the defaults for anything absent.

        Looked up, later files overriding earlier ones: ``processor_config.json`` (nested
        ``image_processor`` / ``video_processor`` sections, transformers v5 layout),
        ``preprocessor_config.json`` (image processor) and ``video_preprocessor_config.json``.
        """
        root = Path(checkpoint_dir)
        image_cfg: dict[str, Any] = {}
        video_cfg: dict[str, Any] = {}
        combined = _read_json(root / "processor_config.json")
        image_cfg.update(combined.get("image_processor", {}) or {})
        video_cfg.update(combined.get("video_processor", {}) or {})
        image_cfg.update(_read_json(root / "preprocessor_config.json"))
        video_cfg.update(_read_json(root / "video_preprocessor_config.json"))
        return cls.from_processor_dicts(image_cfg, video_cfg)

    @classmethod
    def from_processor_dicts(cls, image_cfg: dict[str, Any], video_cfg: dict[str, Any]) -> "ProcessorSettings":
        """Map transformers' processor-config keys onto our field names."""
        defaults = cls()
        for cfg, kind in ((image_cfg, "image"), (video_cfg, "video")):
            expand = cfg.get("patch_expand_factor", 1)
            if expand not in (1, None):
                raise ValueError(
                    f"{kind} processor patch_expand_factor={expand} is not supported (Glm5Next uses 1)"
                )
            resample = cfg.get("resample", 3)
            if resample not in (3, None):
                raise ValueError(f"{kind} processor resample={resample} is not supported (Glm5Next uses 3 = BICUBIC)")

        def pick(cfg: dict[str, Any], key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        geometry = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            image_value = pick(image_cfg, key, getattr(defaults, key))
            video_value = pick(video_cfg, key, image_value)
            if image_value != video_value:
                raise ValueError(
                    f"image and video processors disagree on {key} ({image_value} vs {video_value}); "
                    "the vision tower has one patch geometry"
                )
            geometry[key] = int(image_value)
        rescale = float(pick(image_cfg, "rescale_factor", defaults.rescale_factor))
        video_rescale = float(pick(video_cfg, "rescale_factor", rescale))
        if video_rescale != rescale:
            raise ValueError(f"image/video rescale_factor differ ({rescale} vs {video_rescale})")
        settings = cls(
            **geometry,
            image_min_tokens=int(pick(image_cfg, "min_image_tokens", defaults.image_min_tokens)),
            image_max_tokens=int(pick(image_cfg, "max_image_tokens", defaults.image_max_tokens)),
            video_min_tokens=int(pick(video_cfg, "min_image_tokens", defaults.video_min_tokens)),
            video_max_tokens=int(pick(video_cfg, "max_image_tokens", defaults.video_max_tokens)),
            video_fps=float(pick(video_cfg, "fps", defaults.video_fps)),
            video_max_frames=int(pick(video_cfg, "max_frames", defaults.video_max_frames)),
            video_max_duration=float(pick(video_cfg, "max_duration", defaults.video_max_duration)),
            image_mean=_triple(pick(image_cfg, "image_mean", defaults.image_mean)),
            image_std=_triple(pick(image_cfg, "image_std", defaults.image_std)),
            video_mean=_triple(pick(video_cfg, "image_mean", defaults.video_mean)),
            video_std=_triple(pick(video_cfg, "image_std", defaults.video_std)),
            rescale_factor=rescale,
        )
        logger.debug("processor settings: %s", settings)
        return settings


def _triple(values: Any) -> tuple[float, float, float]:
    items = tuple(float(v) for v in values)
    if len(items) != 3:
        raise ValueError(f"expected 3 per-channel values (RGB), got {values!r}")
    return items  # type: ignore[return-value]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
