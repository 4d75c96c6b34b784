"""The network's one linear type: ``y = x Wᵀ (+ b)``, with *how the weight is stored and applied* in a method.

Every projection of the text model (MLA, KDA, indexer, dense MLP, shared experts, MTP, LM head) is a
:class:`Linear` instead of a raw weight tensor handed to ``F.linear``. What changes between a bf16 and an fp8
model is the weight's storage and the GEMM that reads it; that lives in a small method object the block never
looks at (the shape of vLLM's ``LinearBase`` + ``quant_method``, and of nano-vllm's ``layers/linear.py``):

* :class:`UnquantizedMethod` - the weight in the model dtype, ``F.linear``; on CUDA in bf16, for the shapes and row
  counts where the GPU's measured table says so, :func:`glm5_kernels.gemv.linear16`'s streaming GEMV instead
  (``gemv`` backend).
* :class:`Fp8BlockMethod` - ``float8_e4m3fn`` weight + fp32 scales per 128 x 128 tile (the fp8 checkpoint's
  ``weight_scale_inv``, or made at load by online quantisation). On CUDA it runs
  :func:`glm5_kernels.fp8_linear.fp8_linear` (a Triton fp8 GEMV / small-M GEMM that dequantises in registers,
  or ``torch._scaled_mm`` with block scales / a Triton w8a8 GEMM for large M, chosen per shape); elsewhere the
  reference :func:`glm5_kernels.fp8_ref.fp8_linear_ref` dequantises the weight on every call, so the fp8
  storage itself runs end to end on the CPU.

Sharding (which slice of the weight a device holds, and the collective after a row-parallel linear) is not a
storage question and stays out of the methods: a sharded linear holds a method over its shard.

:class:`HeadLinear` is the per-head counterpart (``y[:, g] = x[:, g] W[g]ᵀ``) for MLA's absorbed ``kv_b_proj``
views, with the same two methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from glm5.layers.backends import fp8_linear_backend, gemv_backend
from glm5_kernels.fp8_ref import BLOCK, FP8_DTYPE, SCALE_SUFFIX, block_scale_shape, dequantize_fp8_block, \
    fp8_head_linear_ref, fp8_linear_ref

logger = logging.getLogger(__name__)


class LinearMethod(Protocol):
    """How a ``[out, in]`` weight is stored and multiplied."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor: ...


class _StoredWeight:
    """``out_features`` / ``in_features`` of a method that holds one 2-D ``weight [out, in]``."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


@dataclass(eq=False)
class UnquantizedMethod(_StoredWeight):
    """The weight ``[out, in]`` in the model dtype."""

    weight: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in]; got shape {tuple(self.weight.shape)}")

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if gemv_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.gemv import linear16
            return linear16(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)


@dataclass(eq=False)
class Fp8BlockMethod(_StoredWeight):
    """``weight`` float8_e4m3fn ``[out, in]`` and ``scale_inv`` fp32 ``[ceil(out/128), ceil(in/128)]``
    (``W ≈ weight · scale_inv`` per 128 x 128 tile). Output dtype = the activation's dtype."""

    weight: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"an fp8 linear weight is a 2-D {FP8_DTYPE} [out, in]; got {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        want = block_scale_shape(self.weight.shape)
        if tuple(self.scale_inv.shape) != want or self.scale_inv.dtype != torch.float32:
            raise ValueError(f"fp8 block scales {self.scale_inv.dtype} {tuple(self.scale_inv.shape)} do not fit the "
                             f"weight {tuple(self.weight.shape)}: need float32 {want} (one per {BLOCK}x{BLOCK} tile)")

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_inv.numel() * 4

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if fp8_linear_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.fp8_linear import fp8_linear
            return fp8_linear(x, self.weight, self.scale_inv, bias)
        return fp8_linear_ref(x, self.weight, self.scale_inv, bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.scale_inv, dtype=dtype)


@dataclass(eq=False)
class ConcatMethod:
    """Several methods whose outputs sit side by side, for a concatenation that cannot be one weight
    (storage formats differ, or an fp8 part ends inside a 128-row scale block, so the scale tiles of the
    parts after it would straddle two parts). One GEMM per part, outputs concatenated."""

    parts: tuple[LinearMethod, ...]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([p.apply(x, None) for p in self.parts], dim=-1)
        return y if bias is None else y + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantized(dtype) for p in self.parts])


def _merge(a: LinearMethod, b: LinearMethod) -> LinearMethod | None:
    """``a`` and ``b`` as one weight (rows of ``a`` then ``b``), or None when they cannot be one."""
    if isinstance(a, UnquantizedMethod) and isinstance(b, UnquantizedMethod) and a.weight.dtype == b.weight.dtype:
        return UnquantizedMethod(torch.cat([a.weight, b.weight]))
    if isinstance(a, Fp8BlockMethod) and isinstance(b, Fp8BlockMethod) and a.out_features % BLOCK == 0:
        return Fp8BlockMethod(torch.cat([a.weight, b.weight]), torch.cat([a.scale_inv, b.scale_inv]))
    return None


