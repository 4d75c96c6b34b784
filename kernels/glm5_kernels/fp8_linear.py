"""Block-scaled fp8 linears on the GPU: an fp8 GEMV / small-M GEMM, activation quantisation, a w8a8 GEMM.

Weights are ``float8_e4m3fn [N, K]`` with fp32 scales per 128 x 128 tile (:mod:`glm5_kernels.fp8_ref` defines
the format and the references). Four ways to multiply, chosen per shape (:func:`select_impl`):

* ``gemv`` - :func:`fp8_gemv` (W8A16): the activation stays in its dtype; each program streams a
  ``[BLOCK_N, K]`` strip of fp8 weights, folds the weight scales into the activation tile
  (``x[:, k] · s[n_blk, k // 128]``: one scale per 128 columns, and a ``BLOCK_N <= 128`` strip lies in one
  scale row) and runs ``tl.dot`` on the fp8 values widened to the activation dtype, fp32 accumulation.
  Decode reads one byte per weight instead of two; ``SPLIT_K`` > 1 splits K over programs (fp32 partial
  sums, added by one :func:`split_sum` launch) when there are too few N strips to keep every SM streaming. A head grid
  dimension serves MLA's per-head ``kv_b_proj`` views (:func:`fp8_head_linear`).
* ``gemv_fma`` - the same W8A16 product for a few rows (decode at batch 1-4) without ``tl.dot``: each e4m3
  tile is widened to fp32 in registers and multiplied into fp32 accumulators on the CUDA cores (no 16-row
  MMA padding, no trip of the widened tile through shared memory; same ``SPLIT_K``). Chosen only where the
  measured table says it is faster.
* ``gemv_w8a8`` - the ``gemv`` kernel with the activation quantised in the kernel instead (w8a8): each
  ``[BLOCK_M, 128]`` activation tile becomes e4m3 with one scale per row (:func:`quantize_rows`, the
  per-token-group rule), so ``tl.dot`` multiplies the weight tile as loaded, e4m3 x e4m3 on the fp8 tensor
  cores, and each 128-wide K step's product is scaled by ``s_x[m] · s_w`` (no widening of the weight tile, no
  separate quantisation launch). Reference :func:`~glm5_kernels.fp8_ref.w8a8_linear_ref`.
* ``scaled_mm`` - ``torch._scaled_mm`` with DeepSeek-style block scaling (w8a8): the activation is quantised
  per token and 128-channel group by :func:`per_token_group_quant_fp8` (scales written column-major, M padded
  to a multiple of 4, the layout cuBLAS wants); compute-efficient at large M.
* ``w8a8`` - :func:`w8a8_gemm`, a Triton fp8 x fp8 GEMM with the same quantised activations (any N, K: the
  KDA input projection's 24896 rows are not a multiple of 128, which ``_scaled_mm`` refuses), with an optional
  ``SPLIT_K`` for the few-tile shapes of M = 64 (N = 4096 is 32 tiles of 128 columns).

Selection: a measured table ``configs/fp8_linear_{device}.json`` (written by ``bench/fp8_check.py --write-table``)
keyed by ``"N,K"`` then by M (nearest M wins), else :func:`default_impl`. Every path is free of host syncs
and allocates only with shapes known on the host, so it is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import triton
import triton.language as tl

from glm5_kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX, MIN_AMAX, fp8_head_linear_ref
from glm5_kernels.gemv import CONFIG_DIR, GEMV_KEYS, Table, check_positive, device_name, gemv_fma, k_split, \
    nearest_entry, read_table, split_output, split_sum, w_tile, x_tile
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

logger = logging.getLogger(__name__)

IMPLS = ("gemv", "gemv_fma", "gemv_w8a8", "scaled_mm", "w8a8")
#: The GEMV implementations (tile keys GEMV_KEYS).
GEMV_IMPLS = ("gemv", "gemv_fma", "gemv_w8a8")
W8A8_KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")
#: ``max_num_imprecise_acc`` of the e4m3 x e4m3 dots: the H100/H200 fp8 tensor cores accumulate with ~14
#: mantissa bits unless the compiler moves the sum into fp32 registers every this many products (Triton's
#: sm_90 default is never). 32 = every fp8 MMA instruction's K, full fp32 accumulation.
FP8_DOT_ACC = 32
#: Largest M the default sends to the GEMV kernel: beyond it the w8a8 GEMMs (quantised activations, fp8
#: tensor cores) win on the H200 measurements in the reference doc (``_scaled_mm`` 1.5-1.6x bf16 at M=4096).
GEMV_MAX_M = 64
#: Rows above which :func:`fp8_head_linear` dequantises the per-head weights (MLA's absorbed views: 16 MB in bf16)
#: and runs the batched bf16 GEMM instead of the GEMV: in the 2026-12-03 09:19 UTC H200 profiles of an 8K prefill
#: (4096-row chunks) the GEMV took 615 µs per call against 133 µs for the bf16 weights' batched GEMM.
HEAD_GEMV_MAX_M = 256
#: The one-row choice without a table entry (a GPU without a measured table): the tiles the H200 table picks for
#: most shapes at M = 1 (the ``gemv`` tiles, 16-row MMAs for one row, were several times slower on an H100).
FMA_DEFAULT = {"impl": "gemv_fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4,
               "num_stages": 2}
#: Rows per program of the activation quantiser (:func:`per_token_group_quant_fp8`).
QUANT_ROWS = 16
#: Largest M at which the w8a8 GEMM honours a table entry's ``SPLIT_K`` (above it the M tiles fill the GPU).
W8A8_SPLIT_MAX_M = 256


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def quantize_rows(a, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr):
    """An activation tile ``[BM, BK]`` (BK <= 128: one channel group) as e4m3 with one fp32 scale per row:
    ``s = max(|a|) / 448`` (IEEE division, as the group quantiser), ``q = e4m3(a · (448 / max|a|))``. The
    reciprocal is formed once per row and multiplied, not divided per element, so a code at a rounding tie may
    differ from the reference's ``a / s`` by one step; the bounds of the w8a8 tests cover that."""
    af = a.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(af), axis=1), MIN_AMAX_)
    s = tl.math.div_rn(amax, FP8_MAX_)
    inv = tl.math.div_rn(FP8_MAX_, amax)
    q = tl.clamp(af * inv[:, None], -FP8_MAX_, FP8_MAX_)
    return q.to(tl.float8e4nv), s


