"""Image decoding (pillow) and Glm5Next image preprocessing, with caps checked from the header.

Pipeline for one encoded image, equal to transformers' ``Glm5NextImageProcessorPil`` fed the same
bytes the way transformers loads encoded images:

1. ``Image.open`` (lazy: reads only the header) restricted to JPEG (incl. MPO), PNG, WebP, GIF, BMP;
   the header's size is checked against :attr:`MediaCaps.max_image_pixels` *before* ``load()``.
2. EXIF orientation is applied (``ImageOps.exif_transpose``), as transformers' ``load_image`` does
   for URLs, paths and base64 strings. (A caller handing transformers an already-open PIL image
   skips this step there; we always receive encoded bytes, so we always apply it.)
3. RGB conversion as transformers' ``convert_to_rgb``: images with an alpha band or a palette
   transparency are composited onto white, everything else is ``convert("RGB")`` (grayscale,
   palette, CMYK...). GIFs contribute their first frame.
4. Resize (BICUBIC, pillow) to the content size of the token-budget rule, zero-pad to multiples of
   28, normalise with CLIP mean/std, and cut into ``[grid_h*grid_w, 1176]`` rows (frame repeated
   twice in time). See :mod:`glm5.multimodal.geometry`.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import struct
import warnings

import numpy as np
from PIL import Image, ImageOps
# Register exactly the decoders we accept; ``Image.open(formats=...)`` needs them loaded up front.
from PIL import BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin  # noqa: F401

from .caps import MediaCaps, ProcessorSettings
from .errors import EmptyMediaError, MediaCapExceededError, MediaDecodeError, check_encoded_size, describe
from .geometry import CanvasPlan, apply_normalization, image_normalization_table, patchify, plan_canvas

logger = logging.getLogger(__name__)

__all__ = ["ImageInputs", "ImageProbe", "probe_image", "decode_probed_image", "preprocess_image", "SUPPORTED_IMAGE_FORMATS"]

#: Pillow format plugins we let ``Image.open`` try (its JPEG plugin also opens the MPO files many
#: phones write). Everything else (TIFF, EPS -> ghostscript, ICO, PSD, ...) is refused to keep the
#: attack surface small.
SUPPORTED_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

# EXIF orientations 5..8 swap width and height.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION_TAG = 0x0112


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """Preprocessed image, ready for the vision tower.

    Attributes:
        pixel_values: ``[grid_h * grid_w, 1176]`` float32 patch rows, tower order.
        image_grid_thw: ``[1, 3]`` int64 ``(1, grid_h, grid_w)`` in 14 px patches.
        num_tokens: placeholder tokens in the prompt (``grid_h * grid_w / 4``).
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    num_tokens: int


@dataclasses.dataclass
class ImageProbe:
    """Header-level facts about an image, enough to budget tokens before decoding it."""

    format: str
    width: int
    height: int
    plan: CanvasPlan
    num_tokens: int
    grid_thw: tuple[int, int, int]
    _image: Image.Image = dataclasses.field(repr=False)


