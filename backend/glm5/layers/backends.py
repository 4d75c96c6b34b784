"""Which implementation runs each hot block: capability-gated auto choice, explicit override, fail-fast.

The choices (each set by ``GLM5_<NAME>_BACKEND`` or :func:`set_backends`):

* ``kda``: ``torch`` (the reference recurrence / chunked WY form in :mod:`glm5.layers.kda`, runs
  anywhere) or ``fla`` (fla-core's Triton ``chunk_kda`` / ``fused_recurrent_kda`` with the gate, l2
  norms and β sigmoid computed in the kernels, and its ``causal_conv1d`` for prefill; CUDA only).
* ``attn``: ``torch`` (explicit einsum attention, the CPU reference) or ``sdpa`` (PyTorch's fused
  scaled-dot-product attention with a boolean selection mask, used for prefill on CUDA).
* ``decode_attn``: the sparse NoPE MLA decode of the batched decode path — ``triton``, ``flashinfer``
  or ``torch``.
* ``index``, ``moe``, ``mhc``: our Triton kernels (``glm5_kernels``) or their torch references.
* ``fp8_linear``: linears stored in block-scaled fp8 - ``triton`` (:mod:`glm5_kernels.fp8_linear`: our fp8
  GEMV / small-M GEMM, ``torch._scaled_mm`` or a Triton w8a8 GEMM, chosen per shape) or ``torch`` (dequantise
  the weight on every call, :mod:`glm5_kernels.fp8_ref`).
* ``sampling``: ``torch`` or FlashInfer's fused sampling for unseeded rows.

``auto`` picks the fast path when the tensors live on a CUDA device, the library imports and the
dtype/shape is one the kernels take, else the torch path (FlashInfer is never auto: see
:func:`decode_attn_backend`). An explicit choice
that cannot run raises :class:`BackendUnavailable` naming the reason — never a silent fallback,
because a silently slower (or differently rounded) path makes benchmark and oracle results lie.
One documented exception inside the fla path: speculative-verification chunks that must record
every row's KDA state run the reference recurrence (fla 0.6.0 cannot write per-row states outside
the slot pool in place); they are a few rows per request.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

KDA_CHOICES = ("auto", "torch", "fla")
ATTN_CHOICES = ("auto", "torch", "sdpa")
DECODE_ATTN_CHOICES = ("auto", "torch", "triton", "flashinfer")
SAMPLING_CHOICES = ("auto", "torch", "flashinfer")
MOE_CHOICES = ("auto", "torch", "triton")
INDEX_CHOICES = ("auto", "torch", "triton")
MHC_CHOICES = ("auto", "torch", "triton")
FP8_LINEAR_CHOICES = ("auto", "torch", "triton")

_overrides: dict[str, str] = {}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here (missing library or wrong device)."""


def set_backends(kda: str | None = None, attn: str | None = None, decode_attn: str | None = None,
                 sampling: str | None = None, moe: str | None = None, index: str | None = None,
                 mhc: str | None = None, fp8_linear: str | None = None) -> None:
    """Override the environment for this process (``None`` leaves a setting unchanged)."""
    for name, value, choices in (("kda", kda, KDA_CHOICES), ("attn", attn, ATTN_CHOICES),
                                 ("decode_attn", decode_attn, DECODE_ATTN_CHOICES),
                                 ("sampling", sampling, SAMPLING_CHOICES), ("moe", moe, MOE_CHOICES),
                                 ("index", index, INDEX_CHOICES), ("mhc", mhc, MHC_CHOICES),
                                 ("fp8_linear", fp8_linear, FP8_LINEAR_CHOICES)):
        if value is not None:
            _validate(name, value, choices)
            _overrides[name] = value


def reset_backends() -> None:
    """Drop every :func:`set_backends` override (tests)."""
    _overrides.clear()


def _validate(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}_backend={value!r}: choose one of {', '.join(choices)} "
                         f"(env GLM5_{name.upper()}_BACKEND)")


