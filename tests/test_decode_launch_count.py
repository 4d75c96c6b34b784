"""The batch-1 decode step's launches on the GPU path, counted on the CPU (``bench/kernel_count.py``).

Pins the fusions: with the CUDA backends (Triton kernels run by the interpreter, fla's recurrent kernel a
counted stand-in) no launch of the step comes from a torch reference chain any more — RMSNorm, the KDA gated
norm and conv step, the clamped SwiGLU, the router, the MoE token alignment — and each fused kernel runs once
per place it replaces. The counts themselves are reported (docs/gpu.md has the per-layer table).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_fused_decode_step_launches_no_reference_chains(tmp_path):
    out = tmp_path / "counts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_count.py"), "--json", str(out)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    import json
    counts = json.loads(out.read_text())
    print(res.stdout.splitlines()[0])
    sites, ops = counts["by_site"], counts["by_op"]
    for ref in ("norms_ref.rms_norm", "norms_ref.gated_rms_norm", "kda_decode_ref.kda_conv_step_ref",
                "moe_ref.clamped_swiglu_ref", "router_ref.select_experts_ref", "router_ref.route_ref",
                "fused_moe.moe_align_block_size"):
        assert ref not in sites, (ref, sites.get(ref))
    kda, mla, dense, moe = 6, 2, 3, 5                          # the bench architecture's 8 layers
    want = {"triton:_conv_step_kernel": kda, "triton:_gated_rms_norm_kernel": kda, "triton:_kda_spec_kernel": kda,
            "triton:_rms_norm_kernel": 2 * mla + 1, "triton:_combine_kernel": mla,
            "triton:_sparse_mla_kernel": mla, "triton:_router_kernel": moe, "triton:_align_kernel": moe,
            "triton:_clamped_swiglu_kernel": dense + moe, "triton:_mhc_post_kernel": 2 * (kda + mla),
            "triton:_moe_sum_kernel": moe}   # the slot sum with the shared expert's output added
    assert {k: ops.get(k) for k in want} == want
    assert counts["total"] < 260, counts["total"]
