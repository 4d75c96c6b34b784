"""Batched kpool-indexer scoring and token selection for decode (and prefill rows), with torch references.

Per query row ``n`` (its request's block-table row ``row_seq[n]``, ``n_complete[n]`` visible pools):

  score[n, p] = Σ_h w[n,h] · relu(softmax_scale · q[n,h]·K_p)      p < n_complete[n]   (exact mode, fp32 dots)
              = fp8_index_scores' math                                                (fp8 mode)
  score[n, p] = -inf                                                 p ≥ n_complete[n]

then the top ``n_select`` pools by (score desc, pool id asc) — the set ``torch.sort(stable=True)`` picks in
:meth:`glm5.layers.indexer.KPoolIndexer.visible`, exact ties included — expanded to the latent rows of their
tokens, plus the query's own incomplete pool (tokens ``n_complete*kpool .. pos``); ``-1`` pads the rest.

Everything is sync-free with shapes fixed by the arguments (``max_pools`` is a Python int), so a decode step
can be captured in a CUDA graph. The score kernel puts (row, chunk of pools) in the grid and does all heads
of a row in one ``tl.dot [Hi, d] x [d, BLOCK_P]``; tiles past ``n_complete`` only store ``-inf``.
Selection is a per-row radix select on order-preserving score bits (ties at the threshold go to the lowest
pool ids), so its choice equals the stable sort's without sorting, and it reads only the row's visible pools.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from glm5_kernels.fp8_index_ref import quantize_e4m3
from glm5_kernels.device import interpreting
from glm5_kernels.kpool_ref import hadamard_matrix
from glm5_kernels.pdl import pdl_enter, pdl_kwargs


# ---------------------------------------------------------------------------------------------- scores
@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, keys_ptr, kscale_ptr, bt_ptr, row_seq_ptr, nc_ptr, out_ptr,
                         softmax_scale, max_pools, MB, ppb,
                         stride_qn, stride_qh, stride_wn, stride_key, stride_bt, stride_on,
                         HI: tl.constexpr, HI_PAD: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
                         TILES: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    n = tl.program_id(0)
    chunk = tl.program_id(1)
    nc = tl.load(nc_ptr + n).to(tl.int32)
    bt_row = tl.load(row_seq_ptr + n).to(tl.int64)
    hh = tl.arange(0, HI_PAD)
    dd = tl.arange(0, D)
    hmask = hh < HI
    q = tl.load(q_ptr + n * stride_qn + hh[:, None] * stride_qh + dd[None, :], mask=hmask[:, None], other=0.0)
    if FP8:
        q = q.to(tl.bfloat16)                     # e4m3 → bf16 is exact; bf16 products are exact in fp32
    if UPCAST:
        q = q.to(tl.float32)                      # the interpreter's bf16 dot is wrong; fp32 holds bf16 exactly
    w = tl.load(w_ptr + n * stride_wn + hh, mask=hmask, other=0.0)
    for t in range(TILES):
        p0 = (chunk * TILES + t) * BLOCK_P
        offs = p0 + tl.arange(0, BLOCK_P)
        if p0 < nc:
            valid = offs < nc
            col = tl.minimum(offs // ppb, MB - 1)
            blk = tl.load(bt_ptr + bt_row * stride_bt + col, mask=valid, other=0).to(tl.int64)
            rows = blk * ppb + offs % ppb
            k = tl.load(keys_ptr + rows[:, None] * stride_key + dd[None, :], mask=valid[:, None], other=0.0)
            if FP8:
                k = k.to(tl.bfloat16)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE or UPCAST:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")          # [HI_PAD, BLOCK_P]
            else:
                s = tl.dot(q, tl.trans(k))
            if FP8:   # w already holds q_scale * softmax_scale; the key scale multiplies the head sum
                score = tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0)
                score = score * tl.load(kscale_ptr + rows, mask=valid, other=1.0)
            else:
                score = tl.sum(w[:, None] * tl.maximum(s * softmax_scale, 0.0), axis=0)
            score = tl.where(valid, score, float("-inf"))
        else:
            score = tl.full([BLOCK_P], float("-inf"), tl.float32)
        tl.store(out_ptr + n * stride_on + offs, score, mask=offs < max_pools)


def _fp8_query(q: torch.Tensor, head_w: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Query side of fp8 mode (as fp8_index_scores): rotated, per-head e4m3; scale folded into the weights.
    The rotation uses the cached device matrix (no host→device copy, so it can run inside a graph capture)."""
    h = hadamard_matrix(q.shape[-1], q.device)
    q8, qs = quantize_e4m3((q.float() @ h).to(torch.bfloat16))
    return q8, head_w.float() * qs.squeeze(-1) * softmax_scale


