"""Finding a checkpoint's safetensors files and reading their headers without touching the data.

Headers are parsed here (not through ``safe_open``) so that a truncated or corrupt shard becomes
one readable problem line instead of an exception that hides every other problem, and so that all
names, dtypes and shapes can be validated before a single byte of tensor data is read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: safetensors dtype code -> (torch dtype, bytes per element)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
FP8_CODES = frozenset({"F8_E4M3", "F8_E5M2"})
_MAX_HEADER = 100 * 1024 * 1024  # same cap as the safetensors library


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a shard header."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ST_DTYPES[self.dtype][1]
        for s in self.shape:
            n *= s
        return n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header.

    Raises ``ValueError`` with a one-line reason if the file is unreadable, truncated (the data
    region ends before the last tensor) or its header is not valid safetensors.
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"only {size} bytes, smaller than a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in the {size}-byte file (truncated or not "
                                 "a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object; the file is corrupt")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    furthest = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"header entry for {key!r} is malformed ({meta!r})") from e
        if dtype not in ST_DTYPES:
            raise ValueError(f"tensor {key!r} has dtype {dtype!r}, which this loader does not support "
                             f"(supported: {', '.join(ST_DTYPES)})")
        info = TensorInfo(key, file, dtype, shape)
        if end - begin != info.nbytes or begin < 0:
            raise ValueError(f"tensor {key!r}: data offsets {begin}..{end} do not match shape {list(shape)} "
                             f"of {dtype}; the file is corrupt")
        furthest = max(furthest, end)
        out[key] = info
    if furthest > data_len:
        raise ValueError(f"truncated: tensors need {furthest} data bytes but the file holds only {data_len}")
    return out


def find_weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """Locate the weights of a checkpoint.

    Returns ``(files, weight_map, index_file)``: with an index, ``files`` are the distinct shards it
    names (existing or not: the caller reports missing ones) and ``weight_map`` maps key -> shard
    name; otherwise ``model.safetensors`` alone, or every ``*.safetensors`` in the directory.
    ``path`` may also be a single ``.safetensors`` file or an index file. Raises ``FileNotFoundError``
    / ``ValueError`` with the fix when there is nothing to load.
    """
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist; pass a checkpoint directory "
                                "(config.json + *.safetensors)")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _from_index(path)
        if path.suffix == ".safetensors":
            return [path], None, None
        raise ValueError(f"{path} is not a safetensors file or index; pass the checkpoint directory")
    index = path / INDEX_FILE
    if index.is_file():
        return _from_index(index)
    single = path / SINGLE_FILE
    if single.is_file():
        return [single], None, None
    others = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if others:
        return others, None, None
    foreign = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
    hint = (f" It holds {', '.join(foreign[:5])}: only safetensors is supported; convert with "
            "transformers' save_pretrained(..., safe_serialization=True).") if foreign else ""
    raise FileNotFoundError(f"no weights in {path}: expected {INDEX_FILE}, {SINGLE_FILE} or *.safetensors.{hint}")


def _from_index(index: Path) -> tuple[list[Path], dict[str, str], Path]:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index ({e}); re-export the checkpoint") from e
    names = sorted(set(weight_map.values()))
    return [index.parent / n for n in names], {str(k): str(v) for k, v in weight_map.items()}, index
