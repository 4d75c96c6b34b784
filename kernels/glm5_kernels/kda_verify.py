"""KDA recurrences over a state-slot pool: the batched decode step (outputs, state updated in place), and a
speculative step's verify (outputs, state untouched) and commit (state after the accepted rows), with their
torch references in :mod:`glm5_kernels.kda_verify_ref`.

One program per (request, head, block of value channels) keeps its ``[d_k, BV]`` fp32 slice of the state in
registers while it walks the request's rows, so the state is read once per call whatever ``T`` is. A decode
step is bound by the state's bytes (each request reads and writes ``heads × d × d`` fp32 per layer: 4 MiB at
the real shape), so its value block and warp count come from a measured table (:data:`DECODE_TILES`). The
l2 norms of q and k, the bounded (or softplus) forget gate and the β sigmoid are computed in the kernel from
the layer's raw tensors, as fla's decode kernel does (no fp32 intermediates in memory, a few launches fewer
per layer). Every launch is sync-free and CUDA-graph capturable: slots and accepted lengths are device tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from glm5_kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _kda_spec_kernel(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_ptr, state_ptr, slot_ptr, nvalid_ptr, o_ptr,
                     T, lower_bound, scale,
                     stride_qn, stride_qt, stride_fn, stride_ft, stride_bn, stride_bt, stride_on, stride_ot,
                     stride_ss,
                     H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, BOUNDED: tl.constexpr,
                     WRITE_OUT: tl.constexpr, ROWS_FROM_N_VALID: tl.constexpr, STORE_STATE: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """Rows ``0 .. T-1`` of request ``n`` (``ROWS_FROM_N_VALID``: only the first ``n_valid[n]``) through the
    recurrence from ``state[slots[n]]``; ``WRITE_OUT`` stores each row's output (in ``o``'s dtype),
    ``STORE_STATE`` writes the final state back to the slot. Decode = out + store, verify = out, commit =
    n_valid rows + store."""
    pdl_enter(USE_PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    s_off = slot * stride_ss + h * D * D + dk[:, None] * D + dv[None, :]
    state = tl.load(state_ptr + s_off)                                   # [D, BV] fp32
    rows = T
    if ROWS_FROM_N_VALID:
        rows = tl.minimum(tl.load(nvalid_ptr + n), T)
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_ptr + h * D + dk).to(tl.float32)
    for t in range(0, rows):
        qk_off = n * stride_qn + t * stride_qt + h * D
        q = tl.load(q_ptr + qk_off + dk).to(tl.float32)
        kk = tl.load(k_ptr + qk_off + dk).to(tl.float32)
        v = tl.load(v_ptr + qk_off + dv).to(tl.float32)
        f = tl.load(f_ptr + n * stride_fn + t * stride_ft + h * D + dk).to(tl.float32) + dt
        beta = tl.sigmoid(tl.load(b_ptr + n * stride_bn + t * stride_bt + h).to(tl.float32))
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        kk = kk / tl.sqrt(tl.sum(kk * kk, 0) + 1e-6)
        if BOUNDED:
            g = lower_bound * tl.sigmoid(rate * f)
        else:
            g = -rate * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(f)))
        state = state * tl.exp(g)[:, None]
        kv = tl.sum(state * kk[:, None], 0)                               # [BV]
        delta = (v - kv) * beta
        state = state + kk[:, None] * delta[None, :]
        if WRITE_OUT:
            o = tl.sum(state * q[:, None], 0)
            tl.store(o_ptr + n * stride_on + t * stride_ot + h * D + dv, o.to(o_ptr.dtype.element_ty))
    if STORE_STATE:
        tl.store(state_ptr + s_off, state)


#: Decode tiles ``(max rows, BV, num_warps)``: the first entry whose row bound covers the batch wins. Measured
#: with ``bench/kernel_bench.py --kda`` (H = 64, d = 128, CUDA-graph replay) on the H200 at 2026-12-04 02:08 UTC
#: (bench/results/kda_decode_h200.json): at n = 64 / 256 the 64-column block with 4 warps moves the states at
#: 86 / 89 % of the copy bandwidth (146 / 565 µs; fla's 32-column tile 174 / 837 µs); at n = 1 / 8 the step is
#: latency-bound and 32 columns with 2 warps is the fastest (8.8 / 24.8 µs; fla 9.5 / 29.4).
DECODE_TILES: tuple[tuple[int, int, int], ...] = ((8, 32, 2), (1 << 62, 64, 4))


def _tile(bv: int, warps: int, d: int) -> tuple[int, int]:
    """``(BV, num_warps)`` for head dim ``d``: a block never wider than the head, one warp below 64 channels."""
    return min(bv, d), (warps if d >= 64 else 1)


def decode_tile(n: int, d: int) -> tuple[int, int]:
    """``(BV, num_warps)`` of a decode step over ``n`` rows with head dim ``d`` (:data:`DECODE_TILES`; its last
    row bound covers every batch)."""
    return next(_tile(bv, warps, d) for rows, bv, warps in DECODE_TILES if n <= rows)


def _launch(q, k, v, f, b, state_pool, slots, n_valid, a_log, dt_bias, lower_bound, scale, out, commit, store,
            tile: tuple[int, int] | None = None):
    n, t, h, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"KDA head_dim {d}: the recurrence kernel takes a power of two >= 16")
    if state_pool.dtype != torch.float32 or tuple(state_pool.shape[1:]) != (h, d, d) or not state_pool.is_contiguous():
        raise ValueError(f"state pool {state_pool.dtype} {tuple(state_pool.shape)}: expected contiguous fp32 "
                         f"[slots, {h}, {d}, {d}]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1 or x.stride(-2) != d or x.stride() != q.stride():
            raise ValueError(f"{name} strides {x.stride()}: q, k and v must share [N, T, H, d] strides with "
                             "contiguous heads")
    if f.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("f and b need a contiguous last dim")
    bv, warps = tile if tile is not None else _tile(32, 4, d)
    if d % bv:
        raise ValueError(f"value block {bv} does not divide head_dim {d}")
    _kda_spec_kernel[(n, h, d // bv)](
        q, k, v, f, b, a_log.float().reshape(-1).contiguous(), dt_bias.float().reshape(-1).contiguous(), state_pool,
        slots.contiguous(), n_valid if n_valid is not None else slots, out if out is not None else q,
        t, float(lower_bound if lower_bound is not None else 0.0), float(scale),
        q.stride(0), q.stride(1), f.stride(0), f.stride(1), b.stride(0), b.stride(1),
        out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0, state_pool.stride(0),
        H=h, D=d, BV=bv, BOUNDED=lower_bound is not None, WRITE_OUT=out is not None, ROWS_FROM_N_VALID=commit,
        STORE_STATE=store, num_warps=warps, **pdl_kwargs(q.device))


def kda_decode_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          state_pool: torch.Tensor, slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          lower_bound: float | None, scale: float, tile: tuple[int, int] | None = None
                          ) -> torch.Tensor:
    """Triton version of :func:`~glm5_kernels.kda_verify_ref.kda_decode_recurrence_ref`: one token per request
    (``q, k, v [N, H, d]``, ``f [N, H·d]``, ``b [N, H]``), ``state_pool[slots]`` updated in place; the output
    ``[N, H, d]`` in ``q``'s dtype. ``tile`` = ``(BV, num_warps)`` overrides :func:`decode_tile` (tuning)."""
    n, h, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _launch(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), f.unsqueeze(1), b.unsqueeze(1), state_pool, slots,
            None, a_log, dt_bias, lower_bound, scale, out.unsqueeze(1), commit=False, store=True,
            tile=tile or decode_tile(n, d))
    return out