def probe_image(data: bytes, caps: MediaCaps, settings: ProcessorSettings | None = None) -> ImageProbe:
    """Open the image lazily, check the caps and plan its canvas; no pixel data is decoded yet."""
    settings = settings or ProcessorSettings()
    check_encoded_size("image", data, "max_image_bytes", caps.max_image_bytes,
                       "send a smaller or more compressed image")
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its own bomb limit; our cap below is the authority.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=SUPPORTED_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        size = _sniff_size(data)
        what = f"decoded image pixel count ({size[0]}x{size[1]})" if size else "decoded image pixel count"
        raise MediaCapExceededError(
            what, cap="max_image_pixels", value=size[0] * size[1] if size else float("inf"),
            limit=caps.max_image_pixels, hint="downscale the image before sending it",
        ) from exc
    except Image.UnidentifiedImageError as exc:
        size = _sniff_size(data)
        if size is not None and 0 in size:
            raise EmptyMediaError(f"image has a zero dimension ({size[0]}x{size[1]} pixels)") from exc
        raise MediaDecodeError(
            f"not a decodable image in a supported format ({', '.join(SUPPORTED_IMAGE_FORMATS)}): {describe(exc)}"
        ) from exc
    except (OSError, SyntaxError, ValueError, struct.error) as exc:
        raise MediaDecodeError(f"malformed image header: {describe(exc)}") from exc

    width, height = image.size
    if width <= 0 or height <= 0:
        raise EmptyMediaError(f"image has a zero dimension ({width}x{height} pixels)")
    pixels = width * height
    if pixels > caps.max_image_pixels:
        raise MediaCapExceededError(
            f"decoded image pixel count ({width}x{height})", cap="max_image_pixels", value=pixels,
            limit=caps.max_image_pixels, hint="downscale the image before sending it",
        )
    orientation = _exif_orientation(image)
    if orientation in _TRANSPOSING_ORIENTATIONS:
        width, height = height, width
    plan = plan_canvas(
        settings.temporal_patch_size, height, width, temporal_factor=settings.temporal_patch_size,
        factor=settings.factor, min_tokens=settings.image_min_tokens, max_tokens=settings.image_max_tokens,
    )
    grid_h, grid_w = plan.canvas_height // settings.patch_size, plan.canvas_width // settings.patch_size
    num_tokens = grid_h * grid_w // (settings.merge_size**2)
    return ImageProbe(
        format=image.format or "?", width=width, height=height, plan=plan, num_tokens=num_tokens,
        grid_thw=(1, grid_h, grid_w), _image=image,
    )


def decode_probed_image(probe: ImageProbe, settings: ProcessorSettings | None = None) -> ImageInputs:
    """Decode, orient, convert, resize, normalise and patchify a probed image."""
    settings = settings or ProcessorSettings()
    image = probe._image
    try:
        image = ImageOps.exif_transpose(image)  # loads the pixels
        rgb = _to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise MediaDecodeError(f"could not decode the {probe.format} image: {describe(exc)}") from exc
    plan = probe.plan
    if rgb.size != (plan.width, plan.height):  # header and decoded size disagree: trust the pixels
        raise MediaDecodeError(
            f"decoded {probe.format} image is {rgb.size[0]}x{rgb.size[1]}, header said {plan.width}x{plan.height}"
        )
    if plan.needs_resize:
        rgb = rgb.resize((plan.content_width, plan.content_height), resample=Image.Resampling.BICUBIC)
    canvas = np.zeros((1, 3, plan.canvas_height, plan.canvas_width), dtype=np.uint8)
    canvas[0, :, : plan.content_height, : plan.content_width] = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    table = image_normalization_table(settings.image_mean, settings.image_std, settings.rescale_factor)
    normalized = apply_normalization(canvas, table)
    # The tower sees an image as a clip of identical frames: repeat it in time (a view, no copy).
    frames = np.broadcast_to(normalized, (settings.temporal_patch_size, *normalized.shape[1:]))
    pixel_values, (_, grid_h, grid_w) = patchify(
        frames, patch_size=settings.patch_size, merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
    )
    return ImageInputs(
        pixel_values=pixel_values,
        image_grid_thw=np.array([[1, grid_h, grid_w]], dtype=np.int64),
        num_tokens=probe.num_tokens,
    )


def preprocess_image(data: bytes, caps: MediaCaps | None = None, settings: ProcessorSettings | None = None) -> ImageInputs:
    """Encoded image bytes -> tower inputs. Raises a :class:`~glm5.multimodal.errors.MediaError`."""
    caps = caps or MediaCaps()
    probe = probe_image(data, caps, settings)
    if probe.num_tokens > caps.max_visual_tokens:
        raise MediaCapExceededError(
            "visual tokens of the image", cap="max_visual_tokens", value=probe.num_tokens,
            limit=caps.max_visual_tokens,
        )
    return decode_probed_image(probe, settings)


def _sniff_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` from a PNG/GIF/BMP header, for precise messages where pillow gives up."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"BM" and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return abs(width), abs(height)
    return None


def _exif_orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(_EXIF_ORIENTATION_TAG, 1))
    except Exception:  # noqa: BLE001 - a broken EXIF block must not reject an otherwise fine image
        logger.debug("ignoring unreadable EXIF block", exc_info=True)
        return 1


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' ``convert_to_rgb``: transparency composited onto white."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")
