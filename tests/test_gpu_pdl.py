"""Programmatic dependent launch on the GPU (run on the H200): a dependent chain of our kernels captured in a
CUDA graph gives bit-identical results with PDL on and off, replay after replay.

Each kernel of the chain reads what the previous one wrote, so a PDL kernel that read before its
``griddepcontrol.wait`` (or a weight prefetch that touched activations) would see stale data in some replay.
The engine-level check (greedy tokens with ``GLM5_PDL=0`` and on, bf16 and fp8 weights) is in
``tests/test_gpu_fp8.py``.
"""

from __future__ import annotations

import pytest
import torch

from glm5_kernels import pdl

pytestmark = pytest.mark.gpu


def _chain(seed: int):
    """rms_norm → fp8 GEMV (FMA) → fp8 w8a8 GEMV with a K split (+ split sum) → mHC post → fp8 GEMV (dot):
    every step's input is the previous step's output."""
    from glm5_kernels.fp8_linear import fp8_linear
    from glm5_kernels.fp8_ref import quantize_fp8_block
    from glm5_kernels.mhc import mhc_post
    from glm5_kernels.norms import rms_norm
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, h = "cuda", 4096
    x0 = torch.randn(1, h, device=dev, generator=g).bfloat16()
    wn = (1 + 0.1 * torch.randn(h, device=dev, generator=g)).bfloat16()
    w1, s1 = quantize_fp8_block(torch.randn(h, h, device=dev, generator=g) * h ** -0.5)
    w2, s2 = quantize_fp8_block(torch.randn(h, 4 * h, device=dev, generator=g) * (4 * h) ** -0.5)
    w3, s3 = quantize_fp8_block(torch.randn(2 * h, h, device=dev, generator=g) * h ** -0.5)
    streams = torch.randn(1, 4, h, device=dev, generator=g).bfloat16()
    post = torch.rand(1, 4, device=dev, generator=g)
    comb = torch.rand(1, 4, 4, device=dev, generator=g)
    fma = {"impl": "gemv_fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 2}
    w8a8 = {"impl": "gemv_w8a8", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 8,
            "num_stages": 3}
    dot = {"impl": "gemv", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 4}

    def run() -> torch.Tensor:
        a = rms_norm(x0, wn, 1e-5)
        b = fp8_linear(a, w1, s1, impl=fma)
        c = fp8_linear(torch.cat([b, b, b, b], dim=-1), w2, s2, impl=w8a8)
        d = mhc_post(c, streams, post, comb)
        return fp8_linear(d[:, 0], w3, s3, impl=dot)
    return run


@pytest.mark.parametrize("seed", [0, 1])
def test_dependent_chain_bit_identical_with_and_without_pdl(monkeypatch, seed):
    monkeypatch.setenv(pdl.ENV, "1")
    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.fail("PDL cannot run on this GPU (it needs compute capability >= 9.0)")
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, flag)
        run = _chain(seed)
        eager = run().clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        for r in replays:
            assert torch.equal(r, eager), f"GLM5_PDL={flag}: a replay differs from the eager run"
        outs[flag] = eager
    assert torch.equal(outs["0"], outs["1"])
