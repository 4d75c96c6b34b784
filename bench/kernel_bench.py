"""Micro-benchmark of the Triton kernels against their torch references and the copy roofline.

Usage (CUDA GPU): ``python bench/kernel_bench.py OUT.json``: sparse NoPE MLA decode (64 heads, 512 latent, 2051 selected
rows from a 4M-row cache) at several batch sizes; achieved bytes/s vs the measured copy bandwidth.

``python bench/kernel_bench.py --router OUT.json``: the MoE router (288 experts x 4096, top 8) at 1-4096 tokens
with each epilogue variant (fused into the GEMM's last program, or a separate select launch) and GEMM tiling,
from CUDA graphs.

``python bench/kernel_bench.py --small OUT.json``: the latency-bound decode kernels at the bench shapes,
each replayed from a CUDA graph: the index selection (radix select vs a plain ``torch.topk``) at
context 1K/8K/32K over the 32K-wide block table, sparse MLA with and without valid counts and several
split/tile choices, and the mHC projection's split-K choices: the data for choosing those defaults.

``python bench/kernel_bench.py --kda OUT.json``: the KDA decode recurrence (64 heads x 128, fp32 states in a slot
pool, bf16 activations) at batch 1-256, fla's ``fused_recurrent_kda_fwd`` against
:func:`glm5_kernels.kda_verify.kda_decode_recurrence` at each (value block, warps) tile, from CUDA graphs: the
state bytes per second against the copy bandwidth, the data behind ``kda_verify.DECODE_TILES``.

``python bench/kernel_bench.py --mhc OUT.json [--no-tiles]``: one mHC site (n = 4, H = 4096, bf16): mHC pre at
512-8192 rows with the tf32x3 and the bf16x3 projection; then (unless ``--no-tiles``) at a prefill chunk's 4096
rows and at 64 rows, the projection's tiles (rows and K per program, split, warps, stages), the row kernel's warps
and the post kernel's column block and warps, from CUDA graphs, with the bytes each kernel must move.

``python bench/kernel_bench.py --select OUT.json``: the index selection (one program per row) at 1-256 rows and
context 1K-32K, its loop step (scores per step) and warps against the default's, outputs compared.

``python bench/kernel_bench.py --mhc-decode OUT.json``: mHC pre at 1-8 rows, the tf32x3 projection against the FMA
one (``mhc_pre(proj_fma=True)``) at several tiles, and the row kernel's warps; 16 sites per CUDA graph.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import triton.testing

from glm5_kernels.sparse_mla_decode import decode_bytes, decode_flops, sparse_mla_decode

from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref


def _run_info() -> dict:
    """What the result was measured on and with which command (kept in every output JSON)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}


def copy_bw() -> float:
    """Bytes per second (read + write) of a 1 GiB device copy, the roofline's bandwidth."""
    n_bytes = 1 << 30
    a = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    return 2 * n_bytes / (triton.testing.do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3)


def main(out: str) -> None:
    bw = copy_bw()
    rows = []
    slots, h, r, k = 1 << 22, 64, 512, 2051
    lat = torch.randn(slots, r, device="cuda", dtype=torch.bfloat16)
    for n in (1, 8, 64, 256):
        q = torch.randn(n, h, r, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, slots, (n, k), device="cuda", dtype=torch.int32)
        t_k = triton.testing.do_bench(lambda: sparse_mla_decode(q, lat, idx, 256 ** -0.5), return_mode="median")
        t_r = triton.testing.do_bench(lambda: sparse_mla_decode_ref(q, lat, idx, 256 ** -0.5), return_mode="median")
        by = decode_bytes(n, k, r, h, 2)
        rows.append({"kernel": "sparse_mla_decode", "n": n, "k": k, "triton_ms": t_k, "torch_ref_ms": t_r,
                     "GBps": by / t_k / 1e6, "frac_copy_bw": by / (t_k * 1e-3) / bw,
                     "TFLOPs": decode_flops(n, k, r, h) / t_k / 1e9})
        print(json.dumps(rows[-1]))
    with open(out, "w") as f:
        json.dump({**_run_info(), "copy_bw_Bps": bw, "rows": rows}, f, indent=1)


def graph_us(fn, reps: int = 200) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph (launch overhead excluded, as in a decode step)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, rep=reps, return_mode="median") * 1000.0


#: The index selection's bench shape: kpool, block size, pools selected, blocks per table (514 x 64 = the 32K table)
SELECT_SHAPE = (4, 64, 512, 514)


