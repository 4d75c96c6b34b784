"""Fused mHC (manifold-constrained hyper-connection) pre/post kernels, beside thin torch references.

The torch reference (:mod:`glm5_kernels.mhc_ref`) costs ~150 tiny launches per block site
(the 20-iteration Sinkhorn alone is 6 ops per iteration), which dominates small-batch decode. Here:

* :func:`mhc_pre` = 2 launches. ``_mhc_proj_kernel`` is a split-K projection of the *un-normalised*
  flattened streams onto the 24 ``fn`` rows (fp32 FMA dot for fp32 streams; tf32x3, or at prefill sizes three
  bf16 dots over ``fn`` split into bf16 parts, for bf16 streams: fp32 products either way) that also
  accumulates the sum of squares in the spare column 24 of its 32-wide partial row. ``_mhc_pre_row_kernel``
  (one program per token) sums the partials, applies the weight-less RMS scale (``fn·(x·r) = r·(fn·x)``, so the
  norm commutes out of the projection), does sigmoid / softmax / Sinkhorn in registers, collapses the
  streams and, optionally, the DecoderLayer's weighted ``rms_norm`` of the collapsed row (the whole
  row is in registers, so the norm costs no extra pass). Split-K keeps a decode step (T = 1) spread
  over ~64 SMs instead of one program streaming the 1.5 MB ``fn`` alone.
* :func:`mhc_post` = 1 launch: ``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]`` with the reference's
  rounding (``post``/``comb`` cast to the stream dtype first, product and matmul each rounded to it,
  then the add).

All mapping math is fp32 (model-spec §7). Grids depend on shapes only and nothing reads back to the
host, so both functions are CUDA-graph capturable.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from glm5_kernels.mhc_ref import mhc_post_ref, mhc_pre_ref
from glm5_kernels.device import sm_count
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

logger = logging.getLogger(__name__)

_BLOCK_T = 16      # token rows per projection program (tl.dot needs M >= 16) for decode-sized T
_BLOCK_T_LARGE = 64  # ... and from _LARGE_T rows on (prefill): fewer re-reads of fn per row
_LARGE_T = 512
#: Rows from which bf16 streams take the bf16x3 projection (``mhc_pre``'s ``fn_split``): the prefill sizes.
SPLIT3_MIN_ROWS = _LARGE_T
_MAX_SPLITS = 64   # split-K programs per row block at most
_MAX_BLOCK_H = 8192  # the pre kernel keeps a whole collapsed row in registers
#: Rows up to which ``mhc_pre(proj_fma=True)`` runs the projection on the CUDA cores (decode sizes).
FMA_MAX_ROWS = 8


# ------------------------------------------------------------------------------------------ kernels

@triton.jit
def _mhc_proj_kernel(x_ptr, fn_ptr, part_ptr, T, K, k_per_split, stride_xt,
                     MIX: tl.constexpr, MIX_PAD: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     SPLIT3: tl.constexpr = False, FMA: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """part[t, s, c] = Σ_{k in split s} x[t, k]·fn[c, k] for c < MIX; part[t, s, MIX] = Σ x[t, k]².

    ``SPLIT3`` (bf16 streams): ``fn_ptr`` is :func:`split_fn_bf16x3`'s ``[3, K, MIX_PAD]`` (fn = hi + mid + lo,
    each bf16, k-major): three bf16 tensor-core dots per K tile whose products are exact in the fp32
    accumulator, with weight tiles read along their rows. ``FMA`` (a few rows, ``BLOCK_T`` below the 16 a
    ``tl.dot`` needs): fp32 products and sums on the CUDA cores, no padded rows."""
    pdl_enter(USE_PDL)
    pid_t = tl.program_id(0)
    sp = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, MIX_PAD)
    cmask = cols < MIX
    acc = tl.zeros([BLOCK_T, MIX_PAD], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    k_lo = sp * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_hi
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + offs_k[None, :],
                     mask=rmask[:, None] & kmask[None, :], other=0.0)                   # [BLOCK_T, BLOCK_K]
        if SPLIT3:
            wp = fn_ptr + offs_k[:, None] * MIX_PAD + cols[None, :]                       # [BLOCK_K, MIX_PAD]
            acc = tl.dot(xt, tl.load(wp, mask=kmask[:, None], other=0.0), acc)
            acc = tl.dot(xt, tl.load(wp + K * MIX_PAD, mask=kmask[:, None], other=0.0), acc)
            acc = tl.dot(xt, tl.load(wp + 2 * K * MIX_PAD, mask=kmask[:, None], other=0.0), acc)
            x = xt.to(tl.float32)
        else:
            x = xt.to(tl.float32)
            w = tl.load(fn_ptr + cols[None, :] * K + offs_k[:, None],
                        mask=cmask[None, :] & kmask[:, None], other=0.0)                # [BLOCK_K, MIX_PAD]
            if FMA:
                acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
            else:
                acc += tl.dot(x, w, input_precision=PRECISION)
        ss += tl.sum(x * x, axis=1)
    acc = tl.where(cols[None, :] == MIX, ss[:, None], acc)
    out = part_ptr + (rows.to(tl.int64)[:, None] * SPLITS + sp) * MIX_PAD + cols[None, :]
    tl.store(out, acc, mask=rmask[:, None])


@triton.jit
def _mhc_pre_row_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, w_ptr, out_ptr, post_ptr, comb_ptr,
                        H, K, stride_xt, stride_ot, eps, norm_eps, block_eps, iters,
                        N: tl.constexpr, MIX: tl.constexpr, MIX_PAD: tl.constexpr, SPLITS: tl.constexpr,
                        SPLITS_P2: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, MIX_PAD)
    sps = tl.arange(0, SPLITS_P2)
    part = tl.load(part_ptr + (t * SPLITS + sps[:, None]) * MIX_PAD + cols[None, :],
                   mask=(sps < SPLITS)[:, None], other=0.0)
    m = tl.sum(part, axis=0)                                                            # [MIX_PAD]
    sumsq = tl.sum(tl.where(cols == MIX, m, 0.0), axis=0)
    rstd = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    sc = tl.where(cols < N, s0, tl.where(cols < 2 * N, s1, s2))
    z = (m * rstd) * sc + tl.load(base_ptr + cols, mask=cols < MIX, other=0.0)          # [MIX_PAD]

    # pick the [n | n | n*n] segments out of the register row with one-hot selects (exact)
    ii = tl.arange(0, N)
    pre = tl.sum(tl.where(cols[None, :] == ii[:, None], z[None, :], 0.0), axis=1)
    pre = tl.sigmoid(pre) + eps                                                          # [N]
    post = tl.sum(tl.where(cols[None, :] == N + ii[:, None], z[None, :], 0.0), axis=1)
    post = 2.0 * tl.sigmoid(post)
    cidx = 2 * N + ii[:, None] * N + ii[None, :]                                         # [N, N]
    c = tl.sum(tl.where(cols[None, None, :] == cidx[:, :, None], z[None, None, :], 0.0), axis=2)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + eps
    c = c / (tl.sum(c, axis=0)[None, :] + eps)                                          # column first
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + eps)
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
    tl.store(post_ptr + t * N + ii, post)
    tl.store(comb_ptr + t * N * N + ii[:, None] * N + ii[None, :], c)

    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    xs = tl.load(x_ptr + t * stride_xt + ii[:, None] * H + offs_h[None, :], mask=hmask[None, :],
                 other=0.0).to(tl.float32)                                               # [N, BLOCK_H]
    xc = tl.sum(pre[:, None] * xs, axis=0).to(x_ptr.dtype.element_ty)                    # collapse, rounded
    if HAS_NORM:
        # norms.rms_norm: fp32 statistics, cast to the activation dtype, then times the weight
        xf = xc.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / H
        xn = (xf * (1.0 / tl.sqrt(var + block_eps))).to(x_ptr.dtype.element_ty)
        wv = tl.load(w_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + offs_h, (wv * xn.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=hmask)
    else:
        tl.store(out_ptr + t * stride_ot + offs_h, xc, mask=hmask)


@triton.jit
def _mhc_post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, H, stride_yt, stride_xt, stride_ot,
                     N: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    jj = tl.arange(0, N)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    post = tl.load(post_ptr + t * N + jj).to(dt).to(tl.float32)                         # [N]
    y = tl.load(y_ptr + t * stride_yt + offs_h, mask=hmask, other=0.0).to(tl.float32)
    py = (post[:, None] * y[None, :]).to(dt)                                            # [N, BLOCK_H]
    acc = tl.zeros([N, BLOCK_H], tl.float32)
    for i in tl.static_range(N):  # (combᵀ X)[j] = Σ_i comb[i, j] X[i], fp32 accumulate like a GEMM
        ci = tl.load(comb_ptr + t * N * N + i * N + jj).to(dt).to(tl.float32)           # comb[i, :]
        xi = tl.load(x_ptr + t * stride_xt + i * H + offs_h, mask=hmask, other=0.0).to(tl.float32)
        acc += ci[:, None] * xi[None, :]
    out = py.to(tl.float32) + acc.to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + jj[:, None] * H + offs_h[None, :], out.to(dt), mask=hmask[None, :])


# ------------------------------------------------------------------------------------------ wrappers

def _target_programs(device: torch.device) -> int:
    """About two waves of programs (off the GPU, e.g. under the interpreter, the H200's)."""
    return 2 * sm_count(device)


def _check_streams(streams: torch.Tensor, n: int) -> tuple[int, int]:
    if streams.dim() != 3 or streams.shape[1] != n:
        raise ValueError(f"streams must be [T, n={n}, H], got {tuple(streams.shape)}")
    if n < 1 or n & (n - 1):
        raise ValueError(f"hc_mult n={n} must be a power of two for the Triton kernels; use glm5_kernels.mhc_ref")
    if not streams.is_contiguous():
        raise ValueError("streams must be contiguous ([T, n, H] row-major); call .contiguous() first")
    return streams.shape[0], streams.shape[2]


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
            eps: float, norm_eps: float, iters: int, block_norm_w: torch.Tensor | None = None,
            block_norm_eps: float | None = None, splits: int | None = None,
            block_k: int = 64, block_t: int | None = None, proj_warps: int = 4, proj_stages: int | None = None,
            row_warps: int | None = None, fn_split: torch.Tensor | None = None, proj_fma: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused :func:`~glm5_kernels.mhc_ref.mhc_pre_ref`: streams ``[T, n, H]`` → ``(x [T, H], post [T, n], comb [T, n, n])``.

    ``fn [n(n+2), nH]``, ``base [n(n+2)]``, ``scale [3]`` are fp32 (as the layer stores them);
    ``eps`` = hc_eps, ``norm_eps`` = eps of the mHC input norm (rms_norm_eps), ``iters`` = Sinkhorn
    iterations. ``x`` is in the streams dtype; when ``block_norm_w`` is given, ``x`` is instead
    ``rms_norm(x, block_norm_w, block_norm_eps)`` (dtype promoted with the weight's, as in torch).
    ``post``/``comb`` are fp32. ``splits``/``block_k``/``block_t``/``proj_warps``/``proj_stages`` tune the split-K
    projection (default: fill the GPU), ``row_warps`` the row kernel (``bench/kernel_bench.py --mhc``).
    ``fn_split`` (:func:`split_fn_bf16x3` of ``fn``): bf16 streams of at least ``SPLIT3_MIN_ROWS`` rows
    (prefill) run the projection as three bf16 dots (:func:`_mhc_proj_kernel`'s ``SPLIT3``) instead of tf32x3.
    ``proj_fma``: up to :data:`FMA_MAX_ROWS` rows, the projection multiplies on the CUDA cores in fp32 (``FMA``)
    with one row block of the rows' power of two instead of a 16-row tensor-core tile (decode sizes).
    """
    t, h = _check_streams(streams, n)
    mix, k = n * (n + 2), n * h
    if fn.shape != (mix, k) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"fn must be contiguous fp32 [{mix}, {k}], got {fn.dtype} {tuple(fn.shape)}; pass "
                         "the layer's fp32 fn")
    if base.shape != (mix,) or scale.shape != (3,) or base.dtype != torch.float32 or scale.dtype != torch.float32:
        raise ValueError(f"base must be fp32 [{mix}] and scale fp32 [3], got {base.dtype} {tuple(base.shape)} and "
                         f"{scale.dtype} {tuple(scale.shape)}")
    block_h = triton.next_power_of_2(h)
    if block_h > _MAX_BLOCK_H:
        raise ValueError(f"hidden size {h} > {_MAX_BLOCK_H}: the row kernel holds a row in registers; "
                         "use mhc_pre_ref for this size")
    dev = streams.device
    if block_norm_w is not None:
        if block_norm_eps is None:
            raise ValueError("block_norm_w given without block_norm_eps; pass the layer's rms_norm_eps")
        beps = block_norm_eps
        if block_norm_w.shape != (h,) or not block_norm_w.is_contiguous():
            raise ValueError(f"block_norm_w must be contiguous [{h}], got {tuple(block_norm_w.shape)}")
        out = torch.empty(t, h, device=dev, dtype=torch.promote_types(streams.dtype, block_norm_w.dtype))
    else:
        beps = 0.0
        out = torch.empty(t, h, device=dev, dtype=streams.dtype)
    post = torch.empty(t, n, device=dev, dtype=torch.float32)
    comb = torch.empty(t, n, n, device=dev, dtype=torch.float32)
    if t == 0:
        return out, post, comb
    fma = proj_fma and t <= FMA_MAX_ROWS
    if block_t is None:
        block_t = triton.next_power_of_2(t) if fma else _BLOCK_T_LARGE if t >= _LARGE_T else _BLOCK_T
    row_blocks = triton.cdiv(t, block_t)
    kblocks = triton.cdiv(k, block_k)
    if splits is None:
        splits = min(_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(_target_programs(dev), row_blocks)))
    splits = max(1, min(splits, kblocks))
    k_per_split = block_k * triton.cdiv(kblocks, splits)
    splits = triton.cdiv(k, k_per_split)
    mix_pad = triton.next_power_of_2(mix + 1)  # one spare column carries the sum of squares
    part = torch.empty(t, splits, mix_pad, device=dev, dtype=torch.float32)
    split3 = fn_split is not None and streams.dtype == torch.bfloat16 and t >= SPLIT3_MIN_ROWS
    if split3 and (fn_split.shape != (3, k, mix_pad) or fn_split.dtype != torch.bfloat16
                   or not fn_split.is_contiguous()):
        raise ValueError(f"fn_split must be split_fn_bf16x3(fn): contiguous bf16 [3, {k}, {mix_pad}], got "
                         f"{fn_split.dtype} {tuple(fn_split.shape)}")
    _mhc_proj_kernel[(row_blocks, splits)](
        streams, fn_split if split3 else fn, part, t, k, k_per_split, streams.stride(0),
        MIX=mix, MIX_PAD=mix_pad, SPLITS=splits, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT3=split3, FMA=fma,
        # 16-bit streams are exact in tf32, so tf32x3 (fn split into two tf32 halves) keeps fp32 accuracy on
        # tensor cores; the FMA "ieee" dot made this projection 15 % of an 8K prefill. fp32 streams stay ieee.
        # SPLIT3 (bf16 prefill rows): three bf16 dots over the k-major split, whose weight tiles load along
        # their rows where the [24, K] fn loads across them: mHC pre 116.6 / 224.0 µs against tf32x3's
        # 210.5 / 428.8 at 4096 / 8192 rows (H200, bench/results/mhc_split3_h200.json).
        PRECISION="ieee" if streams.dtype == torch.float32 else "tf32x3", num_warps=proj_warps,
        **({} if proj_stages is None else {"num_stages": proj_stages}), **pdl_kwargs(streams.device))
    _mhc_pre_row_kernel[(t,)](
        streams, part, base, scale, block_norm_w if block_norm_w is not None else out, out, post, comb,
        h, k, streams.stride(0), out.stride(0), eps, norm_eps, beps, iters,
        N=n, MIX=mix, MIX_PAD=mix_pad, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        BLOCK_H=block_h, HAS_NORM=block_norm_w is not None,
        num_warps=row_warps if row_warps is not None else 8 if block_h >= 2048 else 4, **pdl_kwargs(streams.device))
    return out, post, comb


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             block_h: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Fused :func:`~glm5_kernels.mhc_ref.mhc_post_ref`: ``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]`` → ``[T, n, H]``.

    ``block_out`` ``[T, H]`` and ``streams`` ``[T, n, H]`` share a dtype (the result's); ``post``
    ``[T, n]`` and ``comb`` ``[T, n, n]`` are fp32 and are rounded to that dtype first, as the
    reference does. ``block_h`` / ``num_warps`` (columns and warps per program) default to :func:`post_tile`.
    """
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, H], got {tuple(streams.shape)}")
    t, h = _check_streams(streams, streams.shape[1])
    n = streams.shape[1]
    if block_out.shape != (t, h) or block_out.dtype != streams.dtype or block_out.stride(-1) != 1:
        raise ValueError(f"block_out must be [{t}, {h}] {streams.dtype} with unit last stride, got "
                         f"{block_out.dtype} {tuple(block_out.shape)}; cast it to the streams dtype")
    if post.shape != (t, n) or comb.shape != (t, n, n) or post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError(f"post must be fp32 [{t}, {n}] and comb fp32 [{t}, {n}, {n}], got {post.dtype} "
                         f"{tuple(post.shape)} and {comb.dtype} {tuple(comb.shape)}")
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty_like(streams)
    if t == 0:
        return out
    tile_h, tile_w = post_tile(t)
    block_h = min(block_h or tile_h, triton.next_power_of_2(h))
    num_warps = num_warps or tile_w
    _mhc_post_kernel[(t, triton.cdiv(h, block_h))](
        block_out, streams, post, comb, out, h, block_out.stride(0), streams.stride(0), out.stride(0),
        N=n, BLOCK_H=block_h, num_warps=num_warps, **pdl_kwargs(streams.device))
    return out


def split_fn_bf16x3(fn: torch.Tensor) -> torch.Tensor:
    """``fn [MIX, K]`` fp32 as three bf16 parts ``hi + mid + lo`` (each the bf16 rounding of what the ones
    before leave: 24 significant bits, fp32's own), transposed k-major and padded with zero columns to the
    projection's ``[3, K, MIX_PAD]`` (:func:`mhc_pre`'s ``fn_split``; the layer makes it once per site)."""
    mix, k = fn.shape
    mix_pad = triton.next_power_of_2(mix + 1)
    parts, rest = [], fn.float()
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    out = torch.zeros(3, k, mix_pad, dtype=torch.bfloat16, device=fn.device)
    out[:, :, :mix] = torch.stack(parts).transpose(1, 2)
    return out


def post_tile(t: int) -> tuple[int, int]:
    """``(block_h, num_warps)`` of :func:`mhc_post` for ``t`` rows. Measured at n = 4, H = 4096, bf16 from CUDA
    graphs (``bench/kernel_bench.py --mhc``, H200, 2026-12-04 02:19 UTC, bench/results/mhc_tiles_h200.json): from 64
    rows on 2048 columns on 8 warps (T = 4096: 79.4 µs against 107.1 with 512 on 4, the copy floor 71.2; T = 64:
    6.4 against 8.1); the output is bitwise the same (each element's sum does not depend on the tile)."""
    return (2048, 8) if t >= 64 else (512, 4)


# ---------------------------------------------------------------------------------------- benchmark

def bench_mhc(tokens: tuple[int, ...] = (1, 8, 64, 4096), h: int = 4096, n: int = 4, iters: int = 20,
              dtype: torch.dtype = torch.bfloat16) -> list[dict[str, float]]:
    """Time one block site (pre + fused norm, then post) fused vs torch on CUDA, each replayed from a
    CUDA graph as decode runs, so the gain shown is GPU time, not Python overhead. One row per T."""
    import triton.testing

    g = torch.Generator(device="cpu").manual_seed(0)
    fn = (torch.randn(n * (n + 2), n * h, generator=g) * 0.02).cuda()
    base, scale = torch.randn(n * (n + 2), generator=g).cuda(), torch.rand(3, generator=g).cuda()
    w = (1 + 0.1 * torch.randn(h, generator=g)).to("cuda", dtype)
    rows = []
    for t in tokens:
        streams = torch.randn(t, n, h, generator=g).to("cuda", dtype)
        y = torch.randn(t, h, generator=g).to("cuda", dtype)

        def fused() -> torch.Tensor:
            x, p, c = mhc_pre(streams, fn, base, scale, n, 1e-6, 1e-5, iters, w, 1e-5)
            return mhc_post(y, streams, p, c)

        def ref() -> torch.Tensor:
            x, p, c = mhc_pre_ref(streams, fn, base, scale, n, 1e-6, 1e-5, iters, w, 1e-5)
            return mhc_post_ref(y, streams, p, c)

        row: dict[str, float] = {"T": t}
        for name, f in (("fused_ms", fused), ("torch_ms", ref)):
            f()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                f()
            row[name] = triton.testing.do_bench(graph.replay, return_mode="median")
        logger.info("mhc site T=%d: fused %.4f ms, torch %.4f ms", t, row["fused_ms"], row["torch_ms"])
        rows.append(row)
    return rows


__all__ = ["FMA_MAX_ROWS", "SPLIT3_MIN_ROWS", "mhc_pre", "mhc_post", "post_tile", "split_fn_bf16x3", "bench_mhc"]
