"""Header-level probe of video containers: frame size and codec, without decoding anything.

decord exposes frame count and fps but not the frame size before a frame is decoded, and decoding
one 8K frame already costs ~100 MB (more inside the decoder). So we read the size and codec from the
container's own headers -- ISO-BMFF (MP4/MOV) sample descriptions, Matroska/WebM track entries, AVI
stream formats -- and refuse oversized frames and codecs the bundled decoder cannot handle before
decord sees the bytes. Anything else is refused as an unsupported container: accepting arbitrary
ffmpeg demuxers would bypass the size check.

The parsers only walk box/element headers with bounds checks; malformed input raises
:class:`~glm5.multimodal.errors.MediaDecodeError`.
"""

from __future__ import annotations

import dataclasses
import struct

from .errors import EmptyMediaError, MediaDecodeError, UnsupportedMediaError

__all__ = ["VideoStreamInfo", "probe_container", "SUPPORTED_CODECS"]

#: Codecs the decoder (decord's bundled FFmpeg) decodes, by human-readable name.
SUPPORTED_CODECS = ("h264", "hevc", "mpeg4", "vp8", "vp9", "mjpeg")

_MP4_CODECS = {
    b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc", b"mp4v": "mpeg4",
    b"vp08": "vp8", b"vp09": "vp9", b"mjpa": "mjpeg", b"mjpb": "mjpeg", b"jpeg": "mjpeg",
}
_MKV_CODECS = {
    "V_MPEG4/ISO/AVC": "h264", "V_MPEGH/ISO/HEVC": "hevc", "V_MPEG4/ISO/ASP": "mpeg4",
    "V_MPEG4/ISO/SP": "mpeg4", "V_MPEG4/ISO/AP": "mpeg4", "V_VP8": "vp8", "V_VP9": "vp9",
    "V_MJPEG": "mjpeg",
}
_AVI_CODECS = {
    b"H264": "h264", b"X264": "h264", b"AVC1": "h264", b"HEVC": "hevc", b"H265": "hevc",
    b"FMP4": "mpeg4", b"XVID": "mpeg4", b"DIVX": "mpeg4", b"DX50": "mpeg4", b"MP4V": "mpeg4",
    b"MJPG": "mjpeg", b"VP80": "vp8", b"VP90": "vp9",
}


@dataclasses.dataclass(frozen=True)
class VideoStreamInfo:
    """What the container header says about its (largest) video stream."""

    container: str
    codec: str
    width: int
    height: int


def probe_container(data: bytes) -> VideoStreamInfo:
    """Identify the container and return the video stream's coded size and codec.

    Raises :class:`UnsupportedMediaError` for unknown containers or codecs and
    :class:`MediaDecodeError` when the header is malformed or has no video stream.
    """
    if len(data) >= 12 and data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        streams = _probe_iso_bmff(data)
        container = "mp4/mov"
    elif data[:4] == b"\x1a\x45\xdf\xa3":
        streams = _probe_matroska(data)
        container = "matroska/webm"
    elif data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        streams = _probe_avi(data)
        container = "avi"
    else:
        raise UnsupportedMediaError(
            f"unsupported video container (first bytes {data[:12]!r}); supported: MP4/MOV, Matroska/WebM, AVI"
        )
    if not streams:
        raise MediaDecodeError(f"the {container} header describes no video stream")
    largest = max(streams, key=lambda s: s[1] * s[2])
    codec_tag, width, height, codec = largest
    if codec is None:
        raise UnsupportedMediaError(
            f"unsupported video codec {codec_tag!r} in {container}; supported: {', '.join(SUPPORTED_CODECS)}"
        )
    return VideoStreamInfo(container=container, codec=codec, width=width, height=height)


# ISO base media file format (MP4, MOV) --------------------------------------------------------------

