"""A streaming GEMV for decode rows: a few activation rows times a weight read once, 16-bit or block-scaled fp8.

At batch 1 a decode step is a chain of weight streams, and a GEMV costs the time its weight takes to read.
cuBLAS's small-M kernels read some of the model's shapes well below the copy bandwidth (on an H100, 2026-12-06,
rotating weights so none is served from L2: 2176 x 4096 bf16 at 1.58 TB/s and 4096 x 4096 at 2.08, against a
2.45 TB/s copy; this kernel 2.45 and 2.73). Each program streams a ``[BLOCK_N, K]`` strip of the weight
(``SPLIT_K`` > 1 splits K over programs: fp32 partial sums, added by one :func:`split_sum` launch), widens each
tile to fp32 in registers and multiplies it into fp32 accumulators on the CUDA cores: no 16-row tensor-core
padding of a single row, no trip of the tile through shared memory. Products accumulate elementwise over the
K tiles and are reduced across K once, after the loop (a reduction per tile is a cross-warp exchange per tile).

* 16-bit weights (``SCALED`` off): :func:`gemv16`; reference ``F.linear`` (both accumulate in fp32, in a
  different order).
* fp8 e4m3 weights with fp32 scales per 128 x 128 tile (``SCALED``): the weight scale of each column is folded
  into the activation tile (``BLOCK_N`` divides 128, so a strip lies in one scale row); the ``gemv_fma`` choice
  of :mod:`glm5_kernels.fp8_linear`, reference :func:`glm5_kernels.fp8_ref.fp8_linear_ref`.

Which 16-bit linears take it: a measured table ``configs/gemv16_{device}.json`` (``bench/gemv16_table.py
--write-table``) keyed by ``"N,K"`` then by M, whose entries are the kernel's tiles (``"impl": "gemv_fma"``) or
``{"impl": "torch"}`` where cuBLAS was as fast; :func:`linear16` sends a shape or M the table lacks to cuBLAS. An
entry serves at most its ``BLOCK_M`` rows (more would stream the weight once per row tile). No host syncs;
outputs allocated with host-known shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from glm5_kernels.pdl import pdl_enter, pdl_kwargs

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
GEMV_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
#: The implementations a 16-bit table entry may name.
IMPLS16 = ("gemv_fma", "torch")
#: Weight dtypes :func:`gemv16` takes.
DTYPES16 = (torch.bfloat16, torch.float16)

#: A table: ``{(N, K): ((M, entry), ...)}`` sorted by M.
Table = dict[tuple[int, int], tuple[tuple[int, dict[str, Any]], ...]]


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def x_tile(x_base, kk, m_ok, K, EVEN_K: tl.constexpr):
    """The activation rows ``[BLOCK_M, BLOCK_K]`` of one K tile of a GEMV strip; zeros past K."""
    if EVEN_K:
        return tl.load(x_base + kk[None, :], mask=m_ok[:, None], other=0.0)
    return tl.load(x_base + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def w_tile(w_base, s_base, kk, K, SB: tl.constexpr, EVEN_K: tl.constexpr, W_ROWS_K: tl.constexpr,
           SCALED: tl.constexpr):
    """The weight tile of one K tile of a GEMV strip (``[BLOCK_K, BLOCK_N]`` when ``W_ROWS_K``, the tl.dot
    operand layout, else ``[BLOCK_N, BLOCK_K]``) and, ``SCALED``, the strip's weight scale of each column
    ``[BLOCK_K]`` (else 1.0); zeros past K (``EVEN_K`` = no mask: every tile is inside K)."""
    k_ok = kk < K
    if W_ROWS_K:
        w_ptrs = w_base + kk[:, None]
        w_mask = k_ok[:, None]
    else:
        w_ptrs = w_base + kk[None, :]
        w_mask = k_ok[None, :]
    if EVEN_K:
        b = tl.load(w_ptrs)
    else:
        b = tl.load(w_ptrs, mask=w_mask, other=0.0)
    sc = 1.0
    if SCALED:
        if EVEN_K:
            sc = tl.load(s_base + kk // SB)
        else:
            sc = tl.load(s_base + kk // SB, mask=k_ok, other=0.0)
    return b, sc


@triton.jit
def _fma_step(acc3, x, w, sc, SCALED: tl.constexpr):
    """``acc3 [BM, BN, BK]`` plus one K tile's elementwise products: the weight scales (``SCALED``) folded into
    the activation, the weight tile widened to fp32 in registers."""
    xs = x.to(tl.float32)
    if SCALED:
        xs = xs * sc[None, :]
    return acc3 + w.to(tl.float32)[None, :, :] * xs[:, None, :]


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, b_ptr, M, N, K,
                     stride_xm, stride_wn, stride_sn, stride_yk, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     SCALED: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    """y[m, n] (+ split k's partial) = sum_k x[m, k] * w[n, k] (* s[n // SB, k // SB] when ``SCALED``)
    (+ bias[n]), in fp32 FMAs on the CUDA cores. Grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)); with
    ``SCALED``, BLOCK_N divides SB (one scale row per strip)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    # rows past N wrap onto valid weight rows (their results are never stored): no mask on the weight rows
    w_base = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn
    x_base = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    s_base = s_ptr + ((pid_n * BLOCK_N) // SB) * stride_sn
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    # the strip's first weight tile is read before the PDL wait (no kernel writes weights), so it streams in
    # while the preceding kernel finishes; masked: the last split may be empty
    w, sc = w_tile(w_base, s_base, kt0 * BLOCK_K + offs_k, K, SB, False, False, SCALED)
    pdl_enter(USE_PDL)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if kt0 < kt1:
        acc3 = _fma_step(acc3, x_tile(x_base, kt0 * BLOCK_K + offs_k, m_ok, K, EVEN_K), w, sc, SCALED)
    for kt in range(kt0 + 1, kt1):
        kk = kt * BLOCK_K + offs_k
        w, sc = w_tile(w_base, s_base, kk, K, SB, EVEN_K, False, SCALED)
        acc3 = _fma_step(acc3, x_tile(x_base, kk, m_ok, K, EVEN_K), w, sc, SCALED)
    acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_yk + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["R"])