@triton.jit
def w8a8_dot(a8, b, sa, FP8_ACC: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K tile's e4m3 product ``a8 [BM, BK] · b [BK, BN]`` scaled by the activation rows' scales ``sa [BM]``:
    ``[BM, BN]``, or with ``SWAP_AB`` its transpose ``[BN, BM]`` computed as ``bᵀ · a8ᵀ``. The swap puts the
    weight strip on the MMA's M side, which Hopper's warpgroup MMA needs to be at least 64 rows: a decode
    batch of 1-16 rows padded to the 64-row M side would otherwise keep the fp8 dot on the older
    ``mma.sync`` path."""
    if SWAP_AB:
        p = tl.dot(tl.trans(b), tl.trans(a8), max_num_imprecise_acc=FP8_ACC) * sa[None, :]
    else:
        p = tl.dot(a8, b, max_num_imprecise_acc=FP8_ACC) * sa[:, None]
    return p


@triton.jit
def w8a8_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A zero fp32 accumulator for :func:`w8a8_dot`'s products: ``[BLOCK_M, BLOCK_N]``, transposed with ``SWAP_AB``."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def w8a8_rows(acc, SWAP_AB: tl.constexpr):
    """:func:`w8a8_acc`'s accumulator as ``[BLOCK_M, BLOCK_N]`` rows for the epilogue (one transpose after the K
    loop when the dots ran swapped)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


