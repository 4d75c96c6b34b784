"""Video decoding (decord, from memory) and Glm5Next video preprocessing under hard caps.

Order of work for one encoded video, each step refusing before the next one allocates:

1. byte-size cap; container header probe (:mod:`glm5.multimodal.container`): frame size against
   :attr:`MediaCaps.max_video_frame_pixels`, codec against what the decoder supports;
2. ``decord.VideoReader(io.BytesIO(data))`` (no temp files): frame count and average fps; duration
   (frames / fps) against :attr:`MediaCaps.max_video_duration_s`;
3. frame sampling -- Glm5Next's rule (below) with ``max_frames`` tightened to
   :attr:`MediaCaps.max_video_frames`; canvas and token count from the header size, the video's
   token budget tightened to the request's remaining :attr:`MediaCaps.max_visual_tokens`;
4. decode *only* the sampled frames (``get_batch``), in chunks of at most
   :attr:`MediaCaps.video_decode_chunk_bytes`, each chunk resized right away, then normalise and
   patchify into ``pixel_values_videos [grid_t*grid_h*grid_w, 1176]``.

Frame sampling (transformers' ``Glm5NextVideoProcessor.sample_frames``): with ``duration = frames /
fps`` and ``n = min(int(min(duration, max_duration or inf) * 2), max_frames)``, walk the frames in
order and keep a frame whenever its timestamp ``i / fps`` reaches the next 0.5 s mark (stopping at
``int(duration)`` seconds); too few kept -> ``n`` evenly spaced indices between the first and last
kept; too many -> ``n`` evenly spaced over the whole video; then drop duplicates and repeat the last
index if the count is odd. The walk is computed mark by mark (not frame by frame), so a header
claiming billions of frames costs nothing.

Resizing matches transformers' torchvision path: bicubic with antialiasing on the uint8 frames
(``torch.nn.functional.interpolate``, ``align_corners=False``), rounded back to uint8.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math

import numpy as np

from .caps import MediaCaps, ProcessorSettings
from .container import probe_container
from .errors import EmptyMediaError, MediaCapExceededError, MediaDecodeError, check_encoded_size, describe
from .geometry import CanvasPlan, normalized_patches, plan_canvas, video_normalization_table

logger = logging.getLogger(__name__)

__all__ = [
    "VideoInputs",
    "VideoMetadata",
    "VideoProbe",
    "sample_frame_indices",
    "probe_video",
    "decode_probed_video",
    "preprocess_video",
]


@dataclasses.dataclass(frozen=True)
class VideoMetadata:
    """What we know about a video before decoding any frame."""

    container: str
    codec: str
    width: int
    height: int
    total_frames: int
    fps: float

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps


@dataclasses.dataclass(frozen=True)
class VideoInputs:
    """Preprocessed video, ready for the vision tower.

    Attributes:
        pixel_values_videos: ``[grid_t * grid_h * grid_w, 1176]`` float32 patch rows.
        video_grid_thw: ``[1, 3]`` int64 ``(grid_t, grid_h, grid_w)``; grid_t = sampled frames / 2.
        timestamps: seconds of the first frame of each temporal slice (``grid_t`` values), printed in
            the prompt as ``"{t:.1f} seconds"``.
        frame_indices: the sampled frame indices (even count, last one possibly repeated).
        num_tokens: placeholder tokens in the prompt (``grid_t * grid_h * grid_w / 4``).
        metadata: container/decoder facts the sampling was based on.
    """

    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray
    timestamps: list[float]
    frame_indices: np.ndarray
    num_tokens: int
    metadata: VideoMetadata

    @property
    def tokens_per_slice(self) -> int:
        """Placeholder tokens of one temporal slice (one ``<|begin_of_image|>`` block)."""
        return self.num_tokens // int(self.video_grid_thw[0, 0])


@dataclasses.dataclass
class VideoProbe:
    """A video opened and planned (indices, canvas, tokens) but not decoded."""

    metadata: VideoMetadata
    frame_indices: np.ndarray
    plan: CanvasPlan
    grid_thw: tuple[int, int, int]
    num_tokens: int
    token_budget: int
    _reader: object = dataclasses.field(repr=False)


def sample_frame_indices(
    total_frames: int, video_fps: float, *, target_fps: float, max_frames: int, max_duration: float = 0.0
) -> np.ndarray:
    """Glm5Next's frame sampling (see module docstring); returns an even-length int64 array."""
    if total_frames <= 0 or not video_fps > 0:
        raise ValueError(f"need frames > 0 and fps > 0, got {total_frames} frames at {video_fps} fps")
    duration = total_frames / video_fps
    whole_seconds = int(duration)
    considered = duration if max_duration <= 0 else min(duration, max_duration)
    wanted = min(int(considered * target_fps), max_frames)

    if total_frames < wanted:
        picked = np.linspace(0, total_frames - 1, wanted, dtype=int).tolist()
    else:
        picked = _walk_marks(total_frames, 1 / video_fps, 1 / target_fps, whole_seconds)

    if len(picked) < wanted:
        first, last = (picked[0], picked[-1]) if picked else (0, max(total_frames - 1, 0))
        picked = np.linspace(first, last, wanted, dtype=int).tolist()
    elif len(picked) > wanted:
        picked = np.linspace(0, total_frames - 1, wanted, dtype=int).tolist()

    unique = list(dict.fromkeys(picked))
    if len(unique) % 2:
        unique.append(unique[-1])
    return np.asarray(unique, dtype=np.int64)