def _split_sum_kernel(p_ptr, y_ptr, R, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """y[r] = Σ_s p[s, r] over a K split's fp32 partials, in a fixed order, cast to y's dtype: the second step
    of a split GEMV in one launch (``p.sum(0).to(dtype)`` is a reduction and a cast, two launches and a
    round trip of the sum through memory). Grid cdiv(R, BLOCK)."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < R
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sk in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + R.to(tl.int64) * sk + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def split_output(out_shape: tuple[int, ...], out_dtype: torch.dtype, split: int,
                 device: torch.device) -> torch.Tensor:
    """A launch's output: ``out_shape`` in ``out_dtype``, or with a K split the fp32 partial sums
    ``[split, *out_shape]`` that :func:`split_sum` adds up."""
    if split == 1:
        return torch.empty(out_shape, device=device, dtype=out_dtype)
    return torch.empty((split, *out_shape), device=device, dtype=torch.float32)


def k_split(cfg: dict[str, Any], out_shape: tuple[int, ...], out_dtype: torch.dtype, x: torch.Tensor,
            w: torch.Tensor, s: torch.Tensor | None, min_k: int = 16) -> tuple[int, int, torch.Tensor]:
    """A GEMV launch's ``BLOCK_K`` (at most K rounded up to a power of two, at least ``min_k``: the dot's
    minimum), its K split (at most one per K tile) and its output (:func:`split_output`)."""
    if w.stride(-1) != 1 or x.stride(-1) != 1 or (s is not None and s.stride(-1) != 1):
        raise ValueError("the GEMVs need unit stride along K for x, the weight and its scales")
    k = x.shape[-1]
    bk = min(cfg["BLOCK_K"], max(min_k, triton.next_power_of_2(k)))
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, bk)))
    return bk, split, split_output(out_shape, out_dtype, split, x.device)


def split_sum(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``partials [S, ...]`` fp32 (contiguous) summed over S into a new ``[...]`` tensor of ``out_dtype``
    (:func:`_split_sum_kernel`; reference ``partials.sum(0).to(out_dtype)``)."""
    if not partials.is_contiguous():
        raise ValueError("split_sum takes the contiguous [split, ...] partials a K-split GEMV writes")
    y = torch.empty(partials.shape[1:], device=partials.device, dtype=out_dtype)
    r = y.numel()
    if r:
        block = 1024
        _split_sum_kernel[(triton.cdiv(r, block),)](partials, y, r, SPLIT=partials.shape[0], BLOCK=block, num_warps=4,
                                                    **pdl_kwargs(y.device))
    return y


