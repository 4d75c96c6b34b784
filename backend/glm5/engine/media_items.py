"""The images and videos of one prompt as the vision tower sees them: items, content hashes, placeholder spans.

One image or one video is one *item*. Its content hash keys the vision encoder cache (a repeated image is
encoded once) and, with its placeholder span, the prefix cache's block keys (equal placeholder ids need not
mean equal media). Hashing megabytes of pixels is slow, so :func:`describe_media` runs where prompts are
prepared (the async engine's worker pool), not on the engine thread.
"""

from __future__ import annotations

import hashlib

import torch

from glm5.cache.prefix_keys import MediaSpan
from glm5.engine.sequence import MultiModalData
from glm5.layers.vision import flatten_video_grid


def media_hash(pixels: torch.Tensor, grid: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(grid.to(torch.int64).cpu().numpy().tobytes())
    h.update(pixels.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def media_items(mm: MultiModalData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(pixels, grid as the tower takes it)`` per image, then per video, in placeholder order."""
    items = []
    for pix, grid in ((mm.pixel_values, mm.image_grid_thw), (mm.pixel_values_videos, mm.video_grid_thw)):
        if pix is None or grid is None:
            continue
        offset = 0
        for row in grid:
            n = int(row.prod())
            items.append((pix[offset:offset + n], row.view(1, 3) if row[0] == 1 else flatten_video_grid(row.view(1, 3))))
            offset += n
    return items


def describe_media(mm: MultiModalData, merge: int) -> None:
    """Set ``mm.item_hashes`` (content hash per item, for the encoder cache and the prefix cache's
    keys) and ``mm.spans`` (each item's placeholder positions); ``merge`` = spatial merge² (patches
    per placeholder). Raises ValueError when the prompt's placeholders do not match the grids."""
    items = media_items(mm)
    mm.item_hashes = [media_hash(p, g) for p, g in items]
    spans: list[tuple[int, int]] = []
    for positions, grid in ((mm.image_positions, mm.image_grid_thw), (mm.video_positions, mm.video_grid_thw)):
        if grid is None:
            continue
        sizes = [int(row.prod()) // merge for row in grid]
        have = 0 if positions is None else int(positions.numel())
        if sum(sizes) != have:
            raise ValueError(f"{have} placeholder tokens but the media grids need {sum(sizes)}; the prompt's "
                             "<|image|> count must match the media grids")
        offset = 0
        for n in sizes:
            pos = positions[offset:offset + n]
            spans.append((int(pos.min()), int(pos.max()) + 1))
            offset += n
    mm.spans = [MediaSpan(start=a, end=b, content_hash=h) for (a, b), h in zip(spans, mm.item_hashes)]
