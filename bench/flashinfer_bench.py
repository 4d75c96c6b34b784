"""Side-by-side sparse NoPE MLA decode: our Triton kernel vs FlashInfer's MLA (FA3 on SM90) vs the torch reference.

``python bench/flashinfer_bench.py [OUT.json]`` (default ``bench/out/flashinfer_mla_kernels.json``), on a
CUDA GPU with flashinfer-python installed. ``python bench/render_results.py --mla-kernels OUT.json`` adds
the table to the rendered results. Same inputs for every implementation: 64 heads, 512-wide latent,
N query rows x K = 2051 selected rows drawn from a 4M-row bf16 cache, N in {1, 8, 64, 256}.

Per implementation and N: µs per call (median of ``triton.testing.do_bench``), both launched eagerly
(includes Python/launch overhead, what an un-captured decode step pays) and replayed from a CUDA graph
(what a captured decode step pays); achieved GB/s from ``decode_bytes`` (each selected latent row read
once + queries + fp32 outputs) and its fraction of the measured device-to-device copy bandwidth.
FlashInfer's host-side ``plan()`` cost (once per decode step, shared by all layers) is timed too,
and every output is checked against the reference so a fast wrong kernel cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import triton
import triton.testing

from glm5_kernels.flashinfer_mla import FLASHINFER_VERSION_TESTED, FlashInferSparseMLA
from glm5_kernels.sparse_mla_decode import decode_bytes, decode_flops, sparse_mla_decode
from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref

H, R, K, SLOTS = 64, 512, 2051, 1 << 22
SCALE = 256 ** -0.5


def _graph_of(fn):
    """Capture ``fn()`` in a CUDA graph (after a warm call) and return its replay function."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main(out_path: str) -> None:
    import flashinfer

    n_bytes = 1 << 30
    a = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    bw = 2 * n_bytes / (triton.testing.do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3)
    del a, b
    lat = torch.randn(SLOTS, R, device="cuda", dtype=torch.bfloat16)
    fi = FlashInferSparseMLA(H, 256, K, SCALE, head_dim=R, dtype=torch.bfloat16, device="cuda")
    rows = []
    for n in (1, 8, 64, 256):
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(n, H, R, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = torch.randint(0, SLOTS, (n, K), device="cuda", dtype=torch.int32, generator=g)
        counts = [K] * n
        t0 = time.perf_counter()
        for _ in range(20):
            fi.plan(counts)
        plan_us = (time.perf_counter() - t0) / 20 * 1e6

        ref = torch.cat([sparse_mla_decode_ref(q[i:i + 16], lat, idx[i:i + 16], SCALE) for i in range(0, n, 16)])
        got_tr = sparse_mla_decode(q, lat, idx, SCALE)
        got_fi = fi.run(q, lat, idx)
        rel = {name: ((o.float() - ref).norm() / ref.norm()).item() for name, o in (("triton", got_tr), ("flashinfer", got_fi))}

        impls = {
            "triton": lambda: sparse_mla_decode(q, lat, idx, SCALE),
            "flashinfer": lambda: fi.run(q, lat, idx),
        }
        by = decode_bytes(n, K, R, H, 2)
        row = {"n": n, "k": K, "heads": H, "latent": R, "cache_rows": SLOTS, "bytes": by,
               "flashinfer_plan_us": plan_us, "rel_err_vs_ref": rel}
        for name, fn in impls.items():
            eager = _us(fn)
            graph = _us(_graph_of(fn))
            row[f"{name}_us"] = eager
            row[f"{name}_graph_us"] = graph
            row[f"{name}_GBps"] = by / (graph * 1e-6) / 1e9
            row[f"{name}_frac_copy_bw"] = by / (graph * 1e-6) / bw
            row[f"{name}_TFLOPs"] = decode_flops(n, K, R, H) / (graph * 1e-6) / 1e12
        chunk = min(n, 64)  # the reference materialises [N, K, R] fp32 rows: time it on at most 64 rows
        row["torch_ref_us"] = _us(lambda: sparse_mla_decode_ref(q[:chunk], lat, idx[:chunk], SCALE)) * n / chunk
        row["torch_ref_GBps"] = by / (row["torch_ref_us"] * 1e-6) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": flashinfer.__version__, "flashinfer_tested": FLASHINFER_VERSION_TESTED,
        "flashinfer_backend": fi.backend, "python": platform.python_version(),
        "copy_bw_GBps": bw / 1e9,
        "notes": "us = median do_bench per call; *_us eager launch, *_graph_us CUDA-graph replay; GB/s and "
                 "TFLOP/s from the graph time; torch_ref timed on min(N,64) rows and scaled to N",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="bench/out/flashinfer_mla_kernels.json", help="JSON file to write "
                    "(default: %(default)s)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main(_args().out)
