"""MultiModalProcessor: placeholder expansion, request-level caps and their order, checkpoint settings.

Token-id equality with transformers' Glm5NextProcessor (image-only, video-only and mixed prompts) is
asserted in ``test_multimodal_video.py``, whose transformers oracle subprocess these prompts share.
"""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from glm5.multimodal import (
    MediaCapExceededError,
    MediaCaps,
    MediaDecodeError,
    MultiModalProcessor,
    PlaceholderMismatchError,
    ProcessorSettings,
)

IMAGE_PART = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO_PART = "<|begin_of_video|><|video|><|end_of_video|>"


def _png(h: int, w: int, value: int = 90) -> bytes:
    buf = io.BytesIO()
    yy, xx = np.mgrid[0:h, 0:w]
    Image.fromarray(((yy + xx + value) % 256).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _clip(seconds: int = 3, fps: int = 8, size: tuple[int, int] = (96, 64)) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(seconds * fps):
            frame = np.full((size[1], size[0], 3), (i * 11) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def processor(tiny_checkpoint_dir) -> MultiModalProcessor:
    return MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir)


def test_image_placeholders_expand_in_place(processor) -> None:
    images = [_png(30, 50), _png(120, 40, value=7)]
    prompt = f"[gMASK]<sop><|user|>\nfirst {IMAGE_PART} then {IMAGE_PART} done<|assistant|>"
    out = processor.process(prompt, images=images)
    tokens = processor.tokens
    per_image = [int(g[1] * g[2] // 4) for g in out.image_grid_thw]
    assert out.pixel_values.shape == (sum(int(g[1] * g[2]) for g in out.image_grid_thw), 1176)
    ids = out.token_ids
    starts = [i for i, t in enumerate(ids) if t == tokens.begin_of_image]
    assert len(starts) == 2
    for start, n in zip(starts, per_image):  # each block is exactly n image tokens, then its end marker
        assert ids[start + 1 : start + 1 + n] == [tokens.image] * n
        assert ids[start + 1 + n] == tokens.end_of_image
    assert out.mm_token_type_ids.tolist().count(1) == sum(per_image) == out.num_visual_tokens
    text = processor.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("[gMASK]<sop><|user|>\nfirst <|begin_of_image|><|image|><|image|>")
    assert text.endswith("<|end_of_image|> done<|assistant|>")
    assert out.pixel_values_videos.shape == (0, 1176) and out.video_grid_thw.shape == (0, 3)


def test_token_id_prompt_expands_like_text_prompt(processor) -> None:
    images, videos = [_png(40, 40)], [_clip()]
    prompt = f"<|user|>\n{IMAGE_PART} and {VIDEO_PART} what?<|assistant|>"
    from_text = processor.process(prompt, images=images, videos=videos)
    from_ids = processor.process(processor.encode(prompt), images=images, videos=videos)
    assert from_ids.token_ids == from_text.token_ids
    assert np.array_equal(from_ids.pixel_values_videos, from_text.pixel_values_videos)
    assert from_text.mm_token_type_ids.tolist().count(2) == int(np.prod(from_text.video_grid_thw[0]) // 4)


@pytest.mark.parametrize(
    "prompt, n_images, n_videos",
    [("no placeholders", 1, 0), (IMAGE_PART * 2, 1, 0), (VIDEO_PART, 0, 0), (IMAGE_PART, 0, 1)],
)
def test_placeholder_count_must_match_media(processor, prompt: str, n_images: int, n_videos: int) -> None:
    with pytest.raises(PlaceholderMismatchError, match="placeholders but"):
        processor.process(prompt, images=[_png(20, 20)] * n_images, videos=[_clip()] * n_videos)


def test_video_placeholder_outside_video_span_is_rejected(processor) -> None:
    with pytest.raises(PlaceholderMismatchError, match="begin_of_video"):
        processor.process("bare <|video|> placeholder", videos=[_clip()])


def test_count_caps_are_checked_before_any_decoding(tiny_checkpoint_dir) -> None:
    caps = MediaCaps(max_images=2, max_videos=1)
    proc = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir, caps=caps)
    garbage = b"not an image at all"
    with pytest.raises(MediaCapExceededError, match="max_images=2") as err:
        proc.process("<|image|>" * 3, images=[garbage] * 3)
    assert (err.value.cap, err.value.value, err.value.limit) == ("max_images", 3, 2)
    with pytest.raises(MediaCapExceededError, match="max_videos=1"):
        proc.process(VIDEO_PART * 2, videos=[garbage] * 2)


def test_token_cap_is_checked_from_headers_before_decoding(tiny_checkpoint_dir) -> None:
    """Three 64-token images exceed a 150-token cap; the third is truncated (would fail to decode),
    yet the cap error comes first, because all headers are probed before any pixel is decoded."""
    caps = MediaCaps(max_visual_tokens=150)
    proc = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir, caps=caps)
    big = _png(400, 400)
    truncated = big[: len(big) // 2]
    with pytest.raises(MediaCapExceededError, match="max_visual_tokens=150") as err:
        proc.process(IMAGE_PART * 3, images=[big, big, truncated])
    assert err.value.value == 3 * 64
    with pytest.raises(MediaDecodeError):  # within the cap, the truncated image is reported as such
        proc.process(IMAGE_PART * 2, images=[big, truncated])


def test_videos_share_what_images_leave_of_the_token_budget(tiny_checkpoint_dir) -> None:
    caps = MediaCaps(max_visual_tokens=100)
    proc = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir, caps=caps)
    unconstrained = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir)
    clip = _clip(seconds=4, size=(320, 240))
    alone = unconstrained.process(VIDEO_PART, videos=[clip])
    shared = proc.process(IMAGE_PART + VIDEO_PART, images=[_png(400, 400)], videos=[clip])
    image_tokens = shared.mm_token_type_ids.tolist().count(1)
    video_tokens = shared.mm_token_type_ids.tolist().count(2)
    assert image_tokens == 64
    assert alone.num_visual_tokens > 100 - 64 >= video_tokens > 0
    assert shared.video_grid_thw[0, 0] == alone.video_grid_thw[0, 0]  # same frames, smaller canvas


def test_settings_come_from_the_checkpoint_or_defaults(tiny_checkpoint_dir, tmp_path) -> None:
    tiny = ProcessorSettings.from_checkpoint(tiny_checkpoint_dir)
    assert (tiny.image_min_tokens, tiny.image_max_tokens) == (4, 64)
    assert (tiny.video_min_tokens, tiny.video_max_tokens, tiny.video_max_frames) == (4, 256, 16)
    assert ProcessorSettings.from_checkpoint(tmp_path) == ProcessorSettings()  # no config files

    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_dir, broken)
    cfg = json.loads((broken / "preprocessor_config.json").read_text())
    cfg["patch_expand_factor"] = 2
    (broken / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="patch_expand_factor=2"):
        ProcessorSettings.from_checkpoint(broken)


def test_caps_reject_unknown_keys_and_nonpositive_values() -> None:
    assert MediaCaps.from_dict({"max_images": 3}).max_images == 3
    with pytest.raises(ValueError, match="max_imagez"):
        MediaCaps.from_dict({"max_imagez": 3})
    with pytest.raises(ValueError, match="max_visual_tokens"):
        MediaCaps(max_visual_tokens=0)