def kda_verify_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          state_pool: torch.Tensor, slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          lower_bound: float | None, scale: float) -> torch.Tensor:
    """Triton version of :func:`~glm5_kernels.kda_verify_ref.kda_verify_recurrence_ref` (same arguments;
    ``[N, T, H, d]`` fp32, the pool is not written)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _launch(q, k, v, f, b, state_pool, slots, None, a_log, dt_bias, lower_bound, scale, out, commit=False,
            store=False)
    return out


def kda_commit_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          state_pool: torch.Tensor, slots: torch.Tensor, n_valid: torch.Tensor, a_log: torch.Tensor,
                          dt_bias: torch.Tensor, lower_bound: float | None, scale: float) -> None:
    """Triton version of :func:`~glm5_kernels.kda_verify_ref.kda_commit_recurrence_ref` (in place)."""
    _launch(q, k, v, f, b, state_pool, slots, n_valid.to(torch.int32).contiguous(), a_log, dt_bias, lower_bound,
            scale, None, commit=True, store=True)


def verify_state_bytes(n: int, heads: int, d: int) -> int:
    """State bytes the verify + commit pair moves: two reads and one write of each request's fp32 state."""
    return 3 * n * heads * d * d * 4


def decode_state_bytes(n: int, heads: int, d: int) -> int:
    """State bytes a decode step moves: one read and one write of each request's fp32 state."""
    return 2 * n * heads * d * d * 4


__all__ = ["DECODE_TILES", "decode_state_bytes", "decode_tile", "kda_commit_recurrence", "kda_decode_recurrence",
           "kda_verify_recurrence", "verify_state_bytes"]
