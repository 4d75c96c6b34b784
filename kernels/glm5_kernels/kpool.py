"""Writing pooled index keys of the kpool indexer (decode append and prefill compress), with torch references.

A pool is ``kpool`` consecutive tokens; its key is the per-channel softmax(gate + ape)-weighted sum of the
members' index keys (:func:`glm5_kernels.kpool_ref.pool_members_ref`), stored once in ``pool_keys`` in the model
dtype (exact mode) or Hadamard-rotated e4m3 with a power-of-two scale (fp8 mode,
:func:`glm5_kernels.fp8_index_ref.encode_keys`). Layouts are those of :class:`glm5.cache.hybrid_cache.HybridCache`:
``tail [num_slots, kpool, 2d]`` holds the raw ``key | gate`` rows of each request's pool in progress, and pool
``p`` of a request with block-table row ``bt`` lives at row ``bt[p*kpool // bs] * (bs/kpool) + (p*kpool % bs)/kpool``.

Bit-exactness with the torch path (bf16): the kernels round exactly where torch does — probabilities to the
key dtype, each product ``prob*key`` to the key dtype, the member sum accumulated in fp32 in member order and
rounded once (what CPU and CUDA torch do for ``(probs * k).sum(dim=1)``) — with explicit round-to-nearest-even
bit arithmetic, because the Triton interpreter's own fp32→bf16/e4m3 casts truncate or mis-round. On CUDA the
exponentials, logarithms and divisions are the correctly rounded libdevice / ``div_rn`` ones that torch's CUDA
softmax and log2 use; the interpreter falls back to numpy's, which can differ from torch CPU's in the last fp32
bit, so CPU comparisons can differ by one bf16 ulp in rare channels. The fp8 Hadamard rotation is a 128-term
fp32 sum whose order differs from the BLAS matmul of the reference: a rotated value can land one bf16 ulp
apart when it sits on a rounding boundary (rarely changes an e4m3 byte).

Decode (:func:`kpool_decode_append`) is sync-free and CUDA-graph capturable. Rows of one request sharing a step
(speculative verification) must be consecutive and in position order, as the engine packs them: a row that
completes a pool takes the members that are in the batch from ``raw`` and the rest from the tail, and the tail
is written by a second launch after every pool is read, so no program reads a tail row another overwrites.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from glm5_kernels.device import interpreting
from glm5_kernels.fp8_index_ref import E4M3_MAX, MIN_ABSMAX
from glm5_kernels.kpool_ref import hadamard_matrix
from glm5_kernels.pdl import pdl_enter, pdl_kwargs

_E4M3 = tl.constexpr(E4M3_MAX)
_MIN_ABSMAX = tl.constexpr(MIN_ABSMAX)


# ---------------------------------------------------------------------------------------------- Triton helpers
@triton.jit
def _rne_bf16(x):
    """fp32 → nearest bf16 value (ties to even), returned as fp32; exact bit arithmetic on every backend."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rne_e4m3(x):
    """fp32 in [-448, 448] → nearest e4m3fn value (ties to even, subnormals included), returned as fp32."""
    b = x.to(tl.int32, bitcast=True)
    sign = b & -2147483648
    mag = b & 0x7FFFFFFF
    qe = tl.maximum((mag >> 23) - 127, -6) - 3                        # exponent of the e4m3 quantum
    inv_quantum = ((127 - qe) << 23).to(tl.float32, bitcast=True)
    quantum = ((qe + 127) << 23).to(tl.float32, bitcast=True)
    steps = (mag.to(tl.float32, bitcast=True) * inv_quantum + 12582912.0) - 12582912.0  # rint, ties to even
    return ((steps * quantum).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _row(tile, jj, j: tl.constexpr):
    """Row ``j`` of a ``[KP, D]`` tile, exactly (the other rows contribute +0)."""
    return tl.sum(tl.where(jj == j, tile, 0.0), axis=0)


@triton.jit
def _pool_tile(k, g, ape, KP: tl.constexpr, BF16: tl.constexpr, PRECISE: tl.constexpr):
    """k, g ``[KP, D]`` fp32 (values of the key dtype), ape ``[KP, D]`` → pooled ``[D]`` fp32, rounded as torch."""
    x = g + ape
    m = tl.max(x, axis=0)
    if PRECISE:
        e = libdevice.exp(x - m[None, :])
    else:
        e = tl.exp(x - m[None, :])
    jj = tl.arange(0, KP)[:, None]
    s = _row(e, jj, 0)
    for j in tl.static_range(1, KP):
        s = s + _row(e, jj, j)
    p = tl.div_rn(e, s[None, :])
    if BF16:
        p = _rne_bf16(p)
    prod = p * k
    if BF16:
        prod = _rne_bf16(prod)
    acc = _row(prod, jj, 0)
    for j in tl.static_range(1, KP):
        acc = acc + _row(prod, jj, j)
    if BF16:
        acc = _rne_bf16(acc)
    return acc


@triton.jit
def _store_pool_row(pooled, row, keys_ptr, scales_ptr, had_ptr, stride_key, D: tl.constexpr,
                    FP8: tl.constexpr, PRECISE: tl.constexpr):
    """Store one pooled key (exact: cast; fp8: encode_keys — bf16, Hadamard, bf16, e4m3 with 2^k scale)."""
    offs = tl.arange(0, D)
    if FP8:
        xb = _rne_bf16(pooled)
        h = tl.load(had_ptr + offs[:, None] * D + offs[None, :])
        rot = _rne_bf16(tl.sum(xb[:, None] * h, axis=0))
        absmax = tl.maximum(tl.max(tl.abs(rot), axis=0), _MIN_ABSMAX)
        y = tl.div_rn(absmax, _E4M3)
        if PRECISE:
            lg = libdevice.log2(y)
        else:
            lg = tl.log2(y)
        e = tl.math.ceil(lg).to(tl.int32)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
        v = _rne_e4m3(tl.minimum(tl.maximum(rot * inv_scale, -_E4M3), _E4M3))
        tl.store(keys_ptr + row * stride_key + offs, v.to(tl.float8e4nv))
        tl.store(scales_ptr + row, scale)
    else:
        tl.store(keys_ptr + row * stride_key + offs, pooled.to(keys_ptr.dtype.element_ty))


@triton.jit
def _append_pool_kernel(raw_ptr, pos_ptr, slot_ptr, bt_ptr, tail_ptr, ape_ptr, keys_ptr, scales_ptr, had_ptr,
                        N, stride_raw, stride_bt, stride_ts, stride_tj, stride_key, block_size, ppb,
                        KP: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr, FP8: tl.constexpr,
                        PRECISE: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    i = tl.program_id(0)
    pos = tl.load(pos_ptr + i)
    if (pos + 1) % KP == 0:
        slot = tl.load(slot_ptr + i)
        jj = tl.arange(0, KP)
        dd = tl.arange(0, D)
        r = i - (KP - 1) + jj                    # batch row that would hold member j (same request, in order)
        in_range = (r >= 0) & (r < N)
        rpos = tl.load(pos_ptr + r, mask=in_range, other=-1)
        rslot = tl.load(slot_ptr + r, mask=in_range, other=-1)
        in_batch = (in_range & (rpos == pos - (KP - 1) + jj) & (rslot == slot))[:, None]
        raw_off = r.to(tl.int64)[:, None] * stride_raw + dd[None, :]
        tail_off = slot * stride_ts + jj[:, None] * stride_tj + dd[None, :]
        k = tl.where(in_batch, tl.load(raw_ptr + raw_off, mask=in_batch, other=0.0),
                     tl.load(tail_ptr + tail_off, mask=~in_batch, other=0.0)).to(tl.float32)
        g = tl.where(in_batch, tl.load(raw_ptr + raw_off + D, mask=in_batch, other=0.0),
                     tl.load(tail_ptr + tail_off + D, mask=~in_batch, other=0.0)).to(tl.float32)
        ape = tl.load(ape_ptr + jj[:, None] * D + dd[None, :])
        pooled = _pool_tile(k, g, ape, KP, BF16, PRECISE)
        first = (pos // KP) * KP
        blk = tl.load(bt_ptr + i * stride_bt + first // block_size).to(tl.int64)
        row = blk * ppb + (first % block_size) // KP
        _store_pool_row(pooled, row, keys_ptr, scales_ptr, had_ptr, stride_key, D, FP8, PRECISE)


@triton.jit
def _append_tail_kernel(raw_ptr, pos_ptr, slot_ptr, tail_ptr, N, stride_raw, stride_ts, stride_tj,
                        KP: tl.constexpr, D2: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    i = tl.program_id(0)
    pos = tl.load(pos_ptr + i)
    slot = tl.load(slot_ptr + i)
    nxt = i + KP                                  # a later row of this request at pos + KP owns the tail row
    has_next = nxt < N
    npos = tl.load(pos_ptr + nxt, mask=has_next, other=-1)
    nslot = tl.load(slot_ptr + nxt, mask=has_next, other=-1)
    if (npos != pos + KP) | (nslot != slot):
        offs = tl.arange(0, D2)
        v = tl.load(raw_ptr + i * stride_raw + offs)
        tl.store(tail_ptr + slot * stride_ts + (pos % KP) * stride_tj + offs, v)


@triton.jit
def _compress_kernel(mem_ptr, ape_ptr, rows_ptr, keys_ptr, scales_ptr, had_ptr, stride_mp, stride_mj, stride_key,
                     KP: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr, FP8: tl.constexpr,
                     PRECISE: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    jj = tl.arange(0, KP)
    dd = tl.arange(0, D)
    off = p.to(tl.int64) * stride_mp + jj[:, None] * stride_mj + dd[None, :]
    k = tl.load(mem_ptr + off).to(tl.float32)
    g = tl.load(mem_ptr + off + D).to(tl.float32)
    ape = tl.load(ape_ptr + jj[:, None] * D + dd[None, :])
    pooled = _pool_tile(k, g, ape, KP, BF16, PRECISE)
    row = tl.load(rows_ptr + p).to(tl.int64)
    _store_pool_row(pooled, row, keys_ptr, scales_ptr, had_ptr, stride_key, D, FP8, PRECISE)


# ---------------------------------------------------------------------------------------------- launchers
def _check_pool_args(key_dtype: torch.dtype, kpool: int, d: int, ape: torch.Tensor, pool_keys: torch.Tensor,
                     pool_scales: torch.Tensor | None) -> bool:
    """Validate shapes/dtypes shared by both writers; returns whether fp8 mode is on."""
    if key_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"index keys are {key_dtype}; the kernels support bfloat16 and float32 (the model dtypes)")
    if kpool < 1 or kpool & (kpool - 1) or d < 16 or d & (d - 1):
        raise ValueError(f"kpool={kpool} and index_head_dim={d} must be powers of two (d >= 16) for the Triton "
                         "kernels; use the *_ref functions otherwise")
    if tuple(ape.shape) != (kpool, d) or ape.dtype != torch.float32:
        raise ValueError(f"ape must be fp32 [{kpool}, {d}] (pass KPoolIndexer.ape), got {ape.dtype} {tuple(ape.shape)}")
    fp8 = pool_scales is not None
    want = torch.float8_e4m3fn if fp8 else key_dtype
    if pool_keys.dtype != want or pool_keys.shape[-1] != d or pool_keys.stride(-1) != 1:
        raise ValueError(f"pool_keys is {pool_keys.dtype} {tuple(pool_keys.shape)}; expected {want} [rows, {d}] "
                         f"(fp8 mode iff pool_scales is given)")
    if fp8 and (pool_scales.dtype != torch.float32 or not pool_scales.is_contiguous()):
        raise ValueError(f"pool_scales must be contiguous fp32 [rows, 1], got {pool_scales.dtype}")
    return fp8


def kpool_compress_write(members: torch.Tensor, ape: torch.Tensor, out_rows: torch.Tensor,
                         pool_keys: torch.Tensor, pool_scales: torch.Tensor | None) -> None:
    """Pool ``members [P, kpool, 2d]`` (key | gate, model dtype) into ``pool_keys[out_rows]`` (prefill: many
    pools completed at once). fp8 mode iff ``pool_scales`` is given. One program per pool, in place."""
    p, kpool, d2 = members.shape
    d = d2 // 2
    fp8 = _check_pool_args(members.dtype, kpool, d, ape, pool_keys, pool_scales)
    if out_rows.shape != (p,):
        raise ValueError(f"out_rows has shape {tuple(out_rows.shape)}; expected [{p}] (one pool row per pool)")
    if p == 0:
        return
    if members.stride(-1) != 1:
        members = members.contiguous()
    had = hadamard_matrix(d, members.device) if fp8 else ape
    _compress_kernel[(p,)](members, ape.contiguous(), out_rows, pool_keys, pool_scales if fp8 else ape, had,
                           members.stride(0), members.stride(1), pool_keys.stride(0),
                           KP=kpool, D=d, BF16=members.dtype == torch.bfloat16, FP8=fp8, PRECISE=not interpreting(),
                           num_warps=8 if fp8 and d >= 128 else 4, **pdl_kwargs(members.device))


def kpool_decode_append(raw: torch.Tensor, positions: torch.Tensor, state_slots: torch.Tensor,
                        block_tables: torch.Tensor, tail: torch.Tensor, ape: torch.Tensor,
                        pool_keys: torch.Tensor, pool_scales: torch.Tensor | None, kpool: int,
                        block_size: int) -> None:
    """Decode-time tail append and pool completion, in place, sync-free (CUDA-graph capturable).

    raw ``[N, 2d]`` (key | gate of each row's token, model dtype), positions ``[N]`` int64, state_slots ``[N]``
    int64 (tail slot per row), block_tables ``[N, MB]`` int32 (row i's request), tail ``[slots, kpool, 2d]``.
    Per row: ``tail[slot, pos % kpool] = raw``; when ``(pos+1) % kpool == 0`` pool ``pos // kpool`` is pooled
    and written (exact or fp8). Two launches of one program per row: pools first (reading the tail as it was
    before this step), then the tail rows."""
    n, d2 = raw.shape
    d = d2 // 2
    fp8 = _check_pool_args(raw.dtype, kpool, d, ape, pool_keys, pool_scales)
    if tail.dtype != raw.dtype or tuple(tail.shape[1:]) != (kpool, d2) or tail.stride(-1) != 1:
        raise ValueError(f"tail is {tail.dtype} {tuple(tail.shape)}; expected {raw.dtype} [slots, {kpool}, {d2}]")
    if block_size % kpool:
        raise ValueError(f"block_size={block_size} must be a multiple of kpool={kpool}")
    if positions.shape != (n,) or state_slots.shape != (n,) or block_tables.shape[0] != n:
        raise ValueError(f"positions {tuple(positions.shape)}, state_slots {tuple(state_slots.shape)} and "
                         f"block_tables {tuple(block_tables.shape)} must all have {n} rows (one per raw row)")
    if n == 0:
        return
    raw = raw if raw.stride(-1) == 1 else raw.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    had = hadamard_matrix(d, raw.device) if fp8 else ape
    _append_pool_kernel[(n,)](raw, positions, state_slots, block_tables, tail, ape.contiguous(), pool_keys,
                              pool_scales if fp8 else ape, had, n, raw.stride(0), block_tables.stride(0),
                              tail.stride(0), tail.stride(1), pool_keys.stride(0), block_size, block_size // kpool,
                              KP=kpool, D=d, BF16=raw.dtype == torch.bfloat16, FP8=fp8, PRECISE=not interpreting(),
                              num_warps=8 if fp8 and d >= 128 else 4, **pdl_kwargs(raw.device))
    _append_tail_kernel[(n,)](raw, positions, state_slots, tail, n, raw.stride(0), tail.stride(0), tail.stride(1),
                              KP=kpool, D2=d2, num_warps=1 if d2 <= 128 else 2, **pdl_kwargs(raw.device))


__all__ = ["kpool_decode_append", "kpool_compress_write", "interpreting"]
