"""Which implementation runs each hot block: capability-gated auto choice, explicit override, fail-fast.

The choices (each set by ``GLM5_<NAME>_BACKEND`` or :func:`set_backends`):

* ``kda``: ``torch`` (the reference recurrence / chunked WY form in :mod:`glm5.layers.kda`, runs
  anywhere) or ``fla`` (fla-core's Triton ``chunk_kda`` / ``fused_recurrent_kda`` with the gate, l2
  norms and β sigmoid computed in the kernels, and its ``causal_conv1d`` for prefill; CUDA only).
* ``attn``: the MLA attention of prefill chunks (and speculative-verification rows): ``torch`` (explicit
  einsum attention over the selection mask, the CPU reference), ``sdpa`` (PyTorch's fused
  scaled-dot-product attention with the boolean selection mask, expanded K/V; fp32 on CUDA) or ``triton``
  (:mod:`glm5_kernels.sparse_mla_prefill`: each query attends only to its selected latent rows, absorbed
  weights; bf16 on CUDA). Chunks that are dense causal from position 0 run SDPA's causal flash kernel on
  both CUDA paths.
* ``decode_attn``: the sparse NoPE MLA decode of the batched decode path — ``triton``, ``flashinfer``
  or ``torch``.
* ``index``, ``moe``, ``mhc``: our Triton kernels (``glm5_kernels``) or their torch references.
* ``fp8_linear``: linears stored in block-scaled fp8 - ``triton`` (:mod:`glm5_kernels.fp8_linear`: our fp8
  GEMV / small-M GEMM, ``torch._scaled_mm`` or a Triton w8a8 GEMM, chosen per shape) or ``torch`` (dequantise
  the weight on every call, :mod:`glm5_kernels.fp8_ref`).
* ``kda_step``: the KDA recurrences of the batched path over the state-slot pool - the decode step,
  speculative verification and its commit (:mod:`glm5_kernels.kda_verify`, Triton) or their torch references.
* ``router``: the MoE router (GEMM, sigmoid, bias, grouped top-k, renormalisation): ``triton``
  (:mod:`glm5_kernels.router`, a bf16 GEMM with fp32 accumulation and a selection launch; bf16 models on CUDA) or
  ``torch`` (fp32 GEMM, the reference).
* ``fuse``: the fused elementwise/normalisation kernels of :mod:`glm5_kernels.norms` and
  :mod:`glm5_kernels.kda_decode` (RMSNorm, KDA gated output norm, KDA decode conv step, clamped SwiGLU) or
  their torch references (``norms_ref``, the KDA layer's torch conv). ``auto`` is ``triton`` for bf16 on
  CUDA and keeps fp32 (the oracle mode) on the torch ops.
* ``sampling``: ``torch`` or FlashInfer's fused sampling for unseeded rows.
* ``overlap``: independent branches of a layer (the MoE's shared expert, the MLA query path, the KDA gate
  projections) on a second CUDA stream (``stream``) or in order on the current one (``inline``); ``auto`` forks
  on CUDA for calls of up to ``OVERLAP_MAX_ROWS`` rows (:mod:`glm5.layers.overlap`). Same kernels, same results.

``auto`` picks the fast path when the tensors live on a CUDA device, the library imports and the
dtype/shape is one the kernels take, else the torch path (FlashInfer is never auto: see
:func:`decode_attn_backend`). An explicit choice
that cannot run raises :class:`BackendUnavailable` naming the reason — never a silent fallback,
because a silently slower (or differently rounded) path makes benchmark and oracle results lie.
Under ``TRITON_INTERPRET=1`` an explicit ``triton`` choice also runs on the CPU, through Triton's
interpreter (tests of the kernels inside the layers; never ``auto``).
One documented exception inside the fla path: speculative-verification chunks of the per-request path
(steps that mix verification with prefill) run the reference recurrence, because they must leave the
state unwritten until the commit; they are a few rows per request. Verification on the batched path
takes ``kda_step``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Iterator

import torch

from glm5_kernels.device import interpreting

logger = logging.getLogger(__name__)

KDA_CHOICES = ("auto", "torch", "fla")
ATTN_CHOICES = ("auto", "torch", "sdpa", "triton")
DECODE_ATTN_CHOICES = ("auto", "torch", "triton", "flashinfer")
SAMPLING_CHOICES = ("auto", "torch", "flashinfer")
MOE_CHOICES = ("auto", "torch", "triton")
INDEX_CHOICES = ("auto", "torch", "triton")
MHC_CHOICES = ("auto", "torch", "triton")
FP8_LINEAR_CHOICES = ("auto", "torch", "triton")
GEMV_CHOICES = ("auto", "torch", "triton")
KDA_STEP_CHOICES = ("auto", "torch", "triton")
ROUTER_CHOICES = ("auto", "torch", "triton")
FUSE_CHOICES = ("auto", "torch", "triton")
OVERLAP_CHOICES = ("auto", "stream", "inline")

_overrides: dict[str, str] = {}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here (missing library or wrong device)."""