def indexer_scores(q: torch.Tensor, head_w: torch.Tensor, pool_keys: torch.Tensor, pool_scales: torch.Tensor | None,
                   block_tables: torch.Tensor, row_seq: torch.Tensor, n_complete: torch.Tensor, ppb: int,
                   softmax_scale: float, max_pools: int, block_p: int = 64) -> torch.Tensor:
    """Index scores ``[N, max_pools]`` fp32 of queries ``q [N, Hi, d]`` (model dtype) with head weights
    ``head_w [N, Hi]`` fp32 (already × Hi^-0.5) against the pools of block-table row ``row_seq[n]``
    (``block_tables [S, MB]`` int32, ``ppb`` pools per block); ``-inf`` at ``p >= n_complete[n]``.
    fp8 mode iff ``pool_scales`` is given (``pool_keys`` e4m3). Sync-free; the grid depends on shapes only.
    The first fp8 call on a device builds the Hadamard matrix there: make it before a CUDA-graph capture."""
    n, hi, d = q.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"index_head_dim={d} must be a power of two >= 16 for the Triton kernel; use indexer_scores_ref")
    fp8 = pool_scales is not None
    if fp8 != (pool_keys.dtype == torch.float8_e4m3fn) or pool_keys.shape[-1] != d or pool_keys.stride(-1) != 1:
        raise ValueError(f"pool_keys {pool_keys.dtype} {tuple(pool_keys.shape)} with pool_scales "
                         f"{'given' if fp8 else 'None'}: fp8 mode needs e4m3 keys and scales, exact mode neither; "
                         f"width must be {d}")
    if not fp8 and q.dtype != pool_keys.dtype:
        raise ValueError(f"q is {q.dtype} but pool_keys are {pool_keys.dtype}; cast q to the model dtype")
    if head_w.shape != (n, hi) or row_seq.shape != (n,) or n_complete.shape != (n,):
        raise ValueError(f"head_w {tuple(head_w.shape)}, row_seq {tuple(row_seq.shape)}, n_complete "
                         f"{tuple(n_complete.shape)} must be [{n}, {hi}], [{n}], [{n}]")
    out = torch.empty(n, max_pools, device=q.device, dtype=torch.float32)
    if n == 0 or max_pools == 0:
        return out
    if fp8:
        q, w = _fp8_query(q, head_w, softmax_scale)
    else:
        w = head_w.float()
    q, w = q.contiguous(), w.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    n_tiles = triton.cdiv(max_pools, block_p)
    # several tiles per program when there are many rows: the query is loaded once per program
    tiles = 1
    while tiles < 16 and tiles * 2 <= n_tiles and n * triton.cdiv(n_tiles, tiles * 2) >= 2048:
        tiles *= 2
    grid = (n, triton.cdiv(n_tiles, tiles))
    _index_scores_kernel[grid](
        q, w, pool_keys, pool_scales if fp8 else w, block_tables, row_seq, n_complete, out,
        softmax_scale, max_pools, block_tables.shape[1], ppb,
        q.stride(0), q.stride(1), w.stride(0), pool_keys.stride(0), block_tables.stride(0), out.stride(0),
        HI=hi, HI_PAD=max(16, triton.next_power_of_2(hi)), D=d, BLOCK_P=block_p, TILES=tiles, FP8=fp8,
        IEEE=q.dtype == torch.float32, UPCAST=interpreting(), num_warps=4, **pdl_kwargs(q.device))
    return out


