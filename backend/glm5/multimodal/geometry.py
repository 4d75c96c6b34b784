"""Canvas sizing, normalisation tables and patch layout shared by images and videos.

The Glm5Next vision tower consumes rows of ``3 x temporal_patch_size x patch x patch`` values
(1176 for 14 px patches, T=2). Images are treated as 2-frame clips (the frame is repeated in time);
videos contribute one row per (temporal pair, patch). Rows are ordered merge-block by merge-block
(2x2 patches that the tower's downsampler fuses into one token), row-major over blocks, and inside a
patch the values run channel, time, row, column. This order is what transformers' Glm5Next
processors emit and what the tower's ``Conv3d`` patch embedding and 2x2 downsampler expect.

Sizing rule (``fit_canvas``): the canvas is the frame size rounded up to multiples of
``factor = patch x merge`` (28 px), grown to reach ``min_tokens`` or shrunk (binary search over the
content height, aspect ratio kept) to stay within ``max_tokens``, where one token is
``temporal_patch_size x factor^2`` pixels of the whole (time-aligned) clip. The frame is resized to
the largest content that fits the canvas (never upscaled unless the clip is below the minimum) and
zero-padded at the bottom/right (``content_size``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "CanvasPlan",
    "fit_canvas",
    "content_size",
    "plan_canvas",
    "image_normalization_table",
    "video_normalization_table",
    "patchify",
    "apply_normalization",
    "normalized_patches",
]


@dataclasses.dataclass(frozen=True)
class CanvasPlan:
    """Where a frame of ``(height, width)`` goes: resized to ``content_*``, zero-padded to ``canvas_*``."""

    height: int
    width: int
    content_height: int
    content_width: int
    canvas_height: int
    canvas_width: int

    @property
    def needs_resize(self) -> bool:
        return (self.content_height, self.content_width) != (self.height, self.width)


def _round_up(value: int | float, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def fit_canvas(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_tokens: int,
    max_tokens: int,
) -> tuple[int, int]:
    """Canvas ``(height, width)``, multiples of ``factor``, whose token count lies in the budget.

    Raises ``ValueError`` when ``max_tokens`` cannot hold even one aligned patch per frame pair
    (callers turn that into a cap error naming the frame count).
    """
    pixels_per_token = temporal_factor * factor * factor
    low_budget = min_tokens * pixels_per_token
    high_budget = max_tokens * pixels_per_token
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)

    canvas_h = _round_up(height, factor)
    canvas_w = _round_up(width, factor)
    if frames * canvas_h * canvas_w < low_budget:
        grow = math.sqrt(low_budget / (num_frames * height * width))
        canvas_h = _round_up(max(1, math.ceil(height * grow)), factor)
        canvas_w = _round_up(max(1, math.ceil(width * grow)), factor)

    if frames * canvas_h * canvas_w <= high_budget:
        return canvas_h, canvas_w

    smallest = frames * factor * factor
    if high_budget < smallest:
        raise ValueError(
            f"a token budget of {max_tokens} cannot hold {frames} frames at one {factor}x{factor} patch each"
        )
    # Largest content height (aspect ratio kept, width floored) whose aligned canvas fits the budget.
    best = (factor, factor)
    lo, hi = 1, height
    while lo <= hi:
        mid = (lo + hi) // 2
        cand_h = _round_up(mid, factor)
        cand_w = _round_up(max(1, math.floor(width * mid / height)), factor)
        if frames * cand_h * cand_w <= high_budget:
            best = (cand_h, cand_w)
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def content_size(
    num_frames: int,
    height: int,
    width: int,
    canvas_height: int,
    canvas_width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_tokens: int,
) -> tuple[int, int]:
    """Size the frame is resized to inside its canvas: uniform scale, no upscaling above the minimum."""
    scale = min(canvas_height / height, canvas_width / width)
    if num_frames * height * width >= temporal_factor * factor * factor * min_tokens:
        scale = min(1.0, scale)
    content_h = max(1, min(canvas_height, math.floor(height * scale)))
    content_w = max(1, min(canvas_width, math.floor(width * scale)))
    return content_h, content_w


def plan_canvas(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_tokens: int,
    max_tokens: int,
) -> CanvasPlan:
    """Both steps of the sizing rule for one frame size (``num_frames`` = frames sharing the budget)."""
    canvas_h, canvas_w = fit_canvas(
        num_frames, height, width, temporal_factor=temporal_factor, factor=factor,
        min_tokens=min_tokens, max_tokens=max_tokens,
    )
    content_h, content_w = content_size(
        num_frames, height, width, canvas_h, canvas_w, temporal_factor=temporal_factor, factor=factor,
        min_tokens=min_tokens,
    )
    return CanvasPlan(height, width, content_h, content_w, canvas_h, canvas_w)


def image_normalization_table(
    mean: tuple[float, float, float], std: tuple[float, float, float], rescale_factor: float
) -> np.ndarray:
    """``[3, 256]`` float32 table: uint8 value -> normalised value, image path.

    Evaluated with the image processor's arithmetic (rescale in float64 then cast to float32,
    subtract and divide in float32), so table look-ups reproduce transformers' values bit for bit
    while touching each decoded pixel only once and never materialising a float64 image.
    """
    levels = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return ((levels[None, :] - mean32) / std32).astype(np.float32)


def video_normalization_table(
    mean: tuple[float, float, float], std: tuple[float, float, float], rescale_factor: float
) -> np.ndarray:
    """``[3, 256]`` float32 table for the video path.

    The video processor folds the rescale into mean/std (``mean / rescale_factor``, computed in
    float32 by torch) and normalises the raw 0..255 values; evaluating the same float32 expression
    per level gives identical values.
    """
    import torch

    scale = 1.0 / rescale_factor
    mean_t = torch.tensor(mean, dtype=torch.float32) * scale
    std_t = torch.tensor(std, dtype=torch.float32) * scale
    levels = torch.arange(256, dtype=torch.float32)
    table = (levels[None, :] - mean_t[:, None]) / std_t[:, None]
    return table.numpy().astype(np.float32, copy=False)


def patchify(
    frames: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Cut channel-first frames ``[T, 3, H, W]`` into patch rows, tower order (any dtype).

    ``T`` must be a multiple of ``temporal_patch_size`` (pass a single image as a length-1 array
    broadcast to ``temporal_patch_size`` frames), ``H``/``W`` multiples of ``patch x merge``.
    Returns ``(rows [grid_t*grid_h*grid_w, 3*T_p*p*p], (grid_t, grid_h, grid_w))``.
    """
    num_frames, channels, height, width = frames.shape
    if num_frames % temporal_patch_size:
        raise ValueError(f"{num_frames} frames is not a multiple of temporal_patch_size={temporal_patch_size}")
    step = patch_size * merge_size
    if height % step or width % step:
        raise ValueError(f"canvas {height}x{width} is not a multiple of {step}")
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks_h, blocks_w = grid_h // merge_size, grid_w // merge_size
    view = frames.reshape(
        grid_t, temporal_patch_size, channels,
        blocks_h, merge_size, patch_size,
        blocks_w, merge_size, patch_size,
    )
    # -> (t, block row, block col, row in block, col in block, channel, time, pixel row, pixel col)
    ordered = view.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = np.ascontiguousarray(ordered).reshape(
        grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size
    )
    return rows, (grid_t, grid_h, grid_w)