def set_backends(kda: str | None = None, attn: str | None = None, decode_attn: str | None = None,
                 sampling: str | None = None, moe: str | None = None, index: str | None = None,
                 mhc: str | None = None, fp8_linear: str | None = None, kda_step: str | None = None,
                 router: str | None = None, fuse: str | None = None, overlap: str | None = None,
                 gemv: str | None = None) -> None:
    """Override the environment for this process (``None`` leaves a setting unchanged)."""
    for name, value, choices in (("kda", kda, KDA_CHOICES), ("attn", attn, ATTN_CHOICES),
                                 ("decode_attn", decode_attn, DECODE_ATTN_CHOICES),
                                 ("sampling", sampling, SAMPLING_CHOICES), ("moe", moe, MOE_CHOICES),
                                 ("index", index, INDEX_CHOICES), ("mhc", mhc, MHC_CHOICES),
                                 ("fp8_linear", fp8_linear, FP8_LINEAR_CHOICES),
                                 ("kda_step", kda_step, KDA_STEP_CHOICES),
                                 ("router", router, ROUTER_CHOICES), ("fuse", fuse, FUSE_CHOICES),
                                 ("overlap", overlap, OVERLAP_CHOICES), ("gemv", gemv, GEMV_CHOICES)):
        if value is not None:
            _validate(name, value, choices)
            _overrides[name] = value


def reset_backends() -> None:
    """Drop every :func:`set_backends` override (tests)."""
    _overrides.clear()


@contextlib.contextmanager
def backends_set(**choices: str) -> Iterator[None]:
    """:func:`set_backends` for the duration of a ``with`` block; the overrides before it (or their absence,
    which leaves the environment in charge) come back afterwards."""
    saved = dict(_overrides)
    try:
        set_backends(**choices)
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


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
    (speculative-verification rows of pure-decode steps included: each row is one query).

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
    err = _sparse_width_error(latent_width)
    if err is not None:
        if want == "triton":
            raise BackendUnavailable(f"decode_attn_backend='triton' cannot run: {err}; set "
                                     "GLM5_DECODE_ATTN_BACKEND=torch")
        return "torch"
    return _triton_or_torch("decode_attn", DECODE_ATTN_CHOICES, device)  # any dtype: fp32 uses IEEE products


def _sparse_width_error(latent_width: int | None) -> str | None:
    """Why the sparse MLA kernels (decode and prefill) cannot take this latent width, or None."""
    if latent_width is not None and (latent_width < 32 or latent_width & (latent_width - 1)):
        return f"kv_lora_rank {latent_width} (the sparse MLA kernels take a power of two >= 32)"
    return None


TRITON_DTYPES = (torch.bfloat16, torch.float32)  # what the index / MoE / mHC kernels are written and tested for


def _triton_or_torch(name: str, choices: tuple[str, ...], device: torch.device,
                     dtype: torch.dtype | None = None, auto_dtypes: tuple[torch.dtype, ...] = TRITON_DTYPES) -> str:
    """``auto_dtypes``: the dtypes ``auto`` sends to the kernels (a subset of what an explicit choice takes)."""
    want = _requested(name, choices)
    if want == "torch":
        return "torch"
    on_device = device.type == "cuda" or (want == "triton" and interpreting())
    err = import_error(TRITON_MODULE) if on_device else "tensors are not on a CUDA device"
    if err is None and dtype is not None and dtype not in TRITON_DTYPES:
        err = f"dtype {dtype} (the Triton kernels take bf16 or fp32)"
    if want == "auto" and err is None and dtype is not None and dtype not in auto_dtypes:
        return "torch"
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


def gemv_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (:func:`glm5_kernels.gemv.linear16`: the streaming GEMV where the GPU's measured table says it
    beats cuBLAS at that shape and row count, cuBLAS elsewhere) or ``"torch"`` (``F.linear``) for linears stored
    in the model dtype. ``auto``: triton for bf16 on CUDA; fp32 keeps cuBLAS, whose results the fp32 oracle tests
    pin."""
    return _triton_or_torch("gemv", GEMV_CHOICES, device, dtype, auto_dtypes=(torch.bfloat16,))


def index_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (kpool append/compress and index-score kernels) or ``"torch"`` (their references) for the
    indexer (batched decode and prefill scoring / pool completion)."""
    return _triton_or_torch("index", INDEX_CHOICES, device, dtype)