def _requested(name: str, choices: tuple[str, ...]) -> str:
    value = _overrides.get(name) or os.environ.get(f"GLM5_{name.upper()}_BACKEND", "auto")
    _validate(name, value, choices)
    return value


@functools.lru_cache(maxsize=None)
def import_error(module: str) -> str | None:
    """``None`` if ``module`` imports, else the reason (cached: each optional library is probed once)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or triton failing to find a driver
        return f"{type(e).__name__}: {e}"
    return None


FLA_MODULE = "fla.ops.kda"                          # fla-core's KDA ops
TRITON_MODULE = "glm5_kernels.sparse_mla_decode"    # Triton and our kernels
FLASHINFER_MODULE = "flashinfer"                    # its kernels still JIT-compile on first use


def kda_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"fla"`` or ``"torch"`` for KDA on ``device``.

    ``auto`` keeps fp32 on the torch path: fla's chunked kernel runs its matmuls at reduced
    precision (1.3e-3 relative error in fp32 at the real shape, measured on the H200), which is
    enough to flip greedy tokens against the fp32 oracle (10/20 prompts vs 20/20 with torch)."""
    want = _requested("kda", KDA_CHOICES)
    if want == "torch":
        return "torch"
    on_cuda = device.type == "cuda"
    err = import_error(FLA_MODULE) if on_cuda else "tensors are not on a CUDA device"
    if want == "fla" and err is not None:
        raise BackendUnavailable(
            f"kda_backend='fla' cannot run: {err}. Install fla-core==0.6.0 (the 'gpu' extra) and run on CUDA, "
            "or set GLM5_KDA_BACKEND=torch")
    if want == "auto" and dtype == torch.float32:
        return "torch"
    return "fla" if err is None else "torch"


@functools.lru_cache(maxsize=1)
def flashinfer_jit_error() -> str | None:
    """``None`` if FlashInfer's kernels can be built or loaded here: nvcc is on PATH (first use JIT-compiles,
    ~90 s once, cached) or compiled modules are already installed (``glm5_kernels.flashinfer_mla --warmup`` /
    ``--install-prebuilt``)."""
    import shutil
    if shutil.which("nvcc"):
        return None
    try:
        from flashinfer.jit import env as jit_env
        from pathlib import Path
        for root in (jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR):
            if any(Path(root).glob("*/*.so")):
                return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no nvcc on PATH and no compiled FlashInfer modules (run python -m glm5_kernels.flashinfer_mla --warmup)"


FLASHINFER_MLA_WIDTHS = (128, 256, 512)  # FA3 MLA's head_dim_ckv on SM90


def _flashinfer_error(device: torch.device, dtype: torch.dtype | None, latent_width: int | None = None) -> str | None:
    if device.type != "cuda":
        return "tensors are not on a CUDA device"
    err = import_error(FLASHINFER_MODULE)
    if err is None and not _sm90_or_newer(device):
        err = f"GPU capability {torch.cuda.get_device_capability(device)} < (9, 0)"
    if err is None and dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        err = f"dtype {dtype} (FlashInfer's kernels take bf16/fp16)"
    if err is None and latent_width is not None and latent_width not in FLASHINFER_MLA_WIDTHS:
        err = f"kv_lora_rank {latent_width} (FlashInfer's FA3 MLA takes {FLASHINFER_MLA_WIDTHS})"
    return err or flashinfer_jit_error()