def _select_inputs(n: int, ctx: int):
    """Decode rows at position ``ctx`` for the selection: ``(scores, n_complete, positions, block_tables, row_seq,
    counts_out)``, scores random over the visible pools and ``-inf`` past them."""
    kp, bs, _, mb = SELECT_SHAPE
    max_pools = mb * bs // kp
    pos = torch.full((n,), ctx, device="cuda", dtype=torch.int64)
    nc = torch.div(pos + 1, kp, rounding_mode="floor")
    scores = torch.randn(n, max_pools, device="cuda").masked_fill(
        torch.arange(max_pools, device="cuda")[None, :] >= nc[:, None], float("-inf"))
    bt = torch.randperm(n * mb, device="cuda").view(n, mb).int()
    rs = torch.arange(n, device="cuda", dtype=torch.int32)
    return scores, nc, pos, bt, rs, torch.empty(n, device="cuda", dtype=torch.int32)


def small(out: str) -> None:
    from glm5_kernels.indexer import select_token_slots
    from glm5_kernels.mhc import mhc_pre

    rows = []

    def log(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    kp, bs, n_select, _ = SELECT_SHAPE
    for n in (1, 8, 64, 256):
        for ctx in (1024, 8192, 32768):
            scores, nc, pos, bt, rs, cnt = _select_inputs(n, ctx)
            max_pools = scores.shape[1]
            bits = scores.view(torch.int32)
            key = (torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long() << 32) | torch.arange(max_pools, device="cuda")
            log({"kernel": "select", "n": n, "ctx": ctx,
                 "radix_us": graph_us(lambda: select_token_slots(scores, nc, pos, bt, rs, n_select, kp, bs,
                                                                 counts_out=cnt)),
                 "topk_only_us": graph_us(lambda: torch.topk(key, n_select, dim=1))})
    h, r = 64, 512
    lat = torch.randn(1 << 21, r, device="cuda", dtype=torch.bfloat16)
    for n in (1, 8, 64):
        q = torch.randn(n, h, r, device="cuda", dtype=torch.bfloat16)
        for valid in (1025, 2051):
            idx = torch.randint(0, lat.shape[0], (n, 2051), device="cuda", dtype=torch.int32)
            idx[:, valid:] = -1
            cnt = torch.full((n,), valid, device="cuda", dtype=torch.int32)
            row = {"kernel": "sparse_mla", "n": n, "valid": valid,
                   "default_us": graph_us(lambda: sparse_mla_decode(q, lat, idx, 0.0625)),
                   "counts_us": graph_us(lambda: sparse_mla_decode(q, lat, idx, 0.0625, counts=cnt))}
            for sp in (1, 2, 8, 16, 33):
                for bh, bk in ((64, 64), (64, 32), (32, 64), (16, 32)):
                    try:
                        row[f"s{sp}_h{bh}_k{bk}_us"] = graph_us(lambda: sparse_mla_decode(
                            q, lat, idx, 0.0625, splits=sp, block_h=bh, block_k=bk, counts=cnt))
                    except Exception as e:  # out of shared memory / registers for that tile
                        row[f"s{sp}_h{bh}_k{bk}_us"] = f"{type(e).__name__}"
            log(row)
    n_hc, hid = 4, 4096
    fn = torch.randn(n_hc * (n_hc + 2), n_hc * hid, device="cuda") * 0.02
    base, scale = torch.randn(n_hc * (n_hc + 2), device="cuda"), torch.rand(3, device="cuda")
    w = torch.ones(hid, device="cuda", dtype=torch.bfloat16)
    for t in (1, 8, 64, 256):
        streams = torch.randn(t, n_hc, hid, device="cuda", dtype=torch.bfloat16)
        row = {"kernel": "mhc_pre", "T": t}
        for splits in (None, 32, 64, 128, 256):
            for bk in (32, 64, 128):
                row[f"s{splits}_k{bk}_us"] = graph_us(lambda: mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20,
                                                                      w, 1e-5, splits=splits, block_k=bk))
        log(row)
    with open(out, "w") as f:
        json.dump({**_run_info(), "rows": rows}, f, indent=1)


#: Router configurations timed by ``--router`` (keys of ``router.default_config``): the fused epilogue (the GEMM's
#: last program per token block, EPI_T rows at a time) against the separate select launch (EPI_T rows per
#: program on epi_warps warps), then GEMM tilings under the separate launch.
ROUTER_CONFIGS = [{"fused": True, "EPI_T": et} for et in (4, 8)] + [
    {"fused": False, "EPI_T": et, "epi_warps": w} for et, w in ((1, 1), (1, 2), (2, 2), (4, 4))] + [
    {"fused": False, "EPI_T": 1, "epi_warps": 1, "BLOCK_T": bt, "BLOCK_E": be, "SPLITS": sp, "num_warps": nw}
    for bt, be, sp, nw in ((16, 32, 8, 4), (16, 32, 4, 4), (32, 32, 4, 4), (32, 64, 2, 4), (64, 64, 1, 4),
                           (64, 64, 2, 4), (64, 32, 1, 4), (128, 64, 1, 8))]