def swap_ab(cfg: dict[str, Any], a_fp8: bool) -> bool:
    """A launch's ``SWAP_AB``: the config asks for it and the dots run w8a8 (a widened W8A16 tile is never swapped)."""
    return a_fp8 and bool(cfg.get("SWAP_AB", 0))


@triton.jit
def _gemv_dot_step(acc, a, b, sc, s_base, kt, x_ptr, SB: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   A_FP8: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr, FP8_ACC: tl.constexpr,
                   SWAP_AB: tl.constexpr):
    """``acc`` plus one K tile's product in :func:`_fp8_gemv_kernel`: the weight scales folded into the
    activation and the e4m3 tile widened to its dtype, or (``A_FP8``) the activation quantised per row and
    e4m3 x e4m3 scaled by ``s_x[m] · s_w`` (``SWAP_AB``: ``acc`` is ``[BLOCK_N, BLOCK_M]``, :func:`w8a8_dot`)."""
    if A_FP8:
        a8, sa = quantize_rows(a, FP8_MAX_, MIN_AMAX_)
        sw = tl.load(s_base + (kt * BLOCK_K) // SB)
        acc += w8a8_dot(a8, b, sa, FP8_ACC, SWAP_AB) * sw
    else:
        a = (a.to(tl.float32) * sc[None, :]).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(x_ptr.dtype.element_ty), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, b_ptr,
                     M, N, K,
                     stride_xm, stride_xg, stride_wg, stride_wn, stride_sg, stride_sn, stride_yk, stride_ym,
                     stride_yg,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     SB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                     A_FP8: tl.constexpr = False, FP8_MAX_: tl.constexpr = 448.0, MIN_AMAX_: tl.constexpr = 1e-12,
                     FP8_ACC: tl.constexpr = 32, SWAP_AB: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """y[m, g, n] (+ split k's partial) = Σ_k x[m, g, k] · w[g, n, k] · s[g, n // SB, k // SB] (+ bias[n]).

    Grid: (cdiv(M, BLOCK_M) · cdiv(N, BLOCK_N), SPLIT_K, G). BLOCK_N divides SB, so a strip has one scale row.
    ``A_FP8`` (``gemv_w8a8``): x is quantised per row and K tile (BLOCK_K = one 128-channel group, or all of
    a K below 128) and multiplied e4m3 x e4m3; with ``SWAP_AB`` as ``wᵀ · xᵀ`` (:func:`w8a8_dot`)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_blk = (pid_n * BLOCK_N) // SB
    # rows past N wrap onto valid weight rows (their results are never stored): no mask on the weight rows
    x_base = x_ptr + g * stride_xg + offs_m.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + g * stride_wg + (offs_n % N).to(tl.int64)[None, :] * stride_wn
    s_base = s_ptr + g * stride_sg + n_blk * stride_sn
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    # the strip's first weight tile is read before the PDL wait (no kernel writes weights), so it streams in
    # while the preceding kernel finishes; masked: the last split may be empty
    b, sc = w_tile(w_base, s_base, kt0 * BLOCK_K + offs_k, K, SB, False, True, True)
    pdl_enter(USE_PDL)
    acc = w8a8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    if kt0 < kt1:
        acc = _gemv_dot_step(acc, x_tile(x_base, kt0 * BLOCK_K + offs_k, m_ok, K, EVEN_K), b, sc, s_base, kt0,
                             x_ptr, SB, BLOCK_K, IEEE, A_FP8, FP8_MAX_, MIN_AMAX_, FP8_ACC, SWAP_AB)
    for kt in range(kt0 + 1, kt1):
        kk = kt * BLOCK_K + offs_k
        b, sc = w_tile(w_base, s_base, kk, K, SB, EVEN_K, True, True)
        acc = _gemv_dot_step(acc, x_tile(x_base, kk, m_ok, K, EVEN_K), b, sc, s_base, kt, x_ptr, SB, BLOCK_K,
                             IEEE, A_FP8, FP8_MAX_, MIN_AMAX_, FP8_ACC, SWAP_AB)
    acc = w8a8_rows(acc, SWAP_AB)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_yk + g * stride_yg + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """Per (token, 128-channel group): s = max(|x|) / 448, q = e4m3(x / s). Grid (cdiv(M, BLOCK_M),
    cdiv(K, GROUP)): each program quantises ``BLOCK_M`` rows of one group (one row per program left a prefill's
    4096 x 32 groups as 131k one-warp programs, ~14x slower than the bytes allow)."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, GROUP)
    r_ok = rows < M
    ok = r_ok[:, None] & (offs < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX_)
    # IEEE-rounded divisions, as the reference's tensor / tensor divisions are: a plain `/` compiles to the
    # approximate div.full.f32 on NVIDIA GPUs (1-ulp differences flip e4m3 codes at rounding ties)
    s = tl.math.div_rn(amax, FP8_MAX_)
    q = tl.clamp(tl.math.div_rn(x, s[:, None]), -FP8_MAX_, FP8_MAX_)
    tl.store(q_ptr + r64[:, None] * stride_qm + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + r64 * stride_sm + grp * stride_sk, s, mask=r_ok)


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K,
                      stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_ck, stride_cm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    """c = Σ over 128-wide K blocks of (a8 · b8ᵀ) · a_scale[m, kb] · b_scale[n // 128, kb] (+ bias).
    BLOCK_K = 128 (one scale per K step); BLOCK_N divides 128 (one b scale per tile). Grid (tiles, SPLIT_K):
    with a split, program (t, j) writes the fp32 partial sum of its share of the K blocks to ``c[j]``."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_safe = (offs_m % M).to(tl.int64)
    a_ptrs = a_ptr + m_safe[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + (offs_n % N).to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + m_safe * stride_asm
    bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_bsn
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb0 = pid_k * per_split
    a_ptrs += kb0 * BLOCK_K
    b_ptrs += kb0 * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, tl.minimum(kb0 + per_split, k_blocks)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        sa = tl.load(as_ptrs + kb * stride_ask)
        sb = tl.load(bs_ptrs + kb)
        acc += tl.dot(a, b) * sa[:, None] * sb
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + pid_k.to(tl.int64) * stride_ck + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

def default_gemv_config(m: int, n: int, k: int, groups: int = 1, num_sms: int = 132) -> dict[str, Any]:
    """GEMV tiles when the table has none: 16-row M tiles (the tl.dot minimum), narrow N strips when N is small
    so that there are about two strips per SM, and a K split only when even the narrowest strips are too few."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles_m = triton.cdiv(m, bm)
    bn = 64
    while bn > 16 and tiles_m * groups * triton.cdiv(n, bn) < 2 * num_sms:
        bn //= 2
    programs = tiles_m * groups * triton.cdiv(n, bn)
    bk = 256 if k >= 1024 else max(16, min(128, triton.next_power_of_2(k)))
    split = 1
    while programs * split < num_sms and triton.cdiv(k, bk) // (2 * split) >= 4:
        split *= 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}