def _merged_runs(methods: list[LinearMethod]) -> list[tuple[LinearMethod, int]]:
    """Consecutive methods merged wherever their storage can be one weight (:func:`_merge`): each run's method
    and how many of the given methods it holds, in order."""
    runs: list[tuple[LinearMethod, int]] = []
    for m in methods:
        merged = _merge(runs[-1][0], m) if runs else None
        if merged is None:
            runs.append((m, 1))
        else:
            runs[-1] = (merged, runs[-1][1] + 1)
    return runs


def _check_parts(parts: list["Linear"]) -> None:
    """Linears that are computed side by side: one input width, a bias on all or none."""
    if not parts or len({p.in_features for p in parts}) != 1:
        raise ValueError(f"concatenated linears need one input width, got {[p.in_features for p in parts]}")
    if len({p.bias is None for p in parts}) != 1:
        raise ValueError("concatenated linears must all have a bias or none")


class Linear:
    """A weight (stored by a :class:`LinearMethod`) and an optional bias ``[out_features]``.

    ``Linear(tensor)`` is an unquantised linear; ``Linear(method)`` takes any method."""

    def __init__(self, weight: torch.Tensor | LinearMethod, bias: torch.Tensor | None = None):
        self.method: LinearMethod = UnquantizedMethod(weight) if isinstance(weight, torch.Tensor) else weight
        if bias is not None and tuple(bias.shape) != (self.method.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match the weight's "
                             f"{self.method.out_features} outputs")
        self.bias = bias

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], prefix: str) -> "Linear":
        """``{prefix}.weight`` (and ``{prefix}.bias`` when the checkpoint has one); fp8 when the loader kept
        ``{prefix}.weight_scale_inv`` beside an fp8 weight."""
        w = weights[f"{prefix}.weight"]
        scale = weights.get(f"{prefix}.weight{SCALE_SUFFIX}")
        if scale is not None:
            return cls(Fp8BlockMethod(w, scale), weights.get(f"{prefix}.bias"))
        if w.dtype == FP8_DTYPE:
            raise ValueError(f"{prefix}.weight is {FP8_DTYPE} but {prefix}.weight{SCALE_SUFFIX} is missing from the "
                             "weights; load the checkpoint with glm5.weights.load_weights (it pairs the scales)")
        return cls(w, weights.get(f"{prefix}.bias"))

    @classmethod
    def concat(cls, parts: list["Linear"]) -> "Linear":
        """One linear whose outputs are ``parts``' outputs side by side.

        Consecutive parts that can share one weight are merged (one GEMM instead of several): same storage, and
        for fp8 every part but the last of a run a whole number of 128-row scale blocks (the KDA input
        projection q|k|v|f_a|g_a|b merges in fp8 because only its last part, b with 64 rows, is partial).
        Otherwise the result runs one GEMM per run (:class:`ConcatMethod`) and says so in the log."""
        _check_parts(parts)
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        runs = [m for m, _ in _merged_runs([p.method for p in parts])]
        if len(runs) == 1:
            return cls(runs[0], bias)
        logger.debug("concatenated linear of %d parts runs as %d GEMMs (%s): their storage cannot be one weight",
                     len(parts), len(runs), ", ".join(type(r).__name__ for r in runs))
        return cls(ConcatMethod(tuple(runs)), bias)

    @property
    def out_features(self) -> int:
        return self.method.out_features

    @property
    def in_features(self) -> int:
        return self.method.in_features

    @property
    def quantized(self) -> bool:
        """True when the weight is stored in fp8 (wholly or in part)."""
        m = self.method
        return isinstance(m, Fp8BlockMethod) or (isinstance(m, ConcatMethod)
                                                 and any(isinstance(p, Fp8BlockMethod) for p in m.parts))

    @property
    def weight(self) -> torch.Tensor:
        """The unquantised weight tensor. An fp8 linear has none: use :meth:`dequantized` or ``method``."""
        if not isinstance(self.method, UnquantizedMethod):
            raise AttributeError(f"this linear is stored as {type(self.method).__name__}, not a plain weight; "
                                 "use .dequantized(dtype) or .method")
        return self.method.weight

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a ``[out, in]`` tensor in ``dtype`` (a copy for fp8 storage)."""
        return self.method.dequantized(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.bias)


class MultiOutputLinear:
    """Linears that read one input, run as few GEMMs as their storage allows; the call returns each part's own
    output (column views of a shared GEMM output, no copy).

    At decode every projection is a GEMV whose time is mostly launch and ramp-up, not bytes: MLA's
    ``q_a | kv_a | wk | compress gate`` as one GEMV (bf16; in fp8 the three fp8 parts and the bf16 gate are two)
    instead of four, a SwiGLU's gate and up as one. Consecutive parts whose storage can be one weight are merged
    (:func:`_merge`, as :meth:`Linear.concat` does); the parts' own weights are not kept."""

    def __init__(self, parts: list[Linear]):
        _check_parts(parts)
        self.runs: list[tuple[Linear, tuple[int, ...]]] = []
        first = 0
        for method, count in _merged_runs([p.method for p in parts]):
            run = parts[first: first + count]
            bias = None if run[0].bias is None else torch.cat([p.bias for p in run])
            self.runs.append((Linear(method, bias), tuple(p.out_features for p in run)))
            first += count

    @property
    def out_features(self) -> tuple[int, ...]:
        return tuple(n for _, sizes in self.runs for n in sizes)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for lin, sizes in self.runs:
            y = lin(x)
            out.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return out


