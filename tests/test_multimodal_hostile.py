"""Hostile media: each input gets its specific error, and none of them makes the process balloon.

All inputs are built here (cheaply: bombs are headers or tiny compressed streams, the 8K and
10-hour videos are small clips whose headers claim more). They are run through the public API in a
fresh subprocess whose peak RSS (``VmHWM`` of its own image, which includes importing torch,
transformers-free) must stay under ``RSS_BOUND_MB``. Not ``ru_maxrss``: Linux carries it over from the
forking process, so under the full suite it reported the pytest process's 2.1 GB. Expanding any one of these inputs naively would need far more:
the PNG bomb alone is 400 M pixels (1.2 GB as RGB), the GIF 65 000 x 1 000 (195 MB), the 8K clip
~100 MB per decoded frame.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib
from fractions import Fraction

import numpy as np
import pytest

#: Peak resident memory allowed for the whole hostile run, torch import included.
RSS_BOUND_MB = 1500

_RUNNER = textwrap.dedent('''
    import json, re, resource, sys
    from pathlib import Path
    import numpy as np
    from glm5.multimodal import MediaCaps, MediaError, MultiModalProcessor, preprocess_image, preprocess_video
    from glm5.multimodal.placeholders import SpecialTokens

    class _Tok:
        """Minimal tokenizer: the hostile cases are about media, not text."""
        ids = {"<|image|>": 1, "<|video|>": 2, "<|begin_of_image|>": 3, "<|end_of_image|>": 4,
               "<|begin_of_video|>": 5, "<|end_of_video|>": 6}
        def token_to_id(self, token):
            return self.ids.get(token)
        def encode(self, text, add_special_tokens=False):
            out, pos = [], 0
            for match in re.finditer("|".join(re.escape(t) for t in self.ids), text):
                out += [7] * (match.start() - pos) + [self.ids[match.group()]]
                pos = match.end()
            return out + [7] * (len(text) - pos)

    cases = json.loads(Path(sys.argv[1]).read_text())
    caps = MediaCaps(**json.loads(sys.argv[2]))
    processor = MultiModalProcessor(_Tok(), caps=caps)
    results = {}
    for name, spec in cases.items():
        data = [Path(p).read_bytes() for p in spec["files"]]
        try:
            if spec["kind"] == "image":
                preprocess_image(data[0], caps)
            elif spec["kind"] == "video":
                preprocess_video(data[0], caps)
            else:
                processor.process(spec["prompt"], images=data[: spec["n_images"]], videos=data[spec["n_images"]:])
            results[name] = {"error": None}
        except MediaError as exc:
            results[name] = {"error": type(exc).__name__, "cap": getattr(exc, "cap", None), "message": str(exc)}
        hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
        rss_kb = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        results[name]["rss_mb"] = rss_kb / 1024
    print(json.dumps(results))
''')


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_with_header(width: int, height: int, bit_depth: int = 8, color_type: int = 0, body: bytes = b"") -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", body) + _png_chunk(b"IEND", b""))


def png_bomb(side: int = 20000) -> bytes:
    """A *valid* 1-bit side x side PNG of zeros: ~50 MB of scanlines compressed to tens of KB."""
    row = b"\x00" * (1 + (side + 7) // 8)
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    return png_with_header(side, side, bit_depth=1, color_type=0, body=body)


def gif_with_screen(width: int, height: int) -> bytes:
    """A GIF whose logical screen is width x height, holding one 1x1 image."""
    header = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return header + image + b"\x3b"


def make_clip(rate, frames: int, width: int = 64, height: int = 48, fmt: str = "mp4", codec: str = "libx264") -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = np.full((height, width, 3), (i * 37) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def claim_8k(mp4: bytes) -> bytes:
    """Rewrite the visual sample entry (and track header) of a small H.264 MP4 to claim 7680x4320."""
    data = bytearray(mp4)
    entry = data.index(b"avc1", data.index(b"stsd"))  # sample entry type; width/height 28/30 bytes on
    # ("avc1" also appears among the ftyp brands, hence the search from the sample description box)
    struct.pack_into(">HH", data, entry + 28, 7680, 4320)
    tkhd = data.index(b"tkhd")
    struct.pack_into(">II", data, tkhd + 4 + 84 - 8, 7680 << 16, 4320 << 16)
    return bytes(data)


def mkv_without_frames(mkv: bytes) -> bytes:
    """A Matroska file cut right before its first Cluster: a video track that has no frames."""
    return mkv[: mkv.index(b"\x1f\x43\xb6\x75")]


def _jpeg(size=(64, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("hostile")
    small_mp4 = make_clip(10, 10)
    inputs: dict[str, tuple[str, list[bytes], dict]] = {
        "truncated_jpeg": ("image", [_jpeg()[: len(_jpeg()) // 2]], {}),
        "random_bytes_image": ("image", [np.random.default_rng(1).bytes(4096)], {}),
        "png_bomb_20000": ("image", [png_bomb()], {}),
        "zero_width_png": ("image", [png_with_header(0, 500)], {}),
        "huge_gif_screen": ("image", [gif_with_screen(65000, 1000)], {}),
        "tiff_not_accepted": ("image", [_tiff()], {}),
        "zero_byte_video": ("video", [b""], {}),
        "video_without_frames": ("video", [mkv_without_frames(make_clip(10, 5, fmt="matroska"))], {}),
        "ten_hour_claim": ("video", [make_clip(Fraction(1, 7200), 5)], {}),
        "8k_header": ("video", [claim_8k(small_mp4)], {}),
        "av1_codec": ("video", [make_clip(10, 4, codec="libsvtav1")], {}),
        "random_bytes_video": ("video", [np.random.default_rng(2).bytes(4096)], {}),
        "truncated_mp4": ("video", [small_mp4[: len(small_mp4) // 2]], {}),
        "too_many_images": ("prompt", [_jpeg()] * 5, {"n_images": 5, "prompt": "<|image|>" * 5}),
        "too_many_videos": ("prompt", [small_mp4] * 3, {"n_images": 0, "prompt": "<|video|>" * 3}),
        "too_many_visual_tokens": ("prompt", [_jpeg((900, 700))] * 3, {"n_images": 3, "prompt": "<|image|>" * 3}),
        "placeholder_mismatch": ("prompt", [_jpeg()], {"n_images": 1, "prompt": "no placeholder"}),
        # Controls: well-formed media run through the same process (so torch is imported and real
        # frames are decoded), proving the runner exercises the full path.
        "control_valid_request": ("prompt", [_jpeg((300, 200)), small_mp4],
                                  {"n_images": 1, "prompt": "<|image|> and <|begin_of_video|><|video|><|end_of_video|>"}),
    }
    cases = {}
    for name, (kind, blobs, extra) in inputs.items():
        files = []
        for i, blob in enumerate(blobs):
            path = work / f"{name}_{i}.bin"
            path.write_bytes(blob)
            files.append(str(path))
        cases[name] = {"kind": kind, "files": files, **extra}
    (work / "cases.json").write_text(json.dumps(cases))
    (work / "runner.py").write_text(_RUNNER)
    caps = {"max_images": 4, "max_videos": 2, "max_visual_tokens": 2000}
    proc = subprocess.run(
        [sys.executable, str(work / "runner.py"), str(work / "cases.json"), json.dumps(caps)],
        capture_output=True, text=True, errors="replace", timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tiff() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    return buf.getvalue()


# name -> (error class, cap or None, text the message must contain)
EXPECTED = {
    "truncated_jpeg": ("MediaDecodeError", None, "could not decode the JPEG image"),
    "random_bytes_image": ("MediaDecodeError", None, "not a decodable image"),
    "png_bomb_20000": ("MediaCapExceededError", "max_image_pixels", "(20000x20000): 400,000,000"),
    "zero_width_png": ("EmptyMediaError", None, "0x500"),
    "huge_gif_screen": ("MediaCapExceededError", "max_image_pixels", "65000x1000"),
    "tiff_not_accepted": ("MediaDecodeError", None, "supported format"),
    "zero_byte_video": ("EmptyMediaError", None, "0 bytes"),
    "video_without_frames": ("EmptyMediaError", None, "no decodable frames"),
    "ten_hour_claim": ("MediaCapExceededError", "max_video_duration_s", "36,000"),
    "8k_header": ("MediaCapExceededError", "max_video_frame_pixels", "7680x4320"),
    "av1_codec": ("UnsupportedMediaError", None, "'av01'"),
    "random_bytes_video": ("UnsupportedMediaError", None, "unsupported video container"),
    "truncated_mp4": ("MediaDecodeError", None, "truncated MP4/MOV"),
    "too_many_images": ("MediaCapExceededError", "max_images", "5"),
    "too_many_videos": ("MediaCapExceededError", "max_videos", "3"),
    "too_many_visual_tokens": ("MediaCapExceededError", "max_visual_tokens", "3 image(s)"),
    "placeholder_mismatch": ("PlaceholderMismatchError", None, "1 image(s)"),
}


def test_control_request_succeeds(hostile_results) -> None:
    assert hostile_results["control_valid_request"]["error"] is None, hostile_results["control_valid_request"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_input_gets_its_specific_error(hostile_results, name: str) -> None:
    error, cap, text = EXPECTED[name]
    got = hostile_results[name]
    assert got["error"] == error, (name, got)
    assert got["cap"] == cap, got
    assert text in got["message"], got
    if cap is not None:
        assert f"{cap}=" in got["message"], got  # the message names the cap and its limit


def test_hostile_inputs_keep_peak_memory_bounded(hostile_results) -> None:
    peak = max(r["rss_mb"] for r in hostile_results.values())
    assert peak < RSS_BOUND_MB, {k: round(v["rss_mb"]) for k, v in hostile_results.items()}


@pytest.mark.parametrize("data", [b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"not an image at all", b"GIF89a" + b"\x01" * 30])
def test_image_decode_errors_show_no_python_object_or_address(data: bytes) -> None:
    """pillow's message names the BytesIO object and its address; clients must not see either."""
    from glm5.multimodal import MediaDecodeError, preprocess_image

    with pytest.raises(MediaDecodeError) as err:
        preprocess_image(data)
    msg = str(err.value)
    assert "object at" not in msg and "0x" not in msg and "BytesIO" not in msg, msg
    assert "not a decodable image" in msg
