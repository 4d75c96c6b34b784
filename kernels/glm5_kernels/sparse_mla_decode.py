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
output in the requested dtype. A program handles ``BLOCK_H`` heads of one row, so each gathered latent tile
is reused by those heads. Indices are trusted (no host sync); ``-1`` entries are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_kernels.kpool import interpreting


@triton.jit
def _sparse_mla_split_kernel(q_ptr, lat_ptr, idx_ptr, cnt_ptr, o_ptr, m_ptr, l_ptr,
                             scale, K, per_split,
                             stride_qn, stride_qh, stride_lat, stride_in,
                             stride_on, stride_os, stride_oh,
                             H: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_CNT: tl.constexpr,
                             UPCAST: tl.constexpr = False):
    n = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    hmask = offs_h < H
    q = tl.load(q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_r[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)          # the interpreter's bf16 dot is wrong; fp32 holds bf16 exactly
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    k_lo = sp * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    if HAS_CNT:  # valid entries come first: stop at the row's count (short contexts select fewer rows)
        k_hi = tl.minimum(k_hi, tl.load(cnt_ptr + n))
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_hi
        slot = tl.load(idx_ptr + n * stride_in + offs_k, mask=kmask, other=-1)
        valid = slot >= 0
        c = tl.load(lat_ptr + slot.to(tl.int64)[:, None] * stride_lat + offs_r[None, :], mask=valid[:, None],
                    other=0.0)                                                    # [BLOCK_K, R]
        if UPCAST:
            c = c.to(tl.float32)
        if IEEE or UPCAST:  # fp32 inputs: full-precision products, not tf32
            s = tl.dot(q, tl.trans(c), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(c)) * scale                                  # [BLOCK_H, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE or UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    o_off = n * stride_on + sp * stride_os + offs_h[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptr + o_off, acc, mask=hmask[:, None])
    ml_off = (n * SPLITS + sp) * H + offs_h
    tl.store(m_ptr + ml_off, m_i, mask=hmask)
    tl.store(l_ptr + ml_off, l_i, mask=hmask)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, stride_on, stride_os, stride_oh, stride_rn, stride_rh,
                    H: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """out[n, h] = Σ_s e^{m_s - M} o_s / Σ_s e^{m_s - M} l_s over the splits (empty splits: m = -inf, skipped)."""
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
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    den = tl.maximum(tl.sum(l_ * w, 0), 1e-30)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    o = tl.load(o_ptr + n * stride_on + sp[:, None] * stride_os + h * stride_oh + offs_r[None, :],
                mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + n * stride_rn + h * stride_rh + offs_r, (num / den).to(out_ptr.dtype.element_ty))


def sparse_mla_decode(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, scale: float,
                      splits: int | None = None, block_h: int = 16, block_k: int = 32,
                      counts: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton version of :func:`sparse_mla_decode_ref` (same arguments; returns ``[N, H, R]`` in ``out_dtype``,
    fp32 by default; the layer asks for its activation dtype, saving a cast).

    ``q_lat`` and ``latent`` must share a dtype (bf16 or fp32); R must be a power of two. ``counts [N]``
    (optional): row n's valid entries are its first ``counts[n]`` (as select_token_slots writes them);
    programs past it skip their tiles instead of loading ``-1`` entries.
    ``splits`` defaults to enough programs to fill the GPU (~2 waves over 132 SMs).
    """
    n, h, r = q_lat.shape
    if latent.shape[1] != r or r & (r - 1):
        raise ValueError(f"latent width {latent.shape[1]} vs query {r}: must match and be a power of two")
    if q_lat.dtype != latent.dtype:
        raise ValueError(f"q_lat dtype {q_lat.dtype} != latent dtype {latent.dtype}; cast the query")
    q_lat, idx = q_lat.contiguous(), idx.to(torch.int32).contiguous()
    k = idx.shape[1]
    hblocks = triton.cdiv(h, block_h)
    if splits is None:
        splits = max(1, min(triton.cdiv(k, 4 * block_k), triton.cdiv(264, max(n * hblocks, 1))))
    per_split = block_k * triton.cdiv(triton.cdiv(k, splits), block_k)
    splits = triton.cdiv(k, per_split)
    o = torch.empty(n, splits, h, r, device=q_lat.device, dtype=torch.float32)
    m = torch.empty(n, splits, h, device=q_lat.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    _sparse_mla_split_kernel[(n, hblocks, splits)](
        q_lat, latent, idx, counts if counts is not None else idx, o, m, l_, scale, k, per_split,
        q_lat.stride(0), q_lat.stride(1), latent.stride(0), idx.stride(0),
        o.stride(0), o.stride(1), o.stride(2),
        H=h, R=r, BLOCK_H=block_h, BLOCK_K=block_k, SPLITS=splits, IEEE=q_lat.dtype == torch.float32,
        HAS_CNT=counts is not None, UPCAST=interpreting() and q_lat.dtype != torch.float32,
        num_warps=8 if r >= 512 else 4)
    out = torch.empty(n, h, r, device=q_lat.device, dtype=out_dtype)
    block_r = min(r, 128)
    _combine_kernel[(n, h, r // block_r)](
        o, m, l_, out, o.stride(0), o.stride(1), o.stride(2), out.stride(0), out.stride(1),
        H=h, R=r, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), BLOCK_R=block_r, num_warps=1)
    return out


def decode_bytes(n: int, k: int, r: int, h: int, elem: int) -> int:
    """Fewest bytes a decode step must move: each selected latent row once, queries, outputs."""
    return n * k * r * elem + n * h * r * (elem + 4) + n * k * 4


def decode_flops(n: int, k: int, r: int, h: int) -> int:
    return 4 * n * h * k * r


__all__ = ["sparse_mla_decode", "decode_bytes", "decode_flops"]