def _walk_marks(total_frames: int, seconds_per_frame: float, mark_step: float, stop_seconds: int) -> list[int]:
    """First frame at or after each successive mark; identical float arithmetic to a frame-by-frame scan.

    A frame ``i`` is kept when ``i * seconds_per_frame >= mark``; after keeping it the mark advances
    by ``mark_step`` and the scan continues at ``i + 1``, stopping once the mark reaches
    ``stop_seconds``. ``i * seconds_per_frame`` is monotone in ``i``, so the next kept frame is found
    from an estimate just below it instead of visiting every frame.
    """
    picked: list[int] = []
    mark = 0.0
    start = 0
    while start < total_frames:
        guess = max(start, math.ceil(mark / seconds_per_frame) - 2)
        while guess > start and (guess - 1) * seconds_per_frame >= mark:
            guess -= 1  # never skip past the first qualifying frame
        index = guess
        while index < total_frames and index * seconds_per_frame < mark:
            index += 1
        if index >= total_frames:
            break
        picked.append(index)
        mark += mark_step
        if mark >= stop_seconds:
            break
        start = index + 1
    return picked


def probe_video(
    data: bytes,
    caps: MediaCaps,
    settings: ProcessorSettings | None = None,
    token_budget: int | None = None,
) -> VideoProbe:
    """Check caps, open the video, sample indices and plan the canvas, without decoding a frame.

    ``token_budget`` is what is left of the request's :attr:`MediaCaps.max_visual_tokens`; the video's
    own budget (``video_max_tokens``) is tightened to it so the canvas shrinks instead of failing.
    """
    settings = settings or ProcessorSettings()
    check_encoded_size("video", data, "max_video_bytes", caps.max_video_bytes,
                       "send a shorter or more compressed video")
    stream = probe_container(bytes(data))
    _check_frame_size(stream.width, stream.height, caps, source=f"{stream.container} header")

    reader = _open_reader(data)
    total_frames = int(len(reader))
    fps = float(reader.get_avg_fps())
    if not math.isfinite(fps) or fps <= 0:
        raise MediaDecodeError(f"video reports an unusable frame rate ({fps} fps)")
    metadata = VideoMetadata(stream.container, stream.codec, stream.width, stream.height, total_frames, fps)
    if metadata.duration > caps.max_video_duration_s:
        raise MediaCapExceededError(
            f"video duration in seconds ({total_frames} frames at {fps:g} fps)", cap="max_video_duration_s",
            value=metadata.duration, limit=caps.max_video_duration_s, hint="trim the video",
        )

    indices = sample_frame_indices(
        total_frames, fps, target_fps=settings.video_fps,
        max_frames=min(settings.video_max_frames, caps.max_video_frames),
        max_duration=settings.video_max_duration,
    )
    if len(indices) == 0:
        raise EmptyMediaError(
            f"video is {metadata.duration:.3f} s long; sampling at {settings.video_fps:g} fps yields no frame "
            f"(the shortest usable video is {1 / settings.video_fps:g} s)"
        )
    budget = min(settings.video_max_tokens, caps.max_visual_tokens if token_budget is None else token_budget)
    plan, grid, num_tokens = _plan(len(indices), stream.height, stream.width, settings, budget)
    return VideoProbe(metadata, indices, plan, grid, num_tokens, budget, _reader=reader)


