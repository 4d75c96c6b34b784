"""Which implementation runs each hot block: capability-gated auto choice, explicit override, fail-fast.

Two kinds of choice exist today:

* ``kda``: ``torch`` (the reference recurrence / chunked WY form in :mod:`glm5.model.kda`, runs
  anywhere) or ``fla`` (fla-core's Triton ``chunk_kda`` / ``fused_recurrent_kda``, CUDA only).
* ``attn``: ``torch`` (explicit einsum attention, the CPU reference) or ``sdpa`` (PyTorch's fused
  scaled-dot-product attention with a boolean selection mask, used for prefill on CUDA).

The setting comes from the ``GLM5_KDA_BACKEND`` / ``GLM5_ATTN_BACKEND`` environment variables or
from :func:`set_backends` (an engine setting can call it); ``auto`` picks the fast path when the
tensors live on a CUDA device and the library imports, else the torch path. An explicit choice
that cannot run raises :class:`BackendUnavailable` naming the reason — never a silent fallback,
because a silently slower (or differently rounded) path makes benchmark and oracle results lie.
One documented exception inside the fla path: speculative-verification chunks that must record
every row's KDA state run the reference recurrence (fla 0.6.0 cannot write per-row states outside
the slot pool in place); they are a few rows per request.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

KDA_CHOICES = ("auto", "torch", "fla")
ATTN_CHOICES = ("auto", "torch", "sdpa")

_overrides: dict[str, str] = {}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here (missing library or wrong device)."""


def set_backends(kda: str | None = None, attn: str | None = None) -> None:
    """Override the environment for this process (``None`` leaves a setting unchanged)."""
    if kda is not None:
        _validate("kda", kda, KDA_CHOICES)
        _overrides["kda"] = kda
    if attn is not None:
        _validate("attn", attn, ATTN_CHOICES)
        _overrides["attn"] = attn


def _validate(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}_backend={value!r}: choose one of {', '.join(choices)} "
                         f"(env GLM5_{name.upper()}_BACKEND)")


def _requested(name: str, choices: tuple[str, ...]) -> str:
    value = _overrides.get(name) or os.environ.get(f"GLM5_{name.upper()}_BACKEND", "auto")
    _validate(name, value, choices)
    return value


@functools.lru_cache(maxsize=1)
def fla_import_error() -> str | None:
    """``None`` if fla-core's KDA ops import, else the reason."""
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to find a driver
        return f"{type(e).__name__}: {e}"
    return None


def kda_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"fla"`` or ``"torch"`` for KDA on ``device``.

    ``auto`` keeps fp32 on the torch path: fla's chunked kernel runs its matmuls at reduced
    precision (1.3e-3 relative error in fp32 at the real shape, measured on the H200), which is
    enough to flip greedy tokens against the fp32 oracle (10/20 prompts vs 20/20 with torch)."""
    want = _requested("kda", KDA_CHOICES)
    if want == "torch":
        return "torch"
    on_cuda = device.type == "cuda"
    err = fla_import_error() if on_cuda else "tensors are not on a CUDA device"
    if want == "fla" and err is not None:
        raise BackendUnavailable(
            f"kda_backend='fla' cannot run: {err}. Install fla-core==0.6.0 (the 'gpu' extra) and run on CUDA, "
            "or set GLM5_KDA_BACKEND=torch")
    if want == "auto" and dtype == torch.float32:
        return "torch"
    return "fla" if err is None else "torch"


def attn_backend(device: torch.device) -> str:
    """``"sdpa"`` or ``"torch"`` for the MLA prefill attention on ``device``."""
    want = _requested("attn", ATTN_CHOICES)
    if want == "torch":
        return "torch"
    if want == "sdpa" and device.type != "cuda":
        raise BackendUnavailable("attn_backend='sdpa' is the CUDA prefill path; on CPU use GLM5_ATTN_BACKEND=torch "
                                 "or auto")
    return "sdpa" if device.type == "cuda" else "torch"