def gemv_fma(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, bias: torch.Tensor | None,
             cfg: dict[str, Any], out_dtype: torch.dtype, sb: int = 128) -> torch.Tensor:
    """``x2 [M, K] @ wᵀ (+ bias)`` → ``[M, N]`` in ``out_dtype`` (:func:`_gemv_fma_kernel`): ``w [N, K]`` 16-bit
    with ``s`` None, or fp8 with its ``[ceil(N/sb), ceil(K/sb)]`` block scales ``s``."""
    m, k = x2.shape
    n = w.shape[0]
    bm, bn = triton.next_power_of_2(cfg["BLOCK_M"]), cfg["BLOCK_N"]
    bk, split, y = k_split(cfg, (m, n), out_dtype, x2, w, s)
    grid = (triton.cdiv(n, bn), split, triton.cdiv(m, bm))
    _gemv_fma_kernel[grid](
        x2, w, w if s is None else s, y, bias if bias is not None else w, m, n, k, x2.stride(0), w.stride(0),
        0 if s is None else s.stride(0), 0 if split == 1 else y.stride(0), y.stride(-2), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, SPLIT_K=split, SB=sb, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, SCALED=s is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(x2.device))
    return y if split == 1 else split_sum(y, out_dtype)


def gemv16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           config: dict[str, Any] | None = None) -> torch.Tensor:
    """``x [..., K] @ wᵀ (+ bias)`` → ``[..., N]`` in ``x.dtype`` for a 16-bit ``w [N, K]`` (reference
    ``F.linear``); ``config``: the tiles (default :func:`default_config16`)."""
    k = x.shape[-1]
    n = w.shape[0]
    if w.dtype not in DTYPES16 or w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"gemv16 takes a 2-D bf16/fp16 weight [N, {k}]; got {w.dtype} {tuple(w.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        raise ValueError(f"gemv16 needs a weight with unit stride along K; got strides {w.stride()}")
    cfg = config or default_config16(x2.shape[0])
    y = gemv_fma(x2, w, None, bias, cfg, x.dtype) if x2.shape[0] else x2.new_empty(0, n)
    return y.reshape(*x.shape[:-1], n)