# ---------------------------------------------------------------------------------------------
# per-head weights
# ---------------------------------------------------------------------------------------------
class HeadLinear:
    """Per-head weights ``W [G, N, K]``: ``y [M, G, N] = x [M, G, K]`` times ``W[g]ᵀ`` head by head.

    ``scale_inv`` (fp32 ``[G, ceil(N/128), ceil(K/128)]``) makes it fp8 (``weight`` float8_e4m3fn): the CUDA
    path is the fp8 GEMV kernel with a head grid dimension, the CPU path dequantises per call."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor | None = None):
        if weight.dim() != 3:
            raise ValueError(f"per-head weights are [G, N, K]; got shape {tuple(weight.shape)}")
        if scale_inv is not None and tuple(scale_inv.shape) != block_scale_shape(weight.shape):
            raise ValueError(f"per-head fp8 scales {tuple(scale_inv.shape)} do not fit the weight "
                             f"{tuple(weight.shape)}: need {block_scale_shape(weight.shape)}")
        self.weight, self.scale_inv = weight, scale_inv

    @property
    def quantized(self) -> bool:
        return self.scale_inv is not None

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scale_inv is None else self.scale_inv.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_inv is None:
            # one batched GEMM over the heads, written straight into a contiguous [M, G, N] result (cuBLAS takes
            # the head-major views through their strides): einsum's [G, M, N] product came back as a transposed
            # view, and the copy that made it contiguous took 355 µs per MLA layer of an 8K prefill (H200)
            out = torch.empty(x.shape[0], self.weight.shape[0], self.weight.shape[1], dtype=x.dtype, device=x.device)
            torch.bmm(x.transpose(0, 1), self.weight.transpose(1, 2), out=out.transpose(0, 1))
            return out
        if fp8_linear_backend(x.device, x.dtype) == "triton":
            from glm5_kernels.fp8_linear import fp8_head_linear
            return fp8_head_linear(x, self.weight, self.scale_inv)
        return fp8_head_linear_ref(x, self.weight, self.scale_inv)


def split_heads(linear: Linear, heads: int, sizes: tuple[int, int],
                dtype: torch.dtype) -> tuple[HeadLinear, HeadLinear]:
    """MLA's absorbed views of ``kv_b_proj`` (``[heads·(d_k+d_v), r]``): ``W_UKᵀ [heads, r, d_k]`` (applied to
    ``q``, giving the latent query) and ``W_UV [heads, d_v, r]`` (applied to the attention-weighted latent).

    fp8 storage stays fp8 when every head's ``d_k`` and ``d_v`` rows are whole 128-row scale blocks (the real
    model: 256 / 256), so the views keep their own scale tiles: ``W_UV`` is a view, ``W_UKᵀ`` an fp8 transposed
    copy (a transposed block-scaled matrix is block-scaled with the transposed scales, exactly). Otherwise the
    views are dequantised once here to ``dtype`` (the model dtype; logged)."""
    d_k, d_v = sizes
    m = linear.method
    if isinstance(m, UnquantizedMethod):
        kv = m.weight.view(heads, d_k + d_v, -1)
        return HeadLinear(kv[:, :d_k].transpose(1, 2)), HeadLinear(kv[:, d_k:])
    if isinstance(m, Fp8BlockMethod) and d_k % BLOCK == 0 and d_v % BLOCK == 0:
        kv = m.weight.view(heads, d_k + d_v, -1)
        sc = m.scale_inv.view(heads, (d_k + d_v) // BLOCK, -1)
        kb = d_k // BLOCK
        return (HeadLinear(kv[:, :d_k].transpose(1, 2).contiguous(), sc[:, :kb].transpose(1, 2).contiguous()),
                HeadLinear(kv[:, d_k:], sc[:, kb:]))
    logger.info("kv_b_proj absorbed views dequantized to %s: head dims %d/%d are not multiples of %d (fp8 scale "
                "blocks would straddle heads)", dtype, d_k, d_v, BLOCK)
    kv = m.dequantized(dtype).view(heads, d_k + d_v, -1)
    return HeadLinear(kv[:, :d_k].transpose(1, 2)), HeadLinear(kv[:, d_k:])
