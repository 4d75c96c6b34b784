"""Image preprocessing equals transformers' Glm5NextImageProcessorPil on varied, generated images.

Oracle input: the same encoded bytes loaded the way transformers loads encoded images
(``load_image`` of a base64 string: EXIF transpose + RGB). For images with transparency the oracle is
fed the opened PIL image instead, whose ``convert_to_rgb`` composites onto white -- the behaviour we
implement (``load_image`` would drop the alpha channel first; see ``glm5.multimodal.image``).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from glm5.multimodal import MediaCaps, ProcessorSettings, preprocess_image

TOL = 1e-5


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _noise(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (h, w) if channels == 1 else (h, w, channels)
    # Smooth gradient + noise: realistic enough for resampling, never constant.
    yy, xx = np.mgrid[0:h, 0:w]
    base = ((yy * 7 + xx * 3) % 256).astype(np.int32)
    if channels > 1:
        base = base[..., None]
    return np.clip(base + rng.integers(-40, 40, shape), 0, 255).astype(np.uint8)


def _exif_jpeg(h: int, w: int, orientation: int) -> bytes:
    image = Image.fromarray(_noise(h, w, seed=orientation))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(image, "JPEG", exif=exif.tobytes(), quality=92)


def _gif_first_frame_transparent() -> bytes:
    frames = [Image.fromarray(_noise(45, 61, seed=s)).convert("P") for s in (1, 2)]
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=0, duration=50)


def _palette_with_transparency() -> bytes:
    image = Image.fromarray(_noise(50, 60, seed=3)).convert("P")
    return _encode(image, "PNG", transparency=5)


CASES: dict[str, callable] = {
    "odd_rgb_png": lambda: _encode(Image.fromarray(_noise(37, 53)), "PNG"),
    "one_by_one": lambda: _encode(Image.new("RGB", (1, 1), (10, 200, 30)), "PNG"),
    "very_wide": lambda: _encode(Image.fromarray(_noise(7, 900)), "PNG"),
    "very_tall_jpeg": lambda: _encode(Image.fromarray(_noise(1500, 11)), "JPEG", quality=90),
    "large_jpeg_downscaled": lambda: _encode(Image.fromarray(_noise(2600, 2500)), "JPEG", quality=85),
    "grayscale": lambda: _encode(Image.fromarray(_noise(100, 77, channels=1)), "PNG"),
    "grayscale_alpha": lambda: _encode(Image.fromarray(_noise(40, 90, channels=2)), "PNG"),
    "rgba": lambda: _encode(Image.fromarray(_noise(64, 90, channels=4)), "PNG"),
    "palette": lambda: _encode(Image.fromarray(_noise(50, 60)).convert("P"), "PNG"),
    "palette_transparency": _palette_with_transparency,
    "exif_rotate_270": lambda: _exif_jpeg(40, 100, 6),
    "exif_rotate_90": lambda: _exif_jpeg(70, 30, 8),
    "exif_rotate_180": lambda: _exif_jpeg(33, 80, 3),
    "gif_first_frame": _gif_first_frame_transparent,
    "bmp": lambda: _encode(Image.fromarray(_noise(31, 29)), "BMP"),
    "webp": lambda: _encode(Image.fromarray(_noise(64, 48)), "WEBP", quality=80),
    "cmyk_jpeg": lambda: _encode(Image.fromarray(_noise(30, 40)).convert("CMYK"), "JPEG"),
    "sixteen_bit_gray": lambda: _encode(Image.fromarray((_noise(20, 30, channels=1).astype(np.uint16) * 3)), "PNG"),
}


def _oracle_input(data: bytes):
    from transformers.image_utils import load_image

    opened = Image.open(io.BytesIO(data))
    if "A" in opened.getbands() or opened.info.get("transparency") is not None:
        return opened
    return load_image(base64.b64encode(data).decode("ascii"))


@pytest.fixture(scope="module")
def hf_processor():
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    return Glm5NextImageProcessorPil()


@pytest.mark.parametrize("name", sorted(CASES))
def test_image_matches_transformers(name: str, hf_processor) -> None:
    data = CASES[name]()
    ours = preprocess_image(data, MediaCaps())
    ref = hf_processor(images=[_oracle_input(data)], return_tensors="np")

    assert ours.image_grid_thw.dtype == np.int64
    assert ours.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert float(np.abs(ours.pixel_values - ref["pixel_values"]).max()) <= TOL
    _, grid_h, grid_w = ours.image_grid_thw[0]
    assert ours.num_tokens == grid_h * grid_w // 4
    assert ours.pixel_values.shape[1] == 3 * 2 * 14 * 14


def test_exif_orientation_swaps_the_grid() -> None:
    stored_wide = _exif_jpeg(40, 100, 6)  # stored 100 wide x 40 high, displayed rotated: tall
    upright = _exif_jpeg(40, 100, 1)
    _, rot_h, rot_w = preprocess_image(stored_wide).image_grid_thw[0]
    _, up_h, up_w = preprocess_image(upright).image_grid_thw[0]
    assert (rot_h, rot_w) == (up_w, up_h)
    assert rot_h > rot_w


def test_large_image_is_downscaled_into_the_token_budget() -> None:
    settings = ProcessorSettings()
    out = preprocess_image(CASES["large_jpeg_downscaled"](), MediaCaps(), settings)
    assert out.num_tokens <= settings.image_max_tokens
    # The canvas is about the budget, not far below: at least 90% of it is used.
    assert out.num_tokens >= 0.9 * settings.image_max_tokens


def test_checkpoint_settings_change_the_budget(tiny_checkpoint_dir, hf_processor) -> None:
    """The tiny checkpoint ships min/max_image_tokens 4/64: both sides must honour them."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    settings = ProcessorSettings.from_checkpoint(tiny_checkpoint_dir)
    assert (settings.image_min_tokens, settings.image_max_tokens) == (4, 64)
    hf_small = Glm5NextImageProcessorPil(min_image_tokens=4, max_image_tokens=64)
    for name in ("odd_rgb_png", "very_wide", "one_by_one", "exif_rotate_270"):
        data = CASES[name]()
        ours = preprocess_image(data, MediaCaps(), settings)
        ref = hf_small(images=[_oracle_input(data)], return_tensors="np")
        assert ours.image_grid_thw.tolist() == ref["image_grid_thw"].tolist(), name
        assert float(np.abs(ours.pixel_values - ref["pixel_values"]).max()) <= TOL, name
        assert ours.num_tokens <= 64
