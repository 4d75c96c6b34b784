"""Micro-benchmark of the Triton kernels against their torch references and the copy roofline.

``python bench/kernel_bench.py OUT.json``: sparse NoPE MLA decode (64 heads, 512 latent, 2051 selected
rows from a 4M-row cache) at several batch sizes; achieved bytes/s vs the measured copy bandwidth.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from glm5_kernels.sparse_mla_decode import decode_bytes, decode_flops, sparse_mla_decode, sparse_mla_decode_ref


def main() -> None:
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
    json.dump({"copy_bw_Bps": bw, "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
