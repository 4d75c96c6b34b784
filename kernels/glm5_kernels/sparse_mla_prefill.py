"""Sparse NoPE MLA prefill over the latent cache (absorbed weights): each query attends only to its own
selected latent rows. Torch reference: :func:`glm5_kernels.sparse_mla_ref.sparse_mla_prefill_ref`.

Per query row ``n`` (a prefill token) and head ``h``, the absorbed query ``q̃ = W_UKᵀ q`` (``[R]``,
R = kv_lora_rank = 512) attends to the latent rows ``c[idx[n, j]]``, ``j < counts[n]``, that the kpool
indexer selected for that query (its top pools expanded to tokens plus its own incomplete pool, or every
token ``≤ pos`` below the selection threshold: :func:`glm5_kernels.indexer.select_token_slots`); the output
is the normalised ``Σ_j p_j c_j`` (``[R]``), which the caller maps back with ``W_UV``.

Why absorbed and per-row index lists (numbers for 64 heads, d_qk = d_v = 256, R = 512, 2051 selected rows):

* A key costs 4·R = 2048 FLOP per (query, head) pair absorbed vs 4·256 = 1024 expanded, but the expanded
  form first builds per-head K/V for every key of the context (``kv_b``: 2·512·32768 = 33.5 MFLOP per key
  per chunk) and can only skip work in whole tiles. The indexer's choices differ from query to query: over a
  64-query tile the union of 512-of-P pools covers nearly every pool unless neighbouring queries choose
  alike, so a tile-skipping expanded kernel computes close to every causal pair.
* Gathering per query is affordable only for the latent: one 1 KiB latent row serves all 64 heads (an MQA
  with K = V = the latent), where the expanded K/V of one key is 64 KiB.

8K prompt in two 4K chunks, one MLA layer: masked dense attention computes 50.3 M pairs (3.3 TFLOP) plus
0.41 TFLOP of ``kv_b`` expansion; the selection has 14.7 M pairs: 1.93 TFLOP absorbed plus 0.27 TFLOP for
``W_UK``/``W_UV``. 32K prompt in 4K chunks: 604 M pairs (39.6 TFLOP) + 4.9 TFLOP expansion dense, 65 M
pairs (8.5 TFLOP) + 1.1 TFLOP absorbed. docs/gpu.md has the table.

Grid ``(head blocks, queries, output parts)``: the head blocks of one query run next to each other, so a
gathered latent tile is read from L2 by the second one; neighbouring queries of one request share most of
their rows too. ``r_split = 2`` computes the scores over the full width but accumulates only half the output
columns per program (scores twice, but 64 heads per program fit the registers and the tensor-core tiles).
Each program loops over its query's valid prefix only (``counts``), with an online softmax in fp32, and writes
the normalised output in the output tensor's dtype. Sync-free: every shape comes from the arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm5_kernels.kpool import interpreting

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of :func:`sparse_mla_prefill` (``bench/kernel_check.py`` sweeps them)."""

    block_h: int = 32
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2
    r_split: int = 1          # 2: each program writes half the output columns (64 heads fit its registers)


# bf16: 32 heads × 512 fp32 accumulator in 8 warps stays under 255 registers without spills on sm90;
# 64 heads spill (cuobjdump -res-usage). fp32 (IEEE dots) tiles are halved to fit shared memory.
DEFAULT_CONFIGS = {torch.bfloat16: PrefillConfig(), torch.float16: PrefillConfig(),
                   torch.float32: PrefillConfig(block_h=16, block_k=16, num_warps=4, num_stages=2)}


