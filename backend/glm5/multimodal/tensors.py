"""Validation of already-preprocessed multimodal tensors (what the ``preprocess`` model sends).

The ``glm5`` model also accepts ``input_ids`` + ``pixel_values`` / ``image_grid_thw`` /
``pixel_values_videos`` / ``video_grid_thw`` from any client, not only from our ``preprocess``
model, so nothing about them may be trusted: a token id outside the vocabulary, a grid that does
not match the pixel rows or the placeholders, or NaN pixels would otherwise pass admission and fail
inside an engine step. :func:`validate_preprocessed` checks, before the request is queued:

* ``input_ids``: a non-empty 1-D integer array, every id in ``[0, vocab_size)``;
* each pixel tensor: 2-D floating point, ``patch_dim`` columns (``in_channels x temporal_patch_size
  x patch_size^2``), finite values, and given together with its grid (and the grid with it);
* each grid: ``[n, 3]`` integers, ``t, h, w >= 1``, ``h`` and ``w`` multiples of the spatial merge
  size, and ``sum(t * h * w)`` equal to the pixel rows;
* the caps: images <= ``max_images``, videos <= ``max_videos``, visual tokens (``t*h*w / merge^2``
  summed over all items) <= ``max_visual_tokens``;
* placeholders: the ``<|image|>`` tokens outside ``<|begin_of_video|>...<|end_of_video|>`` spans equal
  the images' visual tokens and those inside equal the videos' (the rule transformers applies), the
  video spans are balanced, and no unexpanded ``<|video|>`` token is left.

Every failure is a :class:`~glm5.multimodal.errors.MediaError` (a ``ValueError``) naming the tensor,
the value and what is expected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .caps import MediaCaps
from .errors import MediaCapExceededError, MediaError, PlaceholderMismatchError

__all__ = ["TensorLayout", "ValidatedTensors", "validate_preprocessed", "as_numpy"]


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """What the checkpoint's vocabulary and vision tower accept."""

    vocab_size: int
    image_token_id: int
    video_token_id: int
    video_start_token_id: int
    video_end_token_id: int
    patch_dim: int | None          # None: the checkpoint has no vision tower
    merge_size: int = 2


@dataclasses.dataclass
class ValidatedTensors:
    """Checked copies: ``input_ids`` int64 ``[T]``; pixels float32 ``[N, patch_dim]``; grids int64 ``[n, 3]``."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None


def as_numpy(x: Any, name: str) -> np.ndarray | None:
    """A numpy view of a numpy array / torch tensor / nested list; ``None`` or an empty tensor gives None."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise MediaError(f"{name} is not a numeric array ({exc})") from exc
    if arr.dtype == object:
        raise MediaError(f"{name} has dtype object (strings or ragged lists); send a numeric tensor")
    return None if arr.size == 0 else arr


def _ids(x: Any, layout: TensorLayout) -> np.ndarray:
    arr = as_numpy(x, "input_ids")
    if arr is None:
        raise MediaError("input_ids is empty; send at least one token id")
    if not np.issubdtype(arr.dtype, np.integer):
        raise MediaError(f"input_ids has dtype {arr.dtype}; send integer token ids (INT64)")
    if arr.ndim != 1:
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr.reshape(-1)
        else:
            raise MediaError(f"input_ids has shape {list(arr.shape)}; send a 1-D list of token ids")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= layout.vocab_size:
        bad = arr[(arr < 0) | (arr >= layout.vocab_size)][:5].tolist()
        raise MediaError(f"input_ids {bad} are outside the vocabulary [0, {layout.vocab_size})")
    return arr.astype(np.int64, copy=False)


def _pixels(x: Any, name: str, layout: TensorLayout) -> np.ndarray | None:
    arr = as_numpy(x, name)
    if arr is None:
        return None
    if layout.patch_dim is None:
        raise MediaError(f"{name} was sent but this checkpoint has no vision tower (no vision_config); send text only")
    if not np.issubdtype(arr.dtype, np.floating):
        raise MediaError(f"{name} has dtype {arr.dtype}; send float32 patch rows")
    if arr.ndim != 2 or arr.shape[1] != layout.patch_dim:
        raise MediaError(f"{name} has shape {list(arr.shape)}; expected [rows, {layout.patch_dim}] patch rows "
                         "(channels x temporal_patch_size x patch_size^2), as the preprocess model emits")
    arr = arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise MediaError(f"{name} contains NaN or infinite values")
    return arr


