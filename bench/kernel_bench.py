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


def main(out: str) -> None:
    n_bytes = 1 << 30
    a = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    bw = 2 * n_bytes / (triton.testing.do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3)
    del a, b
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


def small(out: str) -> None:
    from glm5_kernels.indexer import select_token_slots
    from glm5_kernels.mhc import mhc_pre

    rows = []

    def log(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    kp, bs, n_select, mb = 4, 64, 512, 514                       # 514 blocks of 64 = the 32K bench table
    max_pools = 514 * 16
    for n in (1, 8, 64, 256):
        for ctx in (1024, 8192, 32768):
            pos = torch.full((n,), ctx, device="cuda", dtype=torch.int64)
            nc = torch.div(pos + 1, kp, rounding_mode="floor")
            scores = torch.randn(n, max_pools, device="cuda").masked_fill(
                torch.arange(max_pools, device="cuda")[None, :] >= nc[:, None], float("-inf"))
            bt = torch.randperm(n * mb, device="cuda").view(n, mb).int()
            rs = torch.arange(n, device="cuda", dtype=torch.int32)
            cnt = torch.empty(n, device="cuda", dtype=torch.int32)
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


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write (one row per kernel and shape)")
    ap.add_argument("--small", action="store_true", help="the latency-bound decode kernels instead of sparse MLA")
    ap.add_argument("--router", action="store_true", help="the router's launch configurations instead of sparse MLA")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = _args()
    (small if args.small else router if args.router else main)(args.out)