def _iter_boxes(data: bytes, start: int, end: int):
    """Yield ``(type, payload_start, payload_end)`` for the boxes in ``data[start:end]``."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if pos + 16 > end:
                raise MediaDecodeError("truncated 64-bit MP4 box header")
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = end - pos
        if size < header:
            raise MediaDecodeError(f"malformed MP4 box {kind!r} (size {size} at offset {pos})")
        if pos + size > end:
            raise MediaDecodeError(
                f"truncated MP4/MOV: box {kind!r} at offset {pos} claims {size} bytes but only {end - pos} remain"
            )
        yield kind, pos + header, pos + size
        pos += size


def _child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for box, s, e in _iter_boxes(data, start, end):
        if box == kind:
            return s, e
    return None


def _probe_iso_bmff(data: bytes) -> list[tuple[object, int, int, str | None]]:
    moov = _child(data, 0, len(data), b"moov")
    if moov is None:
        raise MediaDecodeError("MP4/MOV without a 'moov' header box (truncated or not a movie)")
    streams = []
    for box, t_start, t_end in _iter_boxes(data, *moov):
        if box != b"trak":
            continue
        mdia = _child(data, t_start, t_end, b"mdia")
        if mdia is None:
            continue
        hdlr = _child(data, *mdia, b"hdlr")
        if hdlr is None or hdlr[1] - hdlr[0] < 12 or data[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
            continue
        stsd = None
        minf = _child(data, *mdia, b"minf")
        stbl = _child(data, *minf, b"stbl") if minf else None
        stsd = _child(data, *stbl, b"stsd") if stbl else None
        if stsd is None or stsd[1] - stsd[0] < 8:
            raise MediaDecodeError("MP4/MOV video track without a sample description")
        stsz = _child(data, *stbl, b"stsz")
        fragmented = _child(data, 0, len(data), b"moof") is not None
        if stsz is not None and stsz[1] - stsz[0] >= 12 and not fragmented:
            (sample_count,) = struct.unpack_from(">I", data, stsz[0] + 8)
            if sample_count == 0:
                raise EmptyMediaError("video has no decodable frames (its MP4/MOV track holds 0 samples)")
        # full box header (4) + entry count (4), then sample entries (boxes) with the visual fields
        # width/height at offsets 24/26 of the entry payload.
        for fourcc, e_start, e_end in _iter_boxes(data, stsd[0] + 8, stsd[1]):
            if e_end - e_start < 28:
                raise MediaDecodeError(f"truncated MP4 visual sample entry {fourcc!r}")
            width, height = struct.unpack_from(">HH", data, e_start + 24)
            streams.append((fourcc.decode("latin-1"), width, height, _MP4_CODECS.get(fourcc)))
    return streams


# Matroska / WebM (EBML) ------------------------------------------------------------------------------

_EBML_UNKNOWN = -1
_SEGMENT, _TRACKS, _TRACK_ENTRY, _CLUSTER = 0x18538067, 0x1654AE6B, 0xAE, 0x1F43B675
_TRACK_TYPE, _CODEC_ID, _VIDEO, _PIXEL_W, _PIXEL_H = 0x83, 0x86, 0xE0, 0xB0, 0xBA


def _read_vint(data: bytes, pos: int, end: int, keep_marker: bool) -> tuple[int, int]:
    if pos >= end:
        raise MediaDecodeError("truncated Matroska element header")
    first = data[pos]
    length = 1
    mask = 0x80
    while length <= 8 and not first & mask:
        mask >>= 1
        length += 1
    if length > 8 or pos + length > end:
        raise MediaDecodeError(f"invalid Matroska variable-length integer at offset {pos}")
    value = first if keep_marker else first & (mask - 1)
    all_ones = (first & (mask - 1)) == mask - 1
    for i in range(1, length):
        value = (value << 8) | data[pos + i]
        all_ones = all_ones and data[pos + i] == 0xFF
    if not keep_marker and all_ones:
        value = _EBML_UNKNOWN
    return value, pos + length


def _iter_elements(data: bytes, start: int, end: int):
    """Yield ``(id, payload_start, payload_end)``; unknown sizes extend to ``end``."""
    pos = start
    while pos < end:
        element_id, pos = _read_vint(data, pos, end, keep_marker=True)
        size, pos = _read_vint(data, pos, end, keep_marker=False)
        payload_end = end if size == _EBML_UNKNOWN else pos + size
        if payload_end > end:
            payload_end = end  # a truncated trailing element: parse what is there
        yield element_id, pos, payload_end
        pos = payload_end


def _uint(data: bytes, start: int, end: int) -> int:
    if end - start > 8:
        raise MediaDecodeError("oversized Matroska integer element")
    return int.from_bytes(data[start:end], "big") if end > start else 0


def _probe_matroska(data: bytes) -> list[tuple[object, int, int, str | None]]:
    streams = []
    for element_id, s_start, s_end in _iter_elements(data, 0, len(data)):
        if element_id != _SEGMENT:
            continue
        for child_id, c_start, c_end in _iter_elements(data, s_start, s_end):
            if child_id == _CLUSTER:
                break  # media data starts; track headers precede it
            if child_id != _TRACKS:
                continue
            for entry_id, e_start, e_end in _iter_elements(data, c_start, c_end):
                if entry_id != _TRACK_ENTRY:
                    continue
                track_type, codec_id, width, height = None, "", 0, 0
                for field_id, f_start, f_end in _iter_elements(data, e_start, e_end):
                    if field_id == _TRACK_TYPE:
                        track_type = _uint(data, f_start, f_end)
                    elif field_id == _CODEC_ID:
                        codec_id = data[f_start:f_end].rstrip(b"\0").decode("ascii", "replace")
                    elif field_id == _VIDEO:
                        for v_id, v_start, v_end in _iter_elements(data, f_start, f_end):
                            if v_id == _PIXEL_W:
                                width = _uint(data, v_start, v_end)
                            elif v_id == _PIXEL_H:
                                height = _uint(data, v_start, v_end)
                if track_type == 1:
                    streams.append((codec_id, width, height, _MKV_CODECS.get(codec_id)))
            if streams and not any(i == _CLUSTER for i, _, _ in _iter_elements(data, c_end, s_end)):
                raise EmptyMediaError("video has no decodable frames (the Matroska file has no Cluster)")
            return streams
        break
    return streams


# AVI (RIFF) ------------------------------------------------------------------------------------------

def _iter_chunks(data: bytes, start: int, end: int):
    pos = start
    while pos + 8 <= end:
        fourcc, size = struct.unpack_from("<4sI", data, pos)
        payload_end = min(pos + 8 + size, end)
        yield fourcc, pos + 8, payload_end
        pos = pos + 8 + size + (size & 1)


def _probe_avi(data: bytes) -> list[tuple[object, int, int, str | None]]:
    streams = []
    for fourcc, start, end in _iter_chunks(data, 12, len(data)):
        if fourcc != b"LIST" or data[start : start + 4] != b"hdrl":
            continue
        for sub, s_start, s_end in _iter_chunks(data, start + 4, end):
            if sub != b"LIST" or data[s_start : s_start + 4] != b"strl":
                continue
            is_video = False
            for kind, k_start, k_end in _iter_chunks(data, s_start + 4, s_end):
                if kind == b"strh" and k_end - k_start >= 4:
                    is_video = data[k_start : k_start + 4] == b"vids"
                elif kind == b"strf" and is_video:
                    if k_end - k_start < 20:
                        raise MediaDecodeError("truncated AVI video stream format")
                    width, height = struct.unpack_from("<ii", data, k_start + 4)
                    compression = data[k_start + 16 : k_start + 20]
                    streams.append((
                        compression.decode("latin-1"), abs(width), abs(height),
                        _AVI_CODECS.get(compression.upper()),
                    ))
        break
    return streams