def _grid(x: Any, name: str, layout: TensorLayout) -> np.ndarray | None:
    arr = as_numpy(x, name)
    if arr is None:
        return None
    if not np.issubdtype(arr.dtype, np.integer):
        raise MediaError(f"{name} has dtype {arr.dtype}; send integer (t, h, w) rows")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise MediaError(f"{name} has shape {list(arr.shape)}; expected [items, 3] rows of (t, h, w) in patches")
    arr = arr.astype(np.int64, copy=False)
    if (arr < 1).any():
        raise MediaError(f"{name} has a non-positive entry {arr[(arr < 1).any(axis=1)][0].tolist()}; "
                         "t, h and w must be >= 1")
    m = layout.merge_size
    if (arr[:, 1:] % m).any():
        bad = arr[(arr[:, 1:] % m).any(axis=1)][0].tolist()
        raise MediaError(f"{name} row {bad}: h and w must be multiples of the spatial merge size {m}")
    return arr


def _pair(pixels: np.ndarray | None, grid: np.ndarray | None, pix_name: str, grid_name: str) -> None:
    if (pixels is None) != (grid is None):
        given, missing = (pix_name, grid_name) if grid is None else (grid_name, pix_name)
        raise MediaError(f"{given} was sent without {missing}; send both (or neither)")
    if pixels is not None and grid is not None:
        rows = int(np.prod(grid, axis=1).sum())
        if rows != pixels.shape[0]:
            raise MediaError(f"{grid_name} describes {rows} patch rows (sum of t*h*w) but {pix_name} has "
                             f"{pixels.shape[0]}")


def _placeholder_counts(ids: np.ndarray, layout: TensorLayout) -> tuple[int, int]:
    starts = ids == layout.video_start_token_id
    ends = ids == layout.video_end_token_id
    depth = np.cumsum(starts.astype(np.int64)) - np.cumsum(ends.astype(np.int64))
    if (depth < 0).any() or (depth > 1).any() or (depth[-1] if depth.size else 0) != 0:
        raise PlaceholderMismatchError("input_ids has unbalanced or nested <|begin_of_video|>/<|end_of_video|> "
                                       "tokens; each video span must open and close once")
    is_img = ids == layout.image_token_id
    in_video = depth > 0
    return int((is_img & ~in_video).sum()), int((is_img & in_video).sum())


def validate_preprocessed(d: dict[str, Any], layout: TensorLayout, caps: MediaCaps) -> ValidatedTensors:
    """Check a preprocessed request (see the module docstring); returns the checked arrays."""
    ids = _ids(d.get("input_ids"), layout)
    pv = _pixels(d.get("pixel_values"), "pixel_values", layout)
    ig = _grid(d.get("image_grid_thw"), "image_grid_thw", layout)
    pvv = _pixels(d.get("pixel_values_videos"), "pixel_values_videos", layout)
    vg = _grid(d.get("video_grid_thw"), "video_grid_thw", layout)
    _pair(pv, ig, "pixel_values", "image_grid_thw")
    _pair(pvv, vg, "pixel_values_videos", "video_grid_thw")
    n_img = 0 if ig is None else ig.shape[0]
    n_vid = 0 if vg is None else vg.shape[0]
    if n_img > caps.max_images:
        raise MediaCapExceededError("images in the request", cap="max_images", value=n_img, limit=caps.max_images)
    if n_vid > caps.max_videos:
        raise MediaCapExceededError("videos in the request", cap="max_videos", value=n_vid, limit=caps.max_videos)
    merge2 = layout.merge_size ** 2
    img_tokens = 0 if ig is None else int(np.prod(ig, axis=1).sum()) // merge2
    vid_tokens = 0 if vg is None else int(np.prod(vg, axis=1).sum()) // merge2
    if img_tokens + vid_tokens > caps.max_visual_tokens:
        raise MediaCapExceededError("visual tokens of the request", cap="max_visual_tokens",
                                    value=img_tokens + vid_tokens, limit=caps.max_visual_tokens,
                                    hint="send fewer or smaller images/videos")
    if (ids == layout.video_token_id).any():
        raise PlaceholderMismatchError("input_ids holds an unexpanded <|video|> token; expand each video into its "
                                       "per-frame <|image|> blocks (the preprocess model does) or remove it")
    got_img, got_vid = _placeholder_counts(ids, layout)
    if (got_img, got_vid) != (img_tokens, vid_tokens):
        raise PlaceholderMismatchError(
            f"input_ids has {got_img} image and {got_vid} video placeholder tokens (<|image|> outside / inside "
            f"<|begin_of_video|>...<|end_of_video|>) but the grids describe {img_tokens} image and {vid_tokens} "
            f"video tokens ({n_img} image(s), {n_vid} video(s)); each image needs t*h*w/{merge2} placeholders")
    return ValidatedTensors(input_ids=ids, pixel_values=pv, image_grid_thw=ig, pixel_values_videos=pvv,
                            video_grid_thw=vg)