def router(out: str) -> None:
    """The MoE router at the real shape (288 experts x 4096, top 8), each epilogue variant replayed from a CUDA
    graph at decode, verification and prefill token counts: the data behind ``router.default_config``."""
    from glm5_kernels.router import RouterWorkspace, router_topk

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(288, 4096, device="cuda", generator=g) * 4096 ** -0.5).to(torch.bfloat16)
    bias = torch.randn(288, device="cuda", generator=g) * 0.01
    for t in (1, 4, 8, 16, 32, 64, 128, 256, 1024, 4096):
        x = torch.randn(t, 4096, device="cuda", generator=g).to(torch.bfloat16)
        ws = RouterWorkspace()
        ref = router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws)[1]
        row = {"kernel": "router_topk", "T": t}
        for cfg in ROUTER_CONFIGS:
            key = "_".join(f"{k}{int(v)}" for k, v in cfg.items()) + "_us"
            try:
                same = torch.equal(router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, config=cfg)[1], ref)
                row[key] = graph_us(lambda: router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, config=cfg))
                if not same:
                    row[key] = f"experts differ from the default's ({row[key]:.1f} us)"
            except Exception as e:  # out of registers / shared memory for that tile
                row[key] = f"{type(e).__name__}: {str(e)[:120]}"
        row["default_us"] = graph_us(lambda: router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({**_run_info(), "rows": rows}, f, indent=1)


def mhc(out: str, tiles: bool = True) -> None:
    """mHC pre (projection + row kernel) and post tiles at prefill and decode-batch sizes; each variant's output
    is compared with the default's (the same sums in another split order: close, not equal). Then mHC pre at
    prefill sizes with and without the bf16x3 projection (``fn_split``), as the layer runs it. ``tiles=False``:
    only that comparison."""
    from glm5_kernels.mhc import mhc_post, mhc_pre, split_fn_bf16x3

    bw = copy_bw()
    rows = []
    n_hc, hid = 4, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(n_hc * (n_hc + 2), n_hc * hid, device="cuda", generator=g) * 0.02
    base, scale = torch.randn(n_hc * (n_hc + 2), device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
    w = torch.ones(hid, device="cuda", dtype=torch.bfloat16)
    sp = split_fn_bf16x3(fn)
    for t in (512, 4096, 8192):
        streams = torch.randn(t, n_hc, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        a = mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5)
        b = mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5, fn_split=sp)
        row = {"kernel": "mhc_pre_split3", "T": t, "copy_bw_us": (streams.numel() + a[0].numel()) * 2 / bw * 1e6,
               "tf32x3_us": graph_us(lambda: mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5)),
               "bf16x3_us": graph_us(lambda: mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5,
                                                     fn_split=sp)),
               "max_abs_diff_post": (a[1] - b[1]).abs().max().item(),
               "max_abs_diff_comb": (a[2] - b[2]).abs().max().item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for t in ((4096, 64) if tiles else ()):
        streams = torch.randn(t, n_hc, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        x0, p0, c0 = mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5)
        row = {"kernel": "mhc_pre", "T": t, "stream_bytes": streams.numel() * 2,
               "copy_bw_us": (streams.numel() + x0.numel()) * 2 / bw * 1e6,
               "default_us": graph_us(lambda: mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5))}
        variants = [dict(block_t=bt, block_k=bk, splits=sp, proj_warps=pw, proj_stages=st)
                    for bt in (64, 128) for bk in (64, 128) for sp in (None, 16, 32) for pw in (4, 8)
                    for st in (3, 4)] + [dict(row_warps=rw) for rw in (2, 4, 16)]
        for v in variants:
            key = "_".join(f"{k}{v[k]}" for k in v)
            try:
                x, p_, c_ = mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5, **v)
                err = (x.float() - x0.float()).abs().max().item()
                row[key] = {"us": graph_us(lambda: mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5,
                                                           **v)), "max_abs_diff": err}
            except Exception as e:  # out of shared memory / registers for that tile
                row[key] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(json.dumps(row)[:2000], flush=True)
        ref = mhc_post(y, streams, p0, c0)
        row = {"kernel": "mhc_post", "T": t, "copy_bw_us": (2 * streams.numel() + y.numel()) * 2 / bw * 1e6,
               "default_us": graph_us(lambda: mhc_post(y, streams, p0, c0))}
        for bh in (256, 512, 1024, 2048, 4096):
            for nw in (2, 4, 8):
                key = f"h{bh}_w{nw}"
                try:
                    same = torch.equal(mhc_post(y, streams, p0, c0, block_h=bh, num_warps=nw), ref)
                    row[key] = {"us": graph_us(lambda: mhc_post(y, streams, p0, c0, block_h=bh, num_warps=nw)),
                                "equal": same}
                except Exception as e:
                    row[key] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(json.dumps(row)[:2000], flush=True)
    with open(out, "w") as fh:
        json.dump({**_run_info(), "copy_bw_Bps": bw, "rows": rows}, fh, indent=1)


