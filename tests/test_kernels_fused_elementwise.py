"""The fused elementwise / normalisation kernels of the decode step vs their torch references.

RMSNorm and the KDA gated output norm (``glm5_kernels.norms`` vs ``norms_ref``), the clamped SwiGLU
(``glm5_kernels.swiglu`` vs ``moe_ref.clamped_swiglu_ref``) and the KDA decode conv step
(``glm5_kernels.kda_decode`` vs ``kda_decode_ref``, states updated in place, q/k/v written as separate
contiguous tensors). Interpreter tests run on the CPU (``TRITON_INTERPRET=1``, small awkward shapes, strided
inputs); ``gpu`` tests run the real decode shapes on the H200, where bf16 results must equal torch's in
almost every element (the only freedom left is the summation order of a mean) and differ by at most one ulp.
"""

from __future__ import annotations


import pytest
import torch

from interpreter import run_interpreted


def _interpret(body: str, timeout: int = 300) -> str:
    return run_interpreted(body, timeout)


def test_fused_elementwise_kernels_match_references_interpreter():
    """fp32 to 1e-6; bf16 bit for bit but for an exp / rsqrt last-bit difference between numpy and torch (the
    kernels round bf16 by explicit round-to-nearest-even arithmetic, which the interpreter runs exactly)."""
    _interpret("""
        import torch
        from glm5_kernels import norms_ref
        from glm5_kernels.norms import gated_rms_norm, rms_norm
        from glm5_kernels.swiglu import clamped_swiglu
        from glm5_kernels.moe_ref import clamped_swiglu_ref
        from glm5_kernels.kda_decode import kda_conv_step
        from glm5_kernels.kda_decode_ref import kda_conv_step_ref
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)

        def same(got, want, dt):
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
            if dt == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                return
            a, b = got.contiguous().view(torch.int16).int(), want.contiguous().view(torch.int16).int()
            assert (a == b).float().mean() > 0.999 and (a - b).abs().max() <= 1, ((a != b).sum(), (a - b).abs().max())

        for dt in (torch.float32, torch.bfloat16):
            # RMSNorm: a strided input (a column slice of a wider tensor), width not a power of two
            wide = (torch.randn(5, 100, generator=g) * 3).to(dt)
            x = wide[:, 10:58]
            w = (1 + 0.1 * torch.randn(48, generator=g)).to(dt)
            same(rms_norm(x, w, 1e-5), norms_ref.rms_norm(x, w, 1e-5), dt)
            x3 = torch.randn(2, 3, 48, generator=g).to(dt)
            same(rms_norm(x3, w, 1e-5), norms_ref.rms_norm(x3, w, 1e-5), dt)
            # gated RMSNorm over heads
            x = torch.randn(3, 4, 16, generator=g).to(dt)
            gate = (torch.randn(3, 64, generator=g) * 2).to(dt).view(3, 4, 16)
            wn = (1 + 0.1 * torch.randn(16, generator=g)).to(dt)
            same(gated_rms_norm(x, gate, wn, 1e-5), norms_ref.gated_rms_norm(x, gate, wn, 1e-5), dt)
            # clamped SwiGLU: values beyond the limit on both sides, strided halves of one tensor
            gu = (torch.randn(4, 2 * 40, generator=g) * 8).to(dt)
            gt, up = gu[:, :40], gu[:, 40:]
            same(clamped_swiglu(gt, up, 10.0), clamped_swiglu_ref(gt, up, 10.0), dt)
            # conv step: shuffled slots, the fused projection's strided slices, beta copied along
            n, c, k = 3, 3 * 24, 4
            state = torch.randn(6, k - 1, c, generator=g).to(dt)
            proj = torch.randn(n, c + 10, generator=g).to(dt)
            mixed, beta = proj[:, :c], proj[:, c + 2:c + 7]
            wconv = torch.randn(c, k, generator=g).to(dt)
            slots = torch.tensor([4, 0, 2])
            want_state = state.clone()
            want = kda_conv_step_ref(mixed, want_state, slots, wconv)
            qkv, b = kda_conv_step(mixed, state, slots, wconv, extra=beta)
            assert qkv.shape == (3, n, 24) and all(t.is_contiguous() for t in qkv)
            same(qkv.permute(1, 0, 2).reshape(n, c), want, dt)
            assert torch.equal(state, want_state) and torch.equal(b, beta) and b.is_contiguous()
    """)


# ---------------------------------------------------------------------------------------------- GPU
def _ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(fraction of equal elements, largest distance in bf16 ulps) of two bf16 tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia == ib).float().mean().item(), int((ia - ib).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_fused_elementwise_kernels_real_shapes_gpu(rows):
    """bf16 at the decode (1, 64 rows) and prefill (4096) shapes: hidden 4096, q_a 1536, kv_a 512, 64 KDA heads
    × 128, the 12288 / 2048 SwiGLU widths, the 3 × 8192 conv with 64 β logits."""
    from glm5_kernels import norms_ref
    from glm5_kernels.kda_decode import kda_conv_step
    from glm5_kernels.kda_decode_ref import kda_conv_step_ref
    from glm5_kernels.moe_ref import clamped_swiglu_ref
    from glm5_kernels.norms import gated_rms_norm, rms_norm
    from glm5_kernels.swiglu import clamped_swiglu
    g = torch.Generator(device="cpu").manual_seed(rows)
    dev, dt = "cuda", torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    for width in (4096, 1536, 512):
        x, w = rnd(rows, width, scale=3.0), 1 + rnd(width, scale=0.1)
        eq, ulp = _ulps(rms_norm(x, w, 1e-5), norms_ref.rms_norm(x, w, 1e-5))
        # the fp32 statistics reduce in another order than torch's: rarely (1 element in 3e5 on the H200) the
        # bf16 result lands 2 ulps away
        assert eq > 0.999 and ulp <= 2, (width, eq, ulp)
    x, gate, wn = rnd(rows, 64, 128), rnd(rows, 64, 128, scale=2.0), 1 + rnd(128, scale=0.1)
    eq, ulp = _ulps(gated_rms_norm(x, gate, wn, 1e-5), norms_ref.gated_rms_norm(x, gate, wn, 1e-5))
    assert eq > 0.999 and ulp <= 1, (eq, ulp)
    for inter in (12288, 2048):
        gt, up = rnd(rows, inter, scale=6.0), rnd(rows, inter, scale=6.0)
        eq, ulp = _ulps(clamped_swiglu(gt, up, 10.0), clamped_swiglu_ref(gt, up, 10.0))
        assert eq > 0.999 and ulp <= 1, (inter, eq, ulp)
    if rows <= 64:
        c = 3 * 8192
        state = rnd(rows + 3, 3, c)
        proj = rnd(rows, c + 2 * 128 + 64)
        mixed, beta = proj[:, :c], proj[:, c + 256:]
        wconv = rnd(c, 4, scale=0.5)
        slots = torch.randperm(rows + 3, generator=g)[:rows].to(dev)
        want_state = state.clone()
        want = kda_conv_step_ref(mixed, want_state, slots, wconv)
        qkv, b = kda_conv_step(mixed, state, slots, wconv, extra=beta)
        eq, ulp = _ulps(qkv.permute(1, 0, 2).reshape(rows, c), want)
        assert eq > 0.999 and ulp <= 1, (eq, ulp)
        assert torch.equal(state, want_state) and torch.equal(b, beta)