# ---------------------------------------------------------------------------------------------- selection
@triton.jit
def _order_bits(s):
    """uint32-valued int64 keys with the order of the fp32 scores (-0.0 folded into +0.0: they tie)."""
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _select_slots_kernel(scores_ptr, nc_ptr, pos_ptr, bt_ptr, row_seq_ptr, out_ptr, cnt_ptr,
                         max_pools, n_select, width, MB, stride_sn, stride_bt, stride_on,
                         KPOOL: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, HAS_CNT: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """One program per row. Rows with more than ``n_select`` visible pools find the ``n_select``-th largest
    score key by a 4-pass 8-bit radix select over their own ``nc`` pools (the -inf padding past ``nc`` is
    never read, so the cost follows the context, not the block-table width), then take every pool above
    it and the lowest ids among its ties — the stable sort's set. A pass whose threshold bin is wanted whole
    ends the select there (the passes after it would only split keys that are all taken). A compaction pass
    writes the chosen pools' token slots in pool order, then the tail tokens and ``-1`` padding. A row that
    takes every pool (``nc <= n_select``: contexts up to ``n_select * KPOOL`` tokens) skips the compaction:
    its output is tokens ``0..pos`` in order, which the tail loop writes alone, without reading a score."""
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    nc = tl.minimum(tl.load(nc_ptr + n).to(tl.int32), max_pools)
    pos = tl.load(pos_ptr + n).to(tl.int32)
    bt_row = bt_ptr + tl.load(row_seq_ptr + n).to(tl.int64) * stride_bt
    row = scores_ptr + n * stride_sn
    out = out_ptr + n * stride_on
    take_all = nc <= n_select
    n_pre = tl.where(take_all, 0, nc)                # pools the compaction pass walks; the tail loop does the rest
    thr = tl.full([], 0, tl.int64)
    want = tl.full([], 0, tl.int32) + n_select      # how many of the keys equal to ``thr`` to take
    level = tl.full([], 0, tl.int64)                 # ``thr`` holds the key bits above ``level``
    done = take_all
    bins = tl.arange(0, 512)
    if not take_all:
        for r in tl.static_range(4):
            shift = 24 - 8 * r                       # r is a static_range constant, so is shift
            hist = tl.zeros([512], tl.int32)
            for c in range(0, tl.where(done, 0, nc), BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < nc
                u = _order_bits(tl.load(row + offs, mask=m, other=0.0))
                if r > 0:
                    m = m & ((u >> (shift + 8)) == (thr >> (shift + 8)))
                digit = ((u >> shift) & 255).to(tl.int32)
                hist += tl.histogram(tl.where(m, digit, 256 + digit), 512)   # bins >= 256: not matching
            hist = tl.where(bins < 256, hist, 0)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist          # keys with digit >= bin
            b = tl.sum((at_least >= want).to(tl.int32), 0) - 1              # at_least is non-increasing
            left = want - tl.sum(tl.where(bins > b, hist, 0), 0)
            thr = tl.where(done, thr, thr | (b.to(tl.int64) << shift))
            level = tl.where(done, level, shift)
            want = tl.where(done, want, left)
            # every key of bin b is wanted: the prefix decides, the lower digits' passes are skipped
            done = done | (tl.sum(tl.where(bins == b, hist, 0), 0) == left)
    kk = tl.arange(0, KPOOL)
    n_out = tl.full([], 0, tl.int32)
    n_eq = tl.full([], 0, tl.int32)
    for c in range(0, n_pre, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < n_pre
        u = _order_bits(tl.load(row + offs, mask=m, other=0.0)) >> level
        eq = (m & (u == (thr >> level))).to(tl.int32)
        above = (u > (thr >> level)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq + n_eq < want))
        si = (m & above).to(tl.int32)
        at = tl.cumsum(si, 0) - si + n_out                                   # output pool index
        tok = offs[:, None] * KPOOL + kk[None, :]
        # masks from comparisons: Triton 3.9's interpreter turns a bool block combined with a scalar bool
        # into int32 and then rejects it as a load mask
        sel = (si[:, None] != 0) & (kk[None, :] < KPOOL)
        blk = tl.load(bt_row + tl.minimum(tok // BS, MB - 1), mask=sel, other=0).to(tl.int64)
        tl.store(out + at[:, None] * KPOOL + kk[None, :], (blk * BS + tok % BS).to(tl.int32), mask=sel)
        n_out += tl.sum(si, 0)
        n_eq += tl.sum(eq, 0)
    first_tail = n_out * KPOOL                                               # n_select * KPOOL, or 0 (take-all)
    if HAS_CNT:
        tl.store(cnt_ptr + n, first_tail + pos + 1 - n_pre * KPOOL)
    for c in range(first_tail, width, BLOCK):
        col = c + tl.arange(0, BLOCK)
        tok = n_pre * KPOOL + (col - first_tail)
        is_tail = tok <= pos
        blk = tl.load(bt_row + tl.minimum(tok // BS, MB - 1), mask=is_tail & (col < width), other=0).to(tl.int64)
        tl.store(out + col, tl.where(is_tail, (blk * BS + tok % BS).to(tl.int32), -1), mask=col < width)


def select_token_slots(scores: torch.Tensor, n_complete: torch.Tensor, positions: torch.Tensor,
                              block_tables: torch.Tensor, row_seq: torch.Tensor, n_select: int, kpool: int,
                              block_size: int, block: int = 1024,
                              counts_out: torch.Tensor | None = None, num_warps: int = 4) -> torch.Tensor:
    """Latent rows each query attends to: ``[N, n_select*kpool + kpool - 1]`` int32, valid first, ``-1`` after.

    scores ``[N, P]`` from :func:`indexer_scores` (``-inf`` at ``p >= n_complete``), positions ``[N]``,
    ``n_complete[n] == (positions[n]+1) // kpool <= P``. Picks the top ``n_select`` pools by (score desc, pool
    id asc), expands them to their ``kpool`` tokens in pool order and appends the tail ``n_complete*kpool ..
    pos``; with ``n_complete <= n_select`` that is every token ``0..pos``. Equal to
    :func:`select_token_slots_ref` entry for entry. Sync-free, one program per row, whose work follows the
    row's visible pools: ``torch.topk`` over the block-table width took 87 µs per layer at batch 1, ctx 1K.
    ``counts_out [N]`` int32 (optional) receives each row's valid entries (:func:`count_selected`), which
    lets the attention kernel stop there. NaN scores (which a finite cache never produces) are not ordered
    as ``torch.sort`` orders them. ``block`` (a power of two): scores per loop step of the program;
    ``num_warps``: its warps."""
    n, max_pools = scores.shape
    width = n_select * kpool + kpool - 1
    if kpool & (kpool - 1) or block_size % kpool:
        raise ValueError(f"kpool={kpool} must be a power of two dividing block_size={block_size}")
    out = torch.empty(n, width, device=scores.device, dtype=torch.int32)
    if n == 0:
        return out
    if counts_out is not None and (counts_out.shape != (n,) or counts_out.stride(0) != 1):
        raise ValueError(f"counts_out must be a contiguous [{n}] int32 tensor, got {tuple(counts_out.shape)} "
                         f"with stride {counts_out.stride()}")
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    # the kernel reads the per-row vectors with stride 1 (no copy when they already are, as in decode)
    n_complete, positions, row_seq = (t.contiguous() for t in (n_complete, positions, row_seq))
    _select_slots_kernel[(n,)](
        scores, n_complete, positions, block_tables, row_seq, out, counts_out if counts_out is not None else out,
        max_pools, n_select, width,
        block_tables.shape[1], scores.stride(0), block_tables.stride(0), out.stride(0),
        KPOOL=kpool, BS=block_size, BLOCK=block, HAS_CNT=counts_out is not None, num_warps=num_warps,
        **pdl_kwargs(scores.device))
    return out


# ---------------------------------------------------------------------------------------------- timing
def bench_indexer(n: int = 64, pools: int = 8192, heads: int = 32, d: int = 128, n_select: int = 512,
                  kpool: int = 4, block_size: int = 64, fp8: bool = False, iters: int = 50) -> dict[str, float]:
    """CUDA timing (µs per call) of indexer_scores and select_token_slots at one decode shape (all rows
    see ``pools`` complete pools). For benchmarks; needs a GPU."""
    dev = torch.device("cuda")
    ppb = block_size // kpool
    mb = triton.cdiv(pools, ppb)
    num_blocks = mb * 2
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(n, heads, d, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(n, heads, generator=g) * heads ** -0.5).to(dev)
    keys = torch.randn(num_blocks * ppb, d, generator=g).to(dev, torch.bfloat16)
    scales = None
    if fp8:
        from glm5_kernels.fp8_index_ref import encode_keys
        keys, scales = encode_keys(keys)
    bt = torch.stack([torch.randperm(num_blocks, generator=g)[:mb] for _ in range(n)]).to(dev, torch.int32)
    row_seq = torch.arange(n, device=dev, dtype=torch.int32)
    positions = torch.full((n,), pools * kpool + kpool - 2, device=dev, dtype=torch.int64)
    nc = torch.div(positions + 1, kpool, rounding_mode="floor")
    max_pools = mb * ppb

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / iters

    scores = indexer_scores(q, w, keys, scales, bt, row_seq, nc, ppb, d ** -0.5, max_pools)
    return {
        "indexer_scores_us": timed(lambda: indexer_scores(q, w, keys, scales, bt, row_seq, nc, ppb, d ** -0.5,
                                                          max_pools)),
        "select_token_slots_us": timed(lambda: select_token_slots(scores, nc, positions, bt, row_seq, n_select,
                                                                  kpool, block_size)),
        "key_bytes_per_call": float(n * pools * d * (1 if fp8 else 2)),
    }


__all__ = ["indexer_scores", "select_token_slots", "bench_indexer"]