def default_w8a8_config(m: int, n: int) -> dict[str, Any]:
    bm = 64 if m <= 256 else 128
    return {"BLOCK_M": bm, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8 if bm == 128 else 4, "num_stages": 3}


def default_impl(m: int, n: int, k: int, dtype: torch.dtype) -> dict[str, Any]:
    """:data:`FMA_DEFAULT` for one row, ``gemv`` up to :data:`GEMV_MAX_M` rows (and always for fp32 activations:
    the w8a8 paths would quantise them), else ``scaled_mm`` when N and K are multiples of 128 and this torch's
    ``_scaled_mm`` takes block scales, else the Triton ``w8a8`` GEMM."""
    if m == 1:
        return dict(FMA_DEFAULT)
    if m <= GEMV_MAX_M or dtype == torch.float32:
        return {"impl": "gemv", **default_gemv_config(m, n, k)}
    if n % BLOCK == 0 and k % BLOCK == 0 and dtype == torch.bfloat16 and scaled_mm_block_supported():
        return {"impl": "scaled_mm"}
    return {"impl": "w8a8", **default_w8a8_config(m, n)}


def table_file_name(device: str) -> str:
    return f"fp8_linear_{device}.json"


def validate_entry(entry: dict[str, Any]) -> None:
    """Raise ValueError naming the bad key of one table entry."""
    impl = entry.get("impl")
    if impl not in IMPLS:
        raise ValueError(f"fp8_linear table entry {entry}: impl must be one of {IMPLS}")
    check_positive(entry, GEMV_KEYS if impl in GEMV_IMPLS else W8A8_KEYS if impl == "w8a8" else (), "fp8_linear")
    split = entry.get("SPLIT_K", 1)  # optional for w8a8 (entries written before it had a K split)
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"fp8_linear table entry {entry}: SPLIT_K={split!r} must be a positive int")
    if entry.get("SWAP_AB", 0) not in (0, 1) or (entry.get("SWAP_AB") and impl != "gemv_w8a8"):
        raise ValueError(f"fp8_linear table entry {entry}: SWAP_AB must be 0 or 1, and 1 only for gemv_w8a8")
    if impl in (*GEMV_IMPLS, "w8a8") and (entry["BLOCK_N"] > BLOCK or BLOCK % entry["BLOCK_N"]):
        raise ValueError(f"fp8_linear table entry {entry}: BLOCK_N must divide {BLOCK} (one scale row per strip)")


