"""What launchers ask of the device a tensor lives on: its streaming multiprocessors (grid sizes) and its
compute capability (tiles that fit its shared memory), both cached per device; and whether the Triton
interpreter runs the kernels instead."""

from __future__ import annotations

import functools
import os

import torch

def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU): libdevice math is unavailable there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: The H200's SM count, used off the GPU (the Triton interpreter runs launchers on CPU tensors).
DEFAULT_SMS = 132


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device; :data:`DEFAULT_SMS` for any other)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA ``device``; None for any other."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["DEFAULT_SMS", "compute_capability", "interpreting", "sm_count"]