@triton.jit
def _sparse_mla_prefill_kernel(q_ptr, lat_ptr, idx_ptr, cnt_ptr, o_ptr, qk_scale,
                               stride_qn, stride_qh, stride_lat, stride_in, stride_on, stride_oh,
                               H: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                               R_SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (head block, query, output part): scores over the full width R (in R_SPLIT slices), output
    columns ``part * R/R_SPLIT ..`` only (R_SPLIT = 2 halves the accumulator so 64 heads fit one program)."""
    hb = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, R // R_SPLIT)
    hmask = offs_h < H
    q_row = q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_p[None, :]
    cnt = tl.load(cnt_ptr + n)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R // R_SPLIT], tl.float32)
    for k0 in range(0, cnt, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        slot = tl.load(idx_ptr + n * stride_in + offs_k, mask=offs_k < cnt, other=-1)
        valid = slot >= 0
        c_row = lat_ptr + slot.to(tl.int64)[:, None] * stride_lat + offs_p[None, :]
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        for j in tl.static_range(R_SPLIT):
            q = tl.load(q_row + j * (R // R_SPLIT), mask=hmask[:, None], other=0.0)    # [BLOCK_H, R/R_SPLIT]
            c = tl.load(c_row + j * (R // R_SPLIT), mask=valid[:, None], other=0.0)    # [BLOCK_K, R/R_SPLIT]
            if UPCAST:                  # the interpreter's bf16 dot is wrong; fp32 holds bf16 exactly
                q = q.to(tl.float32)
                c = c.to(tl.float32)
            if IEEE or UPCAST:
                s = tl.dot(q, tl.trans(c), s, input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(c), s)
        if R_SPLIT == 1:
            v = c
        else:
            v = tl.load(c_row + part * (R // R_SPLIT), mask=valid[:, None], other=0.0)        # this program's columns
            if UPCAST:
                v = v.to(tl.float32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))                  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE or UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + n * stride_on + offs_h[:, None] * stride_oh + part * (R // R_SPLIT) + offs_p[None, :],
             out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def sparse_mla_prefill(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor,
                       scale: float, out: torch.Tensor | None = None,
                       config: PrefillConfig | None = None) -> torch.Tensor:
    """Attention of every query row over its own selected latent rows → ``[N, H, R]``.

    ``q_lat [N, H, R]`` (any row/head strides, unit last stride) and ``latent [S, R]`` share a dtype (bf16,
    fp16 or fp32; fp32 uses IEEE products); R a power of two. ``idx [N, W]`` int32 latent rows with each row's
    valid entries first and ``counts [N]`` int32 (≥ 1) how many (what :func:`select_token_slots` writes with
    ``counts_out``); ``-1`` entries before a count are skipped. ``out`` (optional): an ``[N, H, R]`` view to
    write, e.g. a head-major buffer for the following ``W_UV`` batched GEMM; else a new tensor in q's dtype.
    """
    n, h, r = q_lat.shape
    if latent.dim() != 2 or latent.shape[1] != r or r & (r - 1) or r < 16:
        raise ValueError(f"latent {tuple(latent.shape)} vs query width {r}: widths must match and be a power of "
                         "two >= 16")
    if q_lat.dtype != latent.dtype:
        raise ValueError(f"q_lat dtype {q_lat.dtype} != latent dtype {latent.dtype}; cast the query")
    if idx.dim() != 2 or idx.shape[0] != n or counts.shape != (n,):
        raise ValueError(f"idx {tuple(idx.shape)} and counts {tuple(counts.shape)} must be [{n}, W] and [{n}]")
    if q_lat.stride(-1) != 1 or latent.stride(-1) != 1:
        raise ValueError("q_lat and latent need a unit last stride")
    if out is None:
        out = torch.empty(n, h, r, device=q_lat.device, dtype=q_lat.dtype)
    elif out.shape != (n, h, r) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{n}, {h}, {r}] with a unit last stride, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if n == 0:
        return out
    cfg = config or DEFAULT_CONFIGS.get(q_lat.dtype, PrefillConfig())
    idx = idx if idx.dtype == torch.int32 and idx.stride(-1) == 1 else idx.to(torch.int32).contiguous()
    counts = counts if counts.dtype == torch.int32 and counts.is_contiguous() else counts.to(torch.int32).contiguous()
    block_h = min(cfg.block_h, max(16, triton.next_power_of_2(h)))
    r_split = cfg.r_split if r % cfg.r_split == 0 and r // cfg.r_split >= 16 else 1
    grid = (triton.cdiv(h, block_h), n, r_split)
    _sparse_mla_prefill_kernel[grid](
        q_lat, latent, idx, counts, out, scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), latent.stride(0), idx.stride(0), out.stride(0), out.stride(1),
        H=h, R=r, BLOCK_H=block_h, BLOCK_K=cfg.block_k, R_SPLIT=r_split, IEEE=q_lat.dtype == torch.float32,
        UPCAST=interpreting() and q_lat.dtype != torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def prefill_flops(pairs: int, h: int, r: int) -> int:
    """FLOPs of the absorbed attention over ``pairs`` (query, selected key) pairs: QK and PV, 2·R each."""
    return 4 * pairs * h * r


def selected_pairs(context_len: int, num_tokens: int, n_select: int, kpool: int) -> int:
    """(query, key) pairs the indexer selects for queries at positions ``context_len .. +num_tokens-1``:
    ``min(pos+1 // kpool, n_select)·kpool + (pos+1) % kpool`` each (host arithmetic)."""
    total = 0
    for p in range(context_len, context_len + num_tokens):
        total += min((p + 1) // kpool, n_select) * kpool + (p + 1) % kpool
    return total


__all__ = ["PrefillConfig", "DEFAULT_CONFIGS", "sparse_mla_prefill", "prefill_flops", "selected_pairs", "LOG2E"]
