"""Engine failures, and which of them the engine can survive.

A step that raises has two possible causes, handled differently by :class:`~glm5.engine.LLMEngine`:

* something about one request (a shape or index error from inputs that validation let through, an
  out-of-memory for one oversized batch): the step's requests are re-run in halves to find the
  culprit, which alone is failed with :class:`RequestFailedError`; the others continue.
* the device itself: after a CUDA error (illegal address, device-side assert, ECC, launch
  failure, cuBLAS/cuDNN/NCCL failure) the CUDA context is unusable for the life of the process and
  every later kernel fails too. Those are *unrecoverable*: the engine raises
  :class:`EngineDeadError` and serves nothing more; the server must go down so that a supervisor
  restarts it (``backend/model.py`` makes tritonserver exit non-zero).

The classification is by exception type (``torch.AcceleratorError``, the CUDA error type of torch
>= 2.8) and, because many CUDA failures still surface as plain ``RuntimeError``, by the message
prefixes the CUDA runtime and its libraries use. ``torch.OutOfMemoryError`` is *not* fatal: the
allocator recovers once the failing batch's tensors are gone.
"""

from __future__ import annotations

import torch


class EngineDeadError(RuntimeError):
    """The engine hit an unrecoverable error and serves no more requests; restart the process."""


class RequestFailedError(RuntimeError):
    """One request failed inside an engine step (the others of the step went on)."""


#: Substrings of unrecoverable CUDA / driver / library errors as torch and Triton report them.
UNRECOVERABLE_MARKERS = (
    "CUDA error", "CUDA driver error", "cudaError", "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error",
    "NCCL error", "device-side assert", "illegal memory access", "unspecified launch failure",
    "uncorrectable ECC error", "Triton Error [CUDA]",
)


def is_unrecoverable(exc: BaseException) -> bool:
    """True when ``exc`` (or its cause chain) is a device failure after which no step can succeed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EngineDeadError):
            return True
        if isinstance(exc, torch.OutOfMemoryError):
            return False
        accel = getattr(torch, "AcceleratorError", None)
        if accel is not None and isinstance(exc, accel):
            return True
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in UNRECOVERABLE_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