def default_config16(m: int) -> dict[str, Any]:
    """Tiles for :func:`gemv16` without a table entry: the fastest on an H100 at M = 1 at the bench shapes
    (4-row strips, 2048-wide K tiles); more rows narrow the K tile so the fp32 accumulator
    (``BLOCK_M · BLOCK_N · BLOCK_K`` / 128 threads) stays at 64 registers a thread, and above 16 rows the rows
    are split into 16-row tiles (each reads the weight again: a GEMM is the better choice there)."""
    bm = min(16, triton.next_power_of_2(max(1, m)))
    return {"impl": "gemv_fma", "BLOCK_M": bm, "BLOCK_N": 4, "BLOCK_K": max(128, 2048 // bm), "SPLIT_K": 1,
            "num_warps": 4, "num_stages": 4}


# ----------------------------------------------------------------------------------------------
# measured tables
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def read_table(path: Path, validate: Callable[[dict[str, Any]], None], what: str) -> Table:
    """``{(N, K): sorted ((M, entry), ...)}`` from a measured table (``"N,K"`` → ``{M: entry}``; keys starting
    with ``_`` are metadata), each entry checked by ``validate``; ``{}`` when the file does not exist."""
    if not path.exists():
        logger.info("no %s table %s; using the default choice per shape", what, path.name)
        return {}
    raw = json.loads(path.read_text())
    out: Table = {}
    for shape, per_m in raw.items():
        if shape.startswith("_"):
            continue
        n, k = (int(v) for v in shape.split(","))
        rows = []
        for m, entry in per_m.items():
            validate(entry)
            rows.append((int(m), entry))
        out[(n, k)] = tuple(sorted(rows, key=lambda r: r[0]))
    logger.info("%s: loaded choices for %d shapes from %s", what, len(out), path.name)
    return out


def nearest_entry(rows: tuple[tuple[int, dict[str, Any]], ...] | None, m: int) -> dict[str, Any] | None:
    """The entry measured at the M nearest ``m`` (ties: the smaller), skipping ``gemv_fma`` entries whose
    ``BLOCK_M`` is below ``m``; None when none is left."""
    usable = [r for r in rows or () if r[1]["impl"] != "gemv_fma" or m <= r[1]["BLOCK_M"]]
    if not usable:
        return None
    return dict(min(usable, key=lambda r: (abs(r[0] - m), r[0]))[1])


def table16_file_name(device: str) -> str:
    return f"gemv16_{device}.json"


def validate_entry16(entry: dict[str, Any]) -> None:
    """Raise ValueError naming the bad key of one 16-bit table entry."""
    impl = entry.get("impl")
    if impl not in IMPLS16:
        raise ValueError(f"gemv16 table entry {entry}: impl must be one of {IMPLS16}")
    if impl == "gemv_fma":
        check_positive(entry, GEMV_KEYS, "gemv16")


def check_positive(entry: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    """Raise ValueError naming the first of ``keys`` whose value in a table entry is not a positive int."""
    for key in keys:
        v = entry.get(key)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} table entry {entry}: {key}={v!r} must be a positive int")


@functools.lru_cache(maxsize=None)
def load_table16(device: str) -> Table:
    return read_table(CONFIG_DIR / table16_file_name(device), validate_entry16, "gemv16")


def select16(m: int, n: int, k: int, device: torch.device) -> dict[str, Any] | None:
    """The table's ``gemv_fma`` entry for ``(N, K)`` at ``m`` rows, or None (cuBLAS)."""
    if device.type != "cuda":
        return None
    entry = nearest_entry(load_table16(device_name(device.index)).get((n, k)), m)
    return entry if entry is not None and entry["impl"] == "gemv_fma" else None


def linear16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a 16-bit weight, through :func:`gemv16` where the measured table says the
    kernel is faster at this shape and row count, else cuBLAS."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    readable = (w.dtype in DTYPES16 and x.dtype == w.dtype and w.stride(-1) == 1
                and (bias is None or bias.is_contiguous()))
    entry = select16(m, w.shape[0], k, x.device) if m and readable else None
    if entry is None:
        return F.linear(x, w, bias)
    return gemv16(x, w, bias, entry)


__all__ = ["CONFIG_DIR", "DTYPES16", "GEMV_KEYS", "IMPLS16", "Table", "check_positive", "default_config16",
           "device_name", "gemv16", "gemv_fma", "k_split", "linear16", "load_table16", "nearest_entry", "read_table",
           "select16", "split_output", "split_sum", "table16_file_name", "validate_entry16", "w_tile", "x_tile"]