def apply_normalization(frames: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Map channel-first uint8 frames ``[T, 3, H, W]`` to float32 through a ``[3, 256]`` table.

    Done on the canvas (before patchify) where each channel plane is contiguous, which keeps the
    table look-up a fast gather; images are normalised once, before their repetition in time.
    """
    out = np.empty(frames.shape, dtype=np.float32)
    for channel in range(3):
        out[:, channel] = table[channel][frames[:, channel]]
    return out


def normalized_patches(
    frames: np.ndarray, table: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalise uint8 frames ``[T, 3, H, W]`` and patchify them, one temporal slice at a time.

    Writes straight into the final ``[rows, 1176]`` float32 array so the peak extra memory is one
    slice, not a second full-size float copy of the clip.
    """
    num_frames, channels, height, width = frames.shape
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    per_slice = grid_h * grid_w
    out = np.empty((grid_t * per_slice, channels * temporal_patch_size * patch_size * patch_size), dtype=np.float32)
    for t in range(grid_t):
        chunk = frames[t * temporal_patch_size : (t + 1) * temporal_patch_size]
        rows, _ = patchify(
            apply_normalization(chunk, table), patch_size=patch_size, merge_size=merge_size,
            temporal_patch_size=temporal_patch_size,
        )
        out[t * per_slice : (t + 1) * per_slice] = rows
    return out, (grid_t, grid_h, grid_w)