@functools.lru_cache(maxsize=None)
def load_table(device: str) -> Table:
    """``{(N, K): sorted ((M, entry), ...)}`` from the measured table, or ``{}`` when there is none."""
    return read_table(CONFIG_DIR / table_file_name(device), validate_entry, "fp8_linear")


def select_impl(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The table's entry for ``(N, K)`` at the nearest M (ties: the smaller), else :func:`default_impl`.
    A ``scaled_mm`` entry this torch cannot run, or fp32 activations, fall back to the default."""
    rows = load_table(device_name(device.index)).get((n, k)) if device.type == "cuda" else None
    # an FMA GEMV entry serves at most its BLOCK_M rows: more would stream the weights once per row tile
    entry = nearest_entry(rows, m) if dtype != torch.float32 else None
    if entry is not None and (entry["impl"] != "scaled_mm" or scaled_mm_block_supported()):
        return entry
    return default_impl(m, n, k, dtype)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def group_tile_k(k: int) -> int:
    """BLOCK_K of a kernel that quantises its activation tiles (w8a8): one 128-channel group per K step, all
    of a smaller K, at least 32 (e4m3 dots)."""
    return max(32, min(BLOCK, triton.next_power_of_2(k)))


def fp8_dot_acc(block_k: int) -> int:
    """``max_num_imprecise_acc`` for e4m3 dots over ``block_k`` (:data:`FP8_DOT_ACC`, at most the tile's K)."""
    return min(FP8_DOT_ACC, block_k)


def _gemv(x3: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, cfg: dict[str, Any],
          out_dtype: torch.dtype) -> torch.Tensor:
    """x3 [M, G, K], w [G, N, K] fp8, s [G, nb, kb] → [M, G, N]."""
    m, groups, k = x3.shape
    n = w.shape[1]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    a_fp8 = cfg.get("impl") == "gemv_w8a8" and x3.dtype != torch.float32  # fp32 is never quantised
    if a_fp8:
        cfg = {**cfg, "BLOCK_K": group_tile_k(k)}
    bk, split, y = k_split(cfg, (m, groups, n), out_dtype, x3, w, s, min_k=32 if a_fp8 else 16)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split, groups)
    _fp8_gemv_kernel[grid](
        x3, w, s, y, bias if bias is not None else s, m, n, k,
        x3.stride(0), x3.stride(1), w.stride(0), w.stride(1), s.stride(0), s.stride(1), 0 if split == 1 else y.stride(0),
        y.stride(-3), y.stride(-2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SB=BLOCK, HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0, IEEE=x3.dtype == torch.float32, A_FP8=a_fp8, FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX,
        FP8_ACC=fp8_dot_acc(bk), SWAP_AB=swap_ab(cfg, a_fp8), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_kwargs(x3.device))
    return y if split == 1 else split_sum(y, out_dtype)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: dict[str, Any] | None = None) -> torch.Tensor:
    """W8A16 ``x [..., K] @ dequant(w, scale)ᵀ (+ bias)`` → ``[..., N]`` in ``x.dtype`` (any M; fastest small)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    n = w.shape[0]
    cfg = config or default_gemv_config(x2.shape[0], n, k)
    y = _gemv(x2.unsqueeze(1), w.unsqueeze(0), scale.unsqueeze(0), bias, cfg, x.dtype)
    return y.reshape(*x.shape[:-1], n)


def fp8_head_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    config: dict[str, Any] | None = None) -> torch.Tensor:
    """Per-head W8A16: ``x [M, G, K]``, ``w [G, N, K]`` fp8, ``scale [G, ceil(N/128), ceil(K/128)]`` → ``[M, G, N]``
    (reference :func:`glm5_kernels.fp8_ref.fp8_head_linear_ref`, which is also what runs above
    :data:`HEAD_GEMV_MAX_M` rows unless ``config`` asks for the GEMV)."""
    m, groups, k = x.shape
    if m > HEAD_GEMV_MAX_M and x.dtype != torch.float32 and config is None:
        return fp8_head_linear_ref(x, w, scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or default_gemv_config(m, w.shape[1], k, groups)
    return _gemv(x, w, scale, None, cfg, x.dtype)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = BLOCK, column_major: bool = False,
                              pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → ``(x8 e4m3 [M', K], scale fp32 [M', ceil(K/group)])``, ``M'`` = M rounded up to
    ``pad_rows_to`` (padding rows are zeros with the minimum scale). ``column_major`` lays the scales out as
    ``torch._scaled_mm``'s block scaling wants (``[kb, M'].t()``). Reference: :func:`~glm5_kernels.fp8_ref.
    per_token_group_quant_fp8_ref` (same rounding rule)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"per_token_group_quant_fp8 takes a row-major [M, K] tensor, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    mp = triton.cdiv(m, pad_rows_to) * pad_rows_to
    kb = triton.cdiv(k, group)
    q = torch.empty(mp, k, device=x.device, dtype=FP8_DTYPE)
    s = torch.empty(kb, mp, device=x.device, dtype=torch.float32).t() if column_major else \
        torch.empty(mp, kb, device=x.device, dtype=torch.float32)
    if mp > m:
        q[m:].zero_()
        s[m:].fill_(MIN_AMAX / FP8_MAX)
    if m:
        block_m = min(QUANT_ROWS, triton.next_power_of_2(m))
        _group_quant_kernel[(triton.cdiv(m, block_m), kb)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GROUP=group, BLOCK_M=block_m,
            FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX, num_warps=1 if block_m * group <= 512 else 4,
            **pdl_kwargs(x.device))
    return q, s


def w8a8_gemm(x8: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
              bias: torch.Tensor | None = None, config: dict[str, Any] | None = None) -> torch.Tensor:
    """``x8 [M, K]`` e4m3 with ``xs [M, ceil(K/128)]`` times ``w [N, K]`` e4m3 with ``scale`` → ``[M, N]``."""
    m, k = x8.shape
    n = w.shape[0]
    cfg = config or default_w8a8_config(m, n)
    # a K split serves few-tile shapes at decode sizes; a table entry measured there may be the nearest one for
    # a prefill, where the fp32 partials would take split x M x N x 4 bytes for nothing
    split = max(1, min(cfg.get("SPLIT_K", 1), triton.cdiv(k, BLOCK))) if m <= W8A8_SPLIT_MAX_M else 1
    c = split_output((m, n), out_dtype, split, x8.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    _w8a8_gemm_kernel[grid](x8, xs, w, scale, c, bias if bias is not None else scale, m, n, k,
                            x8.stride(0), xs.stride(0), xs.stride(1), w.stride(0), scale.stride(0),
                            0 if split == 1 else c.stride(0), c.stride(-2),
                            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK, GROUP_M=cfg["GROUP_M"],
                            HAS_BIAS=bias is not None, SPLIT_K=split, num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"], **pdl_kwargs(x8.device))
    return c if split == 1 else split_sum(c, out_dtype)


def scaled_mm_linear(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._scaled_mm`` with block scales (1 x 128 activations, 128 x 128 weights): ``x2 [M, K]`` bf16 →
    ``[M, N]`` bf16. N and K must be multiples of 128."""
    m = x2.shape[0]
    x8, xs = per_token_group_quant_fp8(x2, column_major=True, pad_rows_to=4)
    y = torch._scaled_mm(x8, w.t(), scale_a=xs, scale_b=scale.t(), out_dtype=x2.dtype)
    y = y[:m]
    return y if bias is None else y + bias


@functools.lru_cache(maxsize=1)
def scaled_mm_block_supported() -> bool:
    """Whether this torch/cuBLAS runs ``_scaled_mm`` with 1x128 / 128x128 block scales (probed once on a small
    problem, eagerly: the first fp8 linear runs before any CUDA-graph capture)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    try:
        dev = torch.device("cuda")
        x = torch.randn(4, 256, device=dev, dtype=torch.bfloat16)
        w = torch.randn(256, 256, device=dev).to(FP8_DTYPE)
        s = torch.ones(2, 2, device=dev)
        y = scaled_mm_linear(x, w, s)
        torch.cuda.synchronize()
        return tuple(y.shape) == (4, 256)
    except Exception as e:  # unsupported scaling mode on this torch / GPU
        logger.info("torch._scaled_mm block scaling unavailable (%s: %s); fp8 linears use the Triton kernels",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               impl: dict[str, Any] | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w, scale)ᵀ (+ bias)`` → ``[..., N]`` in ``x.dtype`` through the implementation
    :func:`select_impl` picks for this shape (or ``impl``, e.g. ``{"impl": "scaled_mm"}``)."""
    k = x.shape[-1]
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"fp8_linear: x has {k} features but the weight is {tuple(w.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    choice = impl or select_impl(m, n, k, x.dtype, x.device)
    kind = choice["impl"]
    if m == 0:
        y = x2.new_empty(0, n)
    elif kind in ("gemv", "gemv_w8a8"):
        y = _gemv(x2.unsqueeze(1), w.unsqueeze(0), scale.unsqueeze(0), bias, choice, x.dtype).squeeze(1)
    elif kind == "gemv_fma":
        y = gemv_fma(x2, w, scale, bias, choice, x.dtype, BLOCK)
    elif kind == "scaled_mm":
        y = scaled_mm_linear(x2, w, scale, bias)
    else:
        x8, xs = per_token_group_quant_fp8(x2)
        y = w8a8_gemm(x8, xs, w, scale, x.dtype, bias, choice)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["CONFIG_DIR", "FP8_DOT_ACC", "GEMV_IMPLS", "GEMV_MAX_M", "HEAD_GEMV_MAX_M", "IMPLS", "W8A8_SPLIT_MAX_M",
           "default_gemv_config", "default_impl", "default_w8a8_config", "fp8_dot_acc", "fp8_gemv", "fp8_head_linear",
           "fp8_linear", "group_tile_k", "load_table", "swap_ab", "w8a8_acc", "w8a8_dot", "w8a8_rows", "per_token_group_quant_fp8", "quantize_rows",
           "scaled_mm_block_supported", "scaled_mm_linear", "select_impl", "split_sum", "table_file_name",
           "validate_entry", "w8a8_gemm"]