def select(out: str) -> None:
    """The index selection (``select_token_slots``, one program per row) at 1-256 rows and context 1K-32K over the
    32K bench table, at its default (1024 scores per loop step, 4 warps) and with larger steps and more warps:
    at 32K a row's program runs four radix passes and a compaction over 8192 pools. Each variant's output is
    compared with the default's (the selection is exact, so they must be equal)."""
    from glm5_kernels.indexer import select_token_slots

    kp, bs, n_select, _ = SELECT_SHAPE
    rows = []
    for n in (1, 8, 64, 256):
        for ctx in (1024, 8192, 32768):
            scores, nc, pos, bt, rs, cnt = _select_inputs(n, ctx)
            ref = select_token_slots(scores, nc, pos, bt, rs, n_select, kp, bs, counts_out=cnt)
            row = {"kernel": "select", "n": n, "ctx": ctx}
            for block in (1024, 2048, 4096, 8192):
                for warps in (4, 8, 16):
                    key = f"b{block}_w{warps}"
                    try:
                        got = select_token_slots(scores, nc, pos, bt, rs, n_select, kp, bs, block=block,
                                                 counts_out=cnt, num_warps=warps)
                        row[key] = {"us": graph_us(lambda: select_token_slots(
                            scores, nc, pos, bt, rs, n_select, kp, bs, block=block, counts_out=cnt,
                            num_warps=warps)), "equal": torch.equal(got, ref)}
                    except Exception as e:  # out of registers / shared memory for that tile
                        row[key] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out, "w") as fh:
        json.dump({**_run_info(), "rows": rows}, fh, indent=1)