def decode_probed_video(probe: VideoProbe, caps: MediaCaps, settings: ProcessorSettings | None = None) -> VideoInputs:
    """Decode the sampled frames chunk by chunk, resize, normalise and patchify them."""
    import torch

    settings = settings or ProcessorSettings()
    reader = probe._reader
    indices = probe.frame_indices
    plan = probe.plan
    grid = probe.grid_thw
    num_tokens = probe.num_tokens

    first = _get_frames(reader, indices[:1])
    height, width = first.shape[1:3]
    if (height, width) != (plan.height, plan.width):
        # The header's size was what the caps and plan used; the decoder is authoritative.
        logger.warning("decoded frames are %dx%d but the container header said %dx%d; re-planning",
                       width, height, plan.width, plan.height)
        _check_frame_size(width, height, caps, source="decoded frame")
        plan, grid, num_tokens = _plan(len(indices), height, width, settings, probe.token_budget)

    canvas = np.zeros((len(indices), 3, plan.canvas_height, plan.canvas_width), dtype=np.uint8)
    chunk_len = max(1, caps.video_decode_chunk_bytes // (height * width * 3))
    done = 0
    pending = first
    while done < len(indices):
        if pending is None:
            pending = _get_frames(reader, indices[done : done + chunk_len])
        frames = torch.from_numpy(pending).permute(0, 3, 1, 2).contiguous()
        if plan.needs_resize:
            frames = torch.nn.functional.interpolate(
                frames, size=(plan.content_height, plan.content_width), mode="bicubic",
                align_corners=False, antialias=True,
            )
        canvas[done : done + len(frames), :, : plan.content_height, : plan.content_width] = frames.numpy()
        done += len(frames)
        pending = None

    table = video_normalization_table(settings.video_mean, settings.video_std, settings.rescale_factor)
    pixel_values, (grid_t, grid_h, grid_w) = normalized_patches(
        canvas, table, patch_size=settings.patch_size, merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
    )
    assert (grid_t, grid_h, grid_w) == grid
    fps = probe.metadata.fps
    timestamps = [int(i) / fps for i in indices[:: settings.temporal_patch_size]][:grid_t]
    return VideoInputs(
        pixel_values_videos=pixel_values,
        video_grid_thw=np.array([grid], dtype=np.int64),
        timestamps=timestamps,
        frame_indices=indices,
        num_tokens=num_tokens,
        metadata=probe.metadata,
    )


def preprocess_video(data: bytes, caps: MediaCaps | None = None, settings: ProcessorSettings | None = None) -> VideoInputs:
    """Encoded video bytes -> tower inputs. Raises a :class:`~glm5.multimodal.errors.MediaError`."""
    caps = caps or MediaCaps()
    probe = probe_video(data, caps, settings)
    return decode_probed_video(probe, caps, settings)


def _check_frame_size(width: int, height: int, caps: MediaCaps, *, source: str) -> None:
    if width <= 0 or height <= 0:
        raise EmptyMediaError(f"video frames have a zero dimension ({width}x{height}, from the {source})")
    if width * height > caps.max_video_frame_pixels:
        raise MediaCapExceededError(
            f"video frame pixel count ({width}x{height}, from the {source})", cap="max_video_frame_pixels",
            value=width * height, limit=caps.max_video_frame_pixels, hint="downscale the video",
        )


def _plan(
    num_frames: int, height: int, width: int, settings: ProcessorSettings, budget: int
) -> tuple[CanvasPlan, tuple[int, int, int], int]:
    try:
        plan = plan_canvas(
            num_frames, height, width, temporal_factor=settings.temporal_patch_size, factor=settings.factor,
            min_tokens=settings.video_min_tokens, max_tokens=budget,
        )
    except ValueError as exc:
        raise MediaCapExceededError(
            f"visual tokens needed by {num_frames} sampled frames (at least one token per frame pair)",
            cap="max_visual_tokens", value=math.ceil(num_frames / settings.temporal_patch_size), limit=budget,
            hint="lower max_video_frames or send fewer media",
        ) from exc
    grid = (
        num_frames // settings.temporal_patch_size,
        plan.canvas_height // settings.patch_size,
        plan.canvas_width // settings.patch_size,
    )
    num_tokens = grid[0] * grid[1] * grid[2] // (settings.merge_size**2)
    return plan, grid, num_tokens


def _open_reader(data: bytes):
    import decord

    try:
        reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0))
    except AssertionError as exc:  # decord asserts a positive frame count
        raise EmptyMediaError(f"video has no decodable frames ({_short(exc)})") from exc
    except Exception as exc:  # noqa: BLE001 - decord raises its own DECORDError / RuntimeError types
        raise MediaDecodeError(f"could not open the video: {_short(exc)}") from exc
    if len(reader) <= 0:
        raise EmptyMediaError("video has no decodable frames")
    return reader


def _get_frames(reader, indices: np.ndarray) -> np.ndarray:
    try:
        frames = reader.get_batch([int(i) for i in indices]).asnumpy()
    except Exception as exc:  # noqa: BLE001 - decord errors are not a documented hierarchy
        raise MediaDecodeError(f"could not decode video frames {list(indices[:4])}...: {_short(exc)}") from exc
    if frames.ndim != 4 or frames.shape[0] != len(indices) or frames.shape[-1] != 3:
        raise MediaDecodeError(f"decoder returned frames of shape {frames.shape} for {len(indices)} indices")
    return frames


def _short(exc: BaseException) -> str:
    return describe(exc)