def _sm90_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def decode_attn_backend(device: torch.device, dtype: torch.dtype | None = None, latent_width: int | None = None) -> str:
    """``"triton"``, ``"flashinfer"`` or ``"torch"`` for the sparse NoPE MLA decode of the batched decode path
    (speculative-verification rows take the per-request path).

    ``auto`` on CUDA is the Triton kernel (fp32 included, IEEE products), the torch reference on CPU.
    FlashInfer's FA3 MLA runs when asked and it can (imports, SM90+, bf16/fp16, a latent width FA3 takes,
    nvcc or prebuilt modules). Why not auto: on the H200 its kernel is 2.4-5.8x faster per call, but a
    decode step with it was slower end to end (CUDA graphs, b1 ctx 8K: 5.81 ms vs 3.99 ms; b64: 20.4 vs
    19.3 ms) because its host-side plan costs ~1.8 ms per step (bench/results/RESULTS.md)."""
    want = _requested("decode_attn", DECODE_ATTN_CHOICES)
    if want == "torch":
        return "torch"
    if want == "flashinfer":
        err = _flashinfer_error(device, dtype, latent_width)
        if err is not None:
            raise BackendUnavailable(f"decode_attn_backend='flashinfer' cannot run: {err}. Install flashinfer-python "
                                     "(docs/gpu.md, FlashInfer) or set GLM5_DECODE_ATTN_BACKEND=triton|torch")
        return "flashinfer"
    return _triton_or_torch("decode_attn", DECODE_ATTN_CHOICES, device)  # any dtype: fp32 uses IEEE products


TRITON_DTYPES = (torch.bfloat16, torch.float32)  # what the index / MoE / mHC kernels are written and tested for


def _triton_or_torch(name: str, choices: tuple[str, ...], device: torch.device,
                     dtype: torch.dtype | None = None) -> str:
    want = _requested(name, choices)
    if want == "torch":
        return "torch"
    err = import_error(TRITON_MODULE) if device.type == "cuda" else "tensors are not on a CUDA device"
    if err is None and dtype is not None and dtype not in TRITON_DTYPES:
        err = f"dtype {dtype} (the Triton kernels take bf16 or fp32)"
    if want == "triton" and err is not None:
        raise BackendUnavailable(f"{name}_backend='triton' cannot run: {err}. Run on CUDA, or set "
                                 f"GLM5_{name.upper()}_BACKEND=torch")
    return "triton" if err is None else "torch"


def moe_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (fused grouped-GEMM MoE, no host sync) or ``"torch"`` (per-expert loop, the reference)."""
    return _triton_or_torch("moe", MOE_CHOICES, device, dtype)


def mhc_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (fused mHC pre + block RMSNorm and post: 3 launches per site instead of ~150) or ``"torch"``."""
    return _triton_or_torch("mhc", MHC_CHOICES, device, dtype)


def fp8_linear_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (fp8 GEMV / GEMM kernels reading the fp8 weight and its scales) or ``"torch"`` (dequantise the
    weight per call, then ``F.linear``: the CPU path and the kernels' reference) for fp8-stored linears."""
    return _triton_or_torch("fp8_linear", FP8_LINEAR_CHOICES, device, dtype)


def index_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (kpool append/compress and index-score kernels) or ``"torch"`` (their references) for the
    indexer (batched decode and prefill scoring / pool completion)."""
    return _triton_or_torch("index", INDEX_CHOICES, device, dtype)


def sampling_backend(device: torch.device) -> str:
    """``"flashinfer"`` or ``"torch"`` for sampling rows without a per-request seed (seeded rows always take the
    reproducible torch path). ``auto`` is torch: FlashInfer's fused top-k/top-p sampling is opt-in (its
    distribution is checked on the H200; its speed inside the engine is not measured yet)."""
    want = _requested("sampling", SAMPLING_CHOICES)
    if want != "flashinfer":
        return "torch"
    err = _flashinfer_error(device, None)
    if err is not None:
        raise BackendUnavailable(f"sampling_backend='flashinfer' cannot run: {err}. Install flashinfer-python "
                                 "or set GLM5_SAMPLING_BACKEND=torch")
    return "flashinfer"


def attn_backend(device: torch.device) -> str:
    """``"sdpa"`` or ``"torch"`` for the MLA prefill attention on ``device``."""
    want = _requested("attn", ATTN_CHOICES)
    if want == "torch":
        return "torch"
    if want == "sdpa" and device.type != "cuda":
        raise BackendUnavailable("attn_backend='sdpa' is the CUDA prefill path; on CPU use GLM5_ATTN_BACKEND=torch "
                                 "or auto")
    return "sdpa" if device.type == "cuda" else "torch"