def mhc_decode(out: str) -> None:
    """mHC pre at decode sizes (1-8 rows, n = 4, H = 4096, bf16): the projection on tensor cores in tf32x3 (the
    default) against the FMA projection (``proj_fma``) at several splits, K tiles and warps, and the row kernel's
    warps. One CUDA graph holds the 16 sites of a bench-config step, each with its own ``fn`` (as a step reads
    them); µs per site, and each variant's post / comb against the fp32 reference (no tf32)."""
    from glm5_kernels.mhc import mhc_pre
    from glm5_kernels.mhc_ref import mhc_pre_ref

    n_hc, hid, sites = 4, 4096, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    fns = [torch.randn(n_hc * (n_hc + 2), n_hc * hid, device="cuda", generator=g) * 0.02 for _ in range(sites)]
    base, scale = torch.randn(n_hc * (n_hc + 2), device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
    w = torch.ones(hid, device="cuda", dtype=torch.bfloat16)
    variants = [{}] + [dict(proj_fma=True, splits=sp, block_k=bk, proj_warps=pw)
                       for sp in (None, 32, 16) for bk in (64, 128, 256) for pw in (2, 4)] + \
        [dict(row_warps=rw) for rw in (1, 2, 4, 16)] + [dict(proj_fma=True, row_warps=rw) for rw in (1, 2, 4, 16)]
    rows = []
    for t in (1, 2, 4, 8):
        streams = torch.randn(t, n_hc, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        torch.backends.cuda.matmul.allow_tf32 = False   # the fp32 reference in fp32 (bf16 streams are exact in it)
        _, pr, cr = (r.double() for r in mhc_pre_ref(streams, fns[0], base, scale, n_hc, 1e-6, 1e-5, 20))
        row = {"kernel": "mhc_pre_decode", "T": t, "sites": sites}
        for v in variants:
            key = "_".join(f"{k}{v[k]}" for k in v) or "default"
            try:
                _, p_, c_ = mhc_pre(streams, fns[0], base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5, **v)

                def step(v=v) -> None:
                    for fn in fns:
                        mhc_pre(streams, fn, base, scale, n_hc, 1e-6, 1e-5, 20, w, 1e-5, **v)
                row[key] = {"us_per_site": graph_us(step) / sites,
                            "post_err": (p_.double() - pr).abs().max().item(),
                            "comb_err": (c_.double() - cr).abs().max().item()}
            except Exception as e:  # out of registers / resources for that tile
                row[key] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as fh:
        json.dump({**_run_info(), "rows": rows}, fh, indent=1)


#: (BV, num_warps) tiles of the KDA decode sweep: at most 128 state floats per thread (no spills).
KDA_TILES = tuple((bv, w) for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if 128 * bv // (32 * w) <= 128)


def kda(out: str) -> None:
    """The KDA decode recurrence at the real head shape, fla's kernel against ours at every tile of
    :data:`KDA_TILES` (same inputs; the output and state agreement with fla's is recorded with each row)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from glm5_kernels.kda_verify import decode_state_bytes, decode_tile, kda_decode_recurrence

    bw = copy_bw()
    rows = []
    h, d = 64, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    a_log = (torch.randn(h, device="cuda", generator=g) * 0.3).float()
    dt = (torch.randn(h * d, device="cuda", generator=g) * 0.3).float()
    for n in (1, 8, 64, 256):
        conv = torch.randn(3, n, h * d, device="cuda", generator=g).to(torch.bfloat16)
        q, k, v = (x.view(n, h, d) for x in conv.unbind(0))
        f = torch.randn(n, h * d, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
        pool = torch.randn(n + 8, h, d, d, device="cuda", generator=g) * 0.05
        slots = torch.randperm(n + 8, device="cuda", generator=g)[:n].to(torch.int32)

        def fla_step(state):
            o, _ = fused_recurrent_kda_fwd(
                q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), f.view(n, 1, h, d), b.unsqueeze(1), A_log=a_log,
                dt_bias=dt, initial_state=state, scale=d ** -0.5, inplace_final_state=True, ssm_state_indices=slots,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0, out=torch.empty_like(v.unsqueeze(1)))
            return o[:, 0]

        def ours(state, tile=None):
            return kda_decode_recurrence(q, k, v, f, b, state, slots, a_log, dt, -5.0, d ** -0.5, tile=tile)

        ref_pool = pool.clone()
        ref_out = fla_step(ref_pool).float()
        by = decode_state_bytes(n, h, d)
        work = pool.clone()
        row = {"kernel": "kda_decode", "n": n, "H": h, "d": d, "state_bytes": by, "default_tile": decode_tile(n, d)}
        t = graph_us(lambda: fla_step(work))
        row["fla_us"], row["fla_frac_copy_bw"] = t, by / (t * 1e-6) / bw
        for tile in KDA_TILES:
            key = f"bv{tile[0]}_w{tile[1]}"
            try:
                p2 = pool.clone()
                o = ours(p2, tile).float()
                err_o = ((o - ref_out).norm() / ref_out.norm()).item()
                err_s = ((p2 - ref_pool).norm() / ref_pool.norm()).item()
                t = graph_us(lambda: ours(work, tile))
                row[key] = {"us": t, "frac_copy_bw": by / (t * 1e-6) / bw, "rel_err_out_vs_fla": err_o,
                            "rel_err_state_vs_fla": err_s}
            except Exception as e:  # out of registers / resources for that tile
                row[key] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pool, work, ref_pool
    with open(out, "w") as fh:
        json.dump({**_run_info(), "copy_bw_Bps": bw, "rows": rows}, fh, indent=1)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write (one row per kernel and shape)")
    ap.add_argument("--small", action="store_true", help="the latency-bound decode kernels instead of sparse MLA")
    ap.add_argument("--router", action="store_true", help="the router's launch configurations instead of sparse MLA")
    ap.add_argument("--kda", action="store_true", help="the KDA decode recurrence's tiles (and fla's) instead")
    ap.add_argument("--mhc", action="store_true", help="the mHC kernels' tiles at prefill and batch sizes instead")
    ap.add_argument("--no-tiles", action="store_true", help="--mhc: only the bf16x3 projection against tf32x3")
    ap.add_argument("--select", action="store_true", help="the index selection's loop step and warps at 1-256 rows, "
                    "context 1K-32K")
    ap.add_argument("--mhc-decode", action="store_true", help="mHC pre at decode sizes: tf32x3 against the FMA "
                    "projection's tiles, the row kernel's warps")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = _args()
    if args.mhc:
        mhc(args.out, tiles=not args.no_tiles)
    elif args.mhc_decode:
        mhc_decode(args.out)
    elif args.select:
        select(args.out)
    else:
        (small if args.small else router if args.router else kda if args.kda else main)(args.out)