def kda_step_backend(device: torch.device, dtype: torch.dtype | None = None, decode: bool = False) -> str:
    """``"triton"`` (:mod:`glm5_kernels.kda_verify`: one program per request, head and value block walks the
    request's rows with the state in registers) or ``"torch"`` (the references) for the KDA recurrences of the
    batched path: speculative verification and its commit, and (``decode``) the decode step. ``auto`` sends
    verification in bf16 and fp32 to the kernels, the decode step in bf16 only: an fp32 decode step keeps the
    path the fp32 oracle tests pin (the torch recurrence under ``kda`` auto). An explicit ``torch`` decode step
    leaves it to the ``kda`` choice (fla's recurrent kernel or the torch step)."""
    return _triton_or_torch("kda_step", KDA_STEP_CHOICES, device, dtype,
                            auto_dtypes=(torch.bfloat16,) if decode else TRITON_DTYPES)


def router_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` (router GEMM with bf16 products and fp32 accumulation, sigmoid, bias, grouped top-k and
    renormalisation in one launch) or ``"torch"`` (fp32 GEMM and torch ops, the reference). ``auto`` is triton
    for bf16 on CUDA, where the router input and weight are bf16 already, so the fp32 GEMM only changes the
    summation order (expert agreement: docs/gpu.md); fp32 models keep the fp32 router."""
    return _triton_or_torch("router", ROUTER_CHOICES, device, dtype, auto_dtypes=(torch.bfloat16,))


def fuse_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"`` or ``"torch"`` for the fused elementwise / normalisation kernels (RMSNorm, the KDA gated
    output norm and decode conv step, clamped SwiGLU). ``auto``: triton for bf16 on CUDA; fp32 keeps the torch
    ops whose rounding the fp32 oracle tests pin."""
    return _triton_or_torch("fuse", FUSE_CHOICES, device, dtype, auto_dtypes=(torch.bfloat16,))


#: Rows up to which ``overlap`` auto forks: decode batches (up to 256 requests) and speculative verification
#: (up to 64 requests x 4 rows). At these sizes the forked branches are latency-bound launches or weight streams
#: that can run beside idle time; prefill chunks keep one stream. ``bench/backend_ab.py --backend overlap``
#: measures the step both ways (docs/gpu.md: forking won at every batch size measured on an H100).
OVERLAP_MAX_ROWS = 256


def overlap_backend(device: torch.device, rows: int) -> str:
    """``"stream"`` (fork a layer's independent branch onto a side stream, :mod:`glm5.layers.overlap`) or
    ``"inline"`` for a call over ``rows`` rows on ``device``. ``auto``: ``stream`` on CUDA up to
    :data:`OVERLAP_MAX_ROWS` rows (not under the Triton interpreter); an explicit ``stream`` forks on CUDA at
    any size."""
    want = _requested("overlap", OVERLAP_CHOICES)
    if want == "inline":
        return "inline"
    if device.type != "cuda" or interpreting():
        if want == "stream":
            raise BackendUnavailable(f"overlap_backend='stream' needs CUDA tensors (got {device}); set "
                                     "GLM5_OVERLAP_BACKEND=inline or auto")
        return "inline"
    return "stream" if want == "stream" or rows <= OVERLAP_MAX_ROWS else "inline"


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


def attn_backend(device: torch.device, dtype: torch.dtype | None = None, latent_width: int | None = None) -> str:
    """``"triton"``, ``"sdpa"`` or ``"torch"`` for the MLA attention of prefill chunks on ``device``.

    ``auto`` on CUDA: the sparse Triton kernel for bf16 (only the selected (query, key) pairs, no host sync),
    SDPA for fp32 (expanded K/V as transformers computes them; the fp32 oracle mode), the torch reference on
    CPU. The kernel needs a power-of-two ``latent_width`` (kv_lora_rank) of at least 32."""
    want = _requested("attn", ATTN_CHOICES)
    if want == "torch":
        return "torch"
    if want == "sdpa":
        if device.type != "cuda":
            raise BackendUnavailable("attn_backend='sdpa' is the CUDA prefill path; on CPU use "
                                     "GLM5_ATTN_BACKEND=torch or auto")
        return "sdpa"
    err = _sparse_width_error(latent_width)
    if want == "triton":
        if err is not None:
            raise BackendUnavailable(f"attn_backend='triton' cannot run: {err}; set GLM5_ATTN_BACKEND=sdpa|torch")
        return _triton_or_torch("attn", ATTN_CHOICES, device, dtype)
    if device.type != "cuda":
        return "torch"
    if err is None and dtype in (torch.bfloat16, None) and import_error(TRITON_MODULE) is None:
        return "triton"
    return "sdpa"
