"""Sparse NoPE MLA decode over the latent cache (absorbed weights), with its torch reference.

Per query row ``n`` (a decode token or one of a request's speculative-verification tokens) and head
``h``, the absorbed query ``q̃ = W_UKᵀ q`` (``[R]``, R = kv_lora_rank = 512) attends to the latent
rows ``c[idx[n, j]]`` of the cache selected by the indexer (≤ index_topk + kpool − 1 of them,
``-1``-padded); the output is the attention-weighted latent ``Σ_j p_j c_j`` (``[R]``), which the
caller maps back with ``W_UV``. Keys and values are the same latent rows and there is no rope part
(rope dim 0 natively: nothing to pad).

Split-KV (flash-decoding): the index list of each row is cut into ``splits`` pieces processed by
separate programs that write an un-normalised partial output plus running max / sum; a second small
kernel merges them (the torch version of that merge was ~15 elementwise launches per layer) and writes the
output in the requested dtype. With one split (large batches) the kernel normalises and writes the output
itself. A program handles ``BLOCK_H`` heads of one row (all 64 by default), so each gathered latent tile is
read once and reused by those heads. Indices are trusted (no host sync); ``-1`` entries are skipped.

The same kernel serves prefill (:mod:`glm5_kernels.sparse_mla_prefill`: one split per query, normalised).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm5_kernels.device import compute_capability, interpreting, sm_count
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, PRECISE: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; ``PRECISE``: IEEE fp32 products (fp32 inputs, or bf16 widened under
    the interpreter), not tf32."""
    if PRECISE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _sparse_mla_kernel(q_ptr, lat_ptr, idx_ptr, cnt_ptr, o_ptr, m_ptr, l_ptr,
                       qk_scale, K, per_split,
                       stride_qn, stride_qh, stride_lat, stride_in,
                       stride_on, stride_os, stride_oh,
                       H: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_CNT: tl.constexpr,
                       UPCAST: tl.constexpr = False, NORMALIZE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program (head block, row, split): ``BLOCK_H`` heads of query row ``n`` over the selected rows
    ``per_split·sp ..`` of its list, an online softmax in the log2 domain (``qk_scale`` = scale · log2 e).

    The query block is loaded once; each gathered latent tile ``[BLOCK_K, R]`` is loaded as two halves of the
    width, which serve both the scores (``q₀·c₀ᵀ + q₁·c₁ᵀ``) and the two halves of the accumulator
    (``p·c₀``, ``p·c₁``). With all 64 heads in one program a latent row is gathered once per split and its
    tensor-core tiles are 64 rows tall. ``NORMALIZE`` (one split, prefill): write ``acc / l`` in ``o``'s
    dtype; else the fp32 partial ``acc`` and its running max (log2 units) and sum for :func:`_combine_kernel`.
    """
    pdl_enter(USE_PDL)
    hb = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    RH: tl.constexpr = R // 2
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, RH)
    hmask = offs_h < H
    q_base = q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_p[None, :]
    q0 = tl.load(q_base, mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_base + RH, mask=hmask[:, None], other=0.0)
    if UPCAST:
        q0 = q0.to(tl.float32)        # the interpreter's bf16 dot is wrong; fp32 holds bf16 exactly
        q1 = q1.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, RH], tl.float32)
    acc1 = tl.zeros([BLOCK_H, RH], tl.float32)
    k_lo = sp * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    if HAS_CNT:  # valid entries come first: stop at the row's count (short contexts select fewer rows)
        k_hi = tl.minimum(k_hi, tl.load(cnt_ptr + n))
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        slot = tl.load(idx_ptr + n * stride_in + offs_k, mask=offs_k < k_hi, other=-1)
        valid = slot >= 0
        c_row = lat_ptr + slot.to(tl.int64)[:, None] * stride_lat + offs_p[None, :]
        c0 = tl.load(c_row, mask=valid[:, None], other=0.0)                       # [BLOCK_K, R/2]
        c1 = tl.load(c_row + RH, mask=valid[:, None], other=0.0)
        if UPCAST:
            c0 = c0.to(tl.float32)
            c1 = c1.to(tl.float32)
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        s = _dot(q0, tl.trans(c0), s, IEEE or UPCAST)
        s = _dot(q1, tl.trans(c1), s, IEEE or UPCAST)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(c0.dtype)
        acc0 = _dot(p, c0, acc0 * alpha[:, None], IEEE or UPCAST)
        acc1 = _dot(p, c1, acc1 * alpha[:, None], IEEE or UPCAST)
        m_i = m_new
    o_base = o_ptr + n * stride_on + sp * stride_os + offs_h[:, None] * stride_oh + offs_p[None, :]
    if NORMALIZE:
        inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(o_base, (acc0 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(o_base + RH, (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        tl.store(o_base, acc0, mask=hmask[:, None])
        tl.store(o_base + RH, acc1, mask=hmask[:, None])
        ml_off = (n * SPLITS + sp) * H + offs_h
        tl.store(m_ptr + ml_off, m_i, mask=hmask)
        tl.store(l_ptr + ml_off, l_i, mask=hmask)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, stride_on, stride_os, stride_oh, stride_rn, stride_rh,
                    H: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                    BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr = False):
    """out[n, h] = Σ_s 2^{m_s - M} o_s / Σ_s 2^{m_s - M} l_s over the splits (m in log2 units; empty splits:
    m = -inf, skipped)."""
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rb = tl.program_id(2)
    sp = tl.arange(0, SPLITS_P2)
    smask = sp < SPLITS
    ml = (n * SPLITS + sp) * H + h
    m = tl.load(m_ptr + ml, mask=smask, other=float("-inf"))
    l_ = tl.load(l_ptr + ml, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    den = tl.maximum(tl.sum(l_ * w, 0), 1e-30)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    o = tl.load(o_ptr + n * stride_on + sp[:, None] * stride_os + h * stride_oh + offs_r[None, :],
                mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + n * stride_rn + h * stride_rh + offs_r, (num / den).to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of the sparse MLA kernel (``bench/kernel_check.py`` and ``kernel_bench.py`` sweep them)."""

    block_h: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2


#: bf16 / fp16: all 64 heads in one program, 64-row key tiles (H200, 2026-12-02: 2051 rows per query at
#: n = 1 / 8 / 64 / 256 rows took 17.8 / 29.2 / 103 / 353 µs against 19.8 / 41.9 / 245 / 938 µs with 16-head
#: programs and full-width tiles; the 8K prefill chunk's 2048 queries 1.97 ms against 5.88 ms). fp32 (IEEE
#: products) halves the tiles to fit shared memory.
DEFAULT_CONFIGS = {torch.bfloat16: AttnConfig(), torch.float16: AttnConfig(),
                   torch.float32: AttnConfig(block_h=16, block_k=32, num_warps=8, num_stages=2)}
#: bf16 / fp16 tile for GPUs before Hopper: the default needs 131 KB of shared memory on sm90 and 164 KB as
#: compiled for sm80 / sm86, over their 163 / 99 KB per block; this one needs 82 KB (not timed there).
PRE_HOPPER_CONFIG = AttnConfig(block_h=32, block_k=32, num_warps=8, num_stages=2)


def default_config(dtype: torch.dtype, device: torch.device) -> AttnConfig:
    """The launch tile for ``dtype`` on ``device`` (:data:`DEFAULT_CONFIGS`, or :data:`PRE_HOPPER_CONFIG` for
    16-bit inputs on a CUDA GPU of compute capability below 9.0)."""
    cap = compute_capability(device)
    if dtype != torch.float32 and cap is not None and cap[0] < 9:
        return PRE_HOPPER_CONFIG
    return DEFAULT_CONFIGS.get(dtype, AttnConfig())


def check_inputs(q_lat: torch.Tensor, latent: torch.Tensor) -> None:
    """Raise ValueError unless ``q_lat [N, H, R]`` and ``latent [S, R]`` suit the kernel."""
    r = q_lat.shape[-1]
    if latent.dim() != 2 or latent.shape[1] != r or r & (r - 1) or r < 32:
        raise ValueError(f"latent {tuple(latent.shape)} vs query width {r}: widths must match and be a power of "
                         "two >= 32 (the kernel splits it in halves of at least 16)")
    if q_lat.dtype != latent.dtype:
        raise ValueError(f"q_lat dtype {q_lat.dtype} != latent dtype {latent.dtype}; cast the query")
    if q_lat.stride(-1) != 1 or latent.stride(-1) != 1:
        raise ValueError("q_lat and latent need a unit last stride")


def _heads_per_program(cfg: AttnConfig, h: int) -> int:
    """``cfg.block_h`` capped at ``h`` rounded up to a power of two (at least 16, the dot's minimum)."""
    return min(cfg.block_h, max(16, triton.next_power_of_2(h)))


def _rows_per_split(k: int, splits: int, block_k: int) -> int:
    """Selected rows each of ``splits`` programs takes from a ``k``-wide list: whole key tiles."""
    return block_k * triton.cdiv(triton.cdiv(k, splits), block_k)


def launch_attention(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor | None,
                     scale: float, splits: int, cfg: AttnConfig, out: torch.Tensor, m: torch.Tensor | None = None,
                     l_: torch.Tensor | None = None) -> None:
    """One launch of :func:`_sparse_mla_kernel` over ``splits`` pieces of each row's list. ``splits == 1``:
    ``out [N, H, R]`` receives the normalised output in its dtype; else ``out [N, splits, H, R]`` fp32 partials
    and ``m``, ``l_ [N, splits, H]`` their running max and sum."""
    n, h, r = q_lat.shape
    k = idx.shape[1]
    block_h = _heads_per_program(cfg, h)
    per_split = _rows_per_split(k, splits, cfg.block_k)
    normalize = splits == 1
    stride_os = 0 if normalize else out.stride(1)
    _sparse_mla_kernel[(triton.cdiv(h, block_h), n, splits)](
        q_lat, latent, idx, counts if counts is not None else idx, out, out if m is None else m,
        out if l_ is None else l_, scale * LOG2E, k, per_split,
        q_lat.stride(0), q_lat.stride(1), latent.stride(0), idx.stride(0), out.stride(0), stride_os, out.stride(-2),
        H=h, R=r, BLOCK_H=block_h, BLOCK_K=cfg.block_k, SPLITS=splits, IEEE=q_lat.dtype == torch.float32,
        HAS_CNT=counts is not None, UPCAST=interpreting() and q_lat.dtype != torch.float32, NORMALIZE=normalize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(q_lat.device))


def sparse_mla_decode(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, scale: float,
                      splits: int | None = None, block_h: int | None = None, block_k: int | None = None,
                      counts: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton version of :func:`sparse_mla_decode_ref` (same arguments; returns ``[N, H, R]`` in ``out_dtype``,
    fp32 by default; the layer asks for its activation dtype, saving a cast).

    ``q_lat`` and ``latent`` must share a dtype (bf16 or fp32); R must be a power of two >= 32. ``counts [N]``
    (optional): row n's valid entries are its first ``counts[n]`` (as select_token_slots writes them);
    programs past it skip their tiles instead of loading ``-1`` entries. ``block_h`` / ``block_k`` override
    the tile of :func:`default_config`. ``splits`` defaults to about one program per SM (at most one
    key tile per split); with one split the kernel writes the output itself and no combine launch runs.
    """
    n, h, r = q_lat.shape
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    check_inputs(q_lat, latent)
    idx = idx if idx.dtype == torch.int32 and idx.stride(-1) == 1 else idx.to(torch.int32).contiguous()
    base = default_config(q_lat.dtype, q_lat.device)
    cfg = AttnConfig(block_h or base.block_h, block_k or base.block_k, base.num_warps, base.num_stages)
    k = idx.shape[1]
    hblocks = triton.cdiv(h, _heads_per_program(cfg, h))
    if splits is None:
        splits = max(1, min(triton.cdiv(k, cfg.block_k), sm_count(q_lat.device) // max(n * hblocks, 1)))
    splits = triton.cdiv(k, _rows_per_split(k, splits, cfg.block_k))  # no empty split
    out = torch.empty(n, h, r, device=q_lat.device, dtype=out_dtype)
    if n == 0:
        return out
    if splits == 1:
        launch_attention(q_lat, latent, idx, counts, scale, 1, cfg, out)
        return out
    o = torch.empty(n, splits, h, r, device=q_lat.device, dtype=torch.float32)
    m = torch.empty(n, splits, h, device=q_lat.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    launch_attention(q_lat, latent, idx, counts, scale, splits, cfg, o, m, l_)
    block_r = min(r, 128)
    _combine_kernel[(n, h, r // block_r)](
        o, m, l_, out, o.stride(0), o.stride(1), o.stride(2), out.stride(0), out.stride(1),
        H=h, R=r, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), BLOCK_R=block_r, num_warps=1,
        **pdl_kwargs(o.device))
    return out


def decode_bytes(n: int, k: int, r: int, h: int, elem: int) -> int:
    """Fewest bytes a decode step must move: each selected latent row once, queries, outputs."""
    return n * k * r * elem + n * h * r * (elem + 4) + n * k * 4


def decode_flops(n: int, k: int, r: int, h: int) -> int:
    return 4 * n * h * k * r


__all__ = ["AttnConfig", "DEFAULT_CONFIGS", "LOG2E", "PRE_HOPPER_CONFIG", "check_inputs", "decode_bytes", "decode_flops",
           "default_config", "launch_attention", "sparse_mla_decode"]
