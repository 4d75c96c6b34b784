"""Fused mHC pre/post Triton kernels vs their torch reference (glm5_kernels.mhc_ref, with norms_ref.rms_norm).

The interpreter test runs the kernels on CPU under ``TRITON_INTERPRET=1`` at small fp32 shapes (the
interpreter truncates fp32→bf16 casts instead of rounding to nearest even, so bf16 is checked on the
GPU only). ``gpu`` tests use the real shape (n = 4, H = 4096) in bf16 and fp32, plus a CUDA-graph
capture/replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = json.loads((ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json").read_text())["text_config"]
N, HC_EPS, ITERS, NORM_EPS = CONFIG["hc_mult"], CONFIG["hc_eps"], CONFIG["hc_sinkhorn_iters"], CONFIG["rms_norm_eps"]


def _params(n: int, h: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random fn/base/scale of the checkpoint's shapes and dtypes (fp32)."""
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(n * (n + 2), n * h, generator=g) * (2.0 / (n * h) ** 0.5)
    base = torch.randn(n * (n + 2), generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return fn.to(device), base.to(device), scale.to(device)


def _streams(t: int, n: int, h: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Streams with per-token scales from 1e-3 (below sqrt(norm_eps), as GLM embeddings are) to 1."""
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (-3 * torch.rand(t, 1, 1, generator=g))
    return (torch.randn(t, n, h, generator=g) * mag).to(device=device, dtype=dtype)


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the tensor's largest magnitude. Elementwise-relative is meaningless
    where values cancel to ~0, and for tiny comb entries it measures the fp32 *reference's* own
    rounding (both the kernel and torch fp32 are ~1e-7 from an fp64 evaluation at the real shape)."""
    ref64 = ref.double()
    return ((got.double() - ref64).abs().max() / ref64.abs().max().clamp(min=1e-30)).item()


def test_mhc_pre_rejects_bad_arguments():
    from glm5_kernels.mhc import mhc_post, mhc_pre
    fn, base, scale = _params(4, 8, "cpu", 0)
    st = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="fn must be contiguous fp32"):
        mhc_pre(st, fn.double(), base, scale, 4, HC_EPS, NORM_EPS, ITERS)
    with pytest.raises(ValueError, match="streams must be"):
        mhc_pre(st[:, :2], fn, base, scale, 4, HC_EPS, NORM_EPS, ITERS)
    with pytest.raises(ValueError, match="without block_norm_eps"):
        mhc_pre(st, fn, base, scale, 4, HC_EPS, NORM_EPS, ITERS, block_norm_w=torch.ones(8))
    with pytest.raises(ValueError, match="block_out must be"):
        mhc_post(torch.zeros(2, 8, dtype=torch.bfloat16), st, torch.zeros(2, 4), torch.zeros(2, 4, 4))


def test_mhc_kernels_interpreter_cpu():
    """fp32, n=4, the config's Sinkhorn iterations; T in {1, 7, 17 (two row blocks)}, H = 64 and 48
    (masked tail), several split-K layouts (uneven last split, non-power-of-two count)."""
    import triton  # noqa: F401  (part of the test extra: must import)
    code = textwrap.dedent(f"""
        import torch
        from glm5_kernels.mhc import mhc_post, mhc_pre
        from glm5_kernels.mhc_ref import mhc_post_ref, mhc_pre_ref
        import test_kernels_mhc as T
        n, iters, eps, neps = {N}, {ITERS}, {HC_EPS}, {NORM_EPS}
        cases = [(1, 64, None, 16), (7, 64, 4, 16), (7, 48, 3, 32), (17, 64, 1, 64)]
        for i, (t, h, splits, bk) in enumerate(cases):
            fn, base, scale = T._params(n, h, "cpu", i)
            st = T._streams(t, n, h, torch.float32, "cpu", 10 + i)
            w = 1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(i))
            x, post, comb = mhc_pre(st, fn, base, scale, n, eps, neps, iters, splits=splits, block_k=bk)
            xr, pr, cr = mhc_pre_ref(st, fn, base, scale, n, eps, neps, iters)
            assert x.dtype == xr.dtype and post.shape == pr.shape and comb.shape == cr.shape
            errs = [T._max_rel(x, xr), T._max_rel(post, pr), T._max_rel(comb, cr)]
            xn, post2, comb2 = mhc_pre(st, fn, base, scale, n, eps, neps, iters, w, 1e-5, splits=splits, block_k=bk)
            xnr = mhc_pre_ref(st, fn, base, scale, n, eps, neps, iters, w, 1e-5)[0]
            errs.append(T._max_rel(xn, xnr))
            assert torch.equal(post, post2) and torch.equal(comb, comb2)
            y = torch.randn(t, h, generator=torch.Generator().manual_seed(20 + i))
            out = mhc_post(y, st, pr, cr, block_h=32)
            errs.append(T._max_rel(out, mhc_post_ref(y, st, pr, cr)))
            assert max(errs[:4]) < 1e-5 and errs[4] < 1e-6, (t, h, errs)
            print("case", t, h, ["%.1e" % e for e in errs])
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_mhc_fma_projection_interpreter_cpu():
    """``proj_fma`` (decode sizes): the CUDA-core projection against the reference at 1-8 rows (row blocks of
    1, 4 and 8, masked rows, an uneven split, a masked H tail), and above FMA_MAX_ROWS the tensor-core path."""
    code = textwrap.dedent(f"""
        import torch
        from glm5_kernels import mhc
        from glm5_kernels.mhc_ref import mhc_pre_ref
        import test_kernels_mhc as T
        n, iters, eps, neps = {N}, {ITERS}, {HC_EPS}, {NORM_EPS}
        launched = []
        kernel = mhc._mhc_proj_kernel
        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    launched.append((kw["FMA"], kw["BLOCK_T"]))
                    return kernel[grid](*a, **kw)
                return launch
        mhc._mhc_proj_kernel = Spy()
        for i, (t, h, splits, bk) in enumerate([(1, 64, None, 16), (3, 48, 3, 32), (8, 64, 2, 64), (9, 64, 2, 64)]):
            fn, base, scale = T._params(n, h, "cpu", i)
            st = T._streams(t, n, h, torch.float32, "cpu", 30 + i)
            w = 1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(i))
            x, post, comb = mhc.mhc_pre(st, fn, base, scale, n, eps, neps, iters, w, 1e-5, splits=splits, block_k=bk,
                                        proj_fma=True)
            xr, pr, cr = mhc_pre_ref(st, fn, base, scale, n, eps, neps, iters, w, 1e-5)
            errs = [T._max_rel(x, xr), T._max_rel(post, pr), T._max_rel(comb, cr)]
            assert max(errs) < 1e-5, (t, h, errs)
        assert launched == [(True, 1), (True, 4), (True, 8), (False, 16)], launched
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_split_fn_bf16x3_is_exact_and_k_major():
    from glm5_kernels.mhc import split_fn_bf16x3
    fn, _, _ = _params(N, 48, "cpu", 3)
    fn[0, :5] = torch.tensor([1e-30, -3.0e38, 1.0 / 3.0, 0.0, 7.0])   # tiny, huge, inexact, zero
    sp = split_fn_bf16x3(fn)
    mix = N * (N + 2)
    assert sp.shape == (3, N * 48, 32) and sp.dtype == torch.bfloat16 and sp.is_contiguous()
    assert torch.equal(sp.float().sum(0)[:, :mix].t(), fn)          # hi + mid + lo = fn, exactly
    assert not sp[:, :, mix:].any()                                  # the padding columns are zero
    assert (sp[2].float().abs() <= sp[0].float().abs() * 2 ** -15).all()   # lo is two bf16 steps below hi


def test_mhc_split3_projection_interpreter_cpu():
    """The projection's SPLIT3 path (three dots over the k-major split) against the plain path, launched
    directly under the interpreter. The interpreter's bf16 tl.dot is wrong in this Triton (it returns ~1e10
    for unit inputs), so the split parts and streams go in as fp32 holding bf16 values: what this checks is
    the split's indexing (parts, rows, padding, K tails and splits); the bf16 dots are checked on the GPU."""
    code = textwrap.dedent(f"""
        import torch
        from glm5_kernels.mhc import _mhc_proj_kernel, split_fn_bf16x3
        import test_kernels_mhc as T
        for t, h, splits, bk in [(70, 32, 1, 32), (70, 48, 3, 64), (17, 64, 2, 16), (70, 40, 2, 64), (9, 40, 1, 64)]:
            k = T.N * h                                   # h = 40: K = 160, a partial last tile of 64
            fn, _, _ = T._params(T.N, h, "cpu", t)
            x = T._streams(t, T.N, h, torch.bfloat16, "cpu", h).float().reshape(t, k)
            sp = split_fn_bf16x3(fn).float()
            kps = bk * ((-(-k // bk) + splits - 1) // splits)   # mhc_pre's k_per_split
            n_split = (k + kps - 1) // kps
            parts = []
            for split3 in (False, True):
                part = torch.empty(t, n_split, 32)
                _mhc_proj_kernel[((t + 63) // 64, n_split)](x, sp if split3 else fn, part, t, k, kps, k, MIX=24,
                                                            MIX_PAD=32, SPLITS=n_split, BLOCK_T=64, BLOCK_K=bk,
                                                            PRECISION="ieee", SPLIT3=split3)
                parts.append(part.sum(1))
            ref = x.double() @ fn.double().t()
            assert T._max_rel(parts[1][:, :24], ref) < 1e-6, (t, h, T._max_rel(parts[1][:, :24], ref))
            assert torch.allclose(parts[0], parts[1], rtol=1e-5, atol=1e-6), (t, h)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def fp32_matmul_highest():
    """The fp32 references must not use tf32 (the kernels never do)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_pre_post_match_reference_gpu(t, dtype, fp32_matmul_highest):
    from glm5_kernels.mhc import mhc_post, mhc_pre
    from glm5_kernels.mhc_ref import mhc_post_ref, mhc_pre_ref
    h = 4096
    fn, base, scale = _params(N, h, "cuda", t)
    st = _streams(t, N, h, dtype, "cuda", t + 1)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(t))).to("cuda", dtype)
    x, post, comb = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS)
    xr, pr, cr = mhc_pre_ref(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS)
    xn = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)[0]
    xnr = mhc_pre_ref(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)[0]
    assert x.dtype == dtype and xn.dtype == dtype and post.dtype == comb.dtype == torch.float32
    # post/comb: fp32 mapping math in both dtypes (bf16 streams are exact in fp32)
    assert _max_rel(post, pr) < 1e-5 and _max_rel(comb, cr) < 1e-5, (_max_rel(post, pr), _max_rel(comb, cr))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _max_rel(x, xr) < tol and _max_rel(xn, xnr) < tol, (_max_rel(x, xr), _max_rel(xn, xnr))
    y = torch.randn(t, h, device="cuda").to(dtype)
    out, outr = mhc_post(y, st, pr, cr), mhc_post_ref(y, st, pr, cr)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _max_rel(out, outr) < 1e-6, _max_rel(out, outr)
    else:
        # The reference rounds post·y and combᵀ·X to bf16 separately before adding (cuBLAS output rounding);
        # measured on the H200, the kernel differs from it in ~26% of elements by one bf16 ulp (max 4.5e-3
        # relative). Hold it to the bf16 tolerance and to being no less accurate than torch's own bf16 path
        # against the exact result from the same (bf16-rounded) inputs.
        exact = (pr.to(dtype).double().unsqueeze(-1) * y.double().unsqueeze(-2)
                 + torch.matmul(cr.to(dtype).double().transpose(-1, -2), st.double()))
        err_kernel = ((out.double() - exact).norm() / exact.norm()).item()
        err_torch = ((outr.double() - exact).norm() / exact.norm()).item()
        print(f"mhc_post bf16 T={t}: kernel rel err {err_kernel:.2e}, torch bf16 rel err {err_torch:.2e}")
        assert _max_rel(out, outr) < 1e-2 and err_kernel <= 1.05 * err_torch + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("t", [512, 4096, 8192])
def test_mhc_pre_split3_projection_matches_reference_gpu(t, fp32_matmul_highest):
    """bf16 prefill rows with the layer's ``fn_split``: post and comb within 5e-5 of the fp32 reference, x to
    bf16; below 512 rows fn_split is not used. Measured on the H200 (2026-12-04 02:57 UTC): post / comb 8.8e-7 /
    9.1e-7 at 512 rows, 7.5e-6 / 1.2e-5 at 4096, 1.9e-5 / 1.5e-5 at 8192 (the largest error over more tokens
    grows), where the tf32x3 path has 3.7e-7 ... 2.8e-6: the bf16 dots' products are exact, the tensor cores'
    fp32 accumulation is not. Both feed the post kernel through a cast to bf16 (2^-9 relative) and the collapse
    through the bf16 block input, a hundred times coarser than either."""
    from glm5_kernels.mhc import mhc_pre, split_fn_bf16x3
    from glm5_kernels.mhc_ref import mhc_pre_ref
    h = 4096
    fn, base, scale = _params(N, h, "cuda", t)
    sp = split_fn_bf16x3(fn)
    st = _streams(t, N, h, torch.bfloat16, "cuda", t + 2)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(t))).to("cuda", torch.bfloat16)
    x, post, comb = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS, fn_split=sp)
    x3, post3, comb3 = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)   # tf32x3
    xr, pr, cr = mhc_pre_ref(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)
    errs = [_max_rel(post, pr), _max_rel(comb, cr), _max_rel(post3, pr), _max_rel(comb3, cr), _max_rel(x, xr)]
    print(f"mhc split3 T={t}: post {errs[0]:.1e} comb {errs[1]:.1e} (tf32x3: {errs[2]:.1e} {errs[3]:.1e}) "
          f"x {errs[4]:.1e}")
    assert max(errs[:2]) < 5e-5 and errs[4] < 1e-2, errs
    small = st[:64].contiguous()
    a = mhc_pre(small, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS, fn_split=sp)
    b = mhc_pre(small, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_pre_fma_projection_matches_reference_gpu(t, dtype, fp32_matmul_highest):
    """``proj_fma`` at decode sizes and the real shape: post / comb within the default path's 1e-5 of the fp32
    reference, and the block input to the dtype's tolerance."""
    from glm5_kernels.mhc import mhc_pre
    from glm5_kernels.mhc_ref import mhc_pre_ref
    h = 4096
    fn, base, scale = _params(N, h, "cuda", t)
    st = _streams(t, N, h, dtype, "cuda", t + 2)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(t))).to("cuda", dtype)
    x, post, comb = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS, proj_fma=True)
    xr, pr, cr = mhc_pre_ref(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)
    errs = (_max_rel(post, pr), _max_rel(comb, cr), _max_rel(x, xr))
    print(f"mhc_pre proj_fma {dtype} T={t}: post / comb / x rel err {errs[0]:.1e} / {errs[1]:.1e} / {errs[2]:.1e}")
    assert errs[0] < 1e-5 and errs[1] < 1e-5, errs
    assert errs[2] < (1e-5 if dtype == torch.float32 else 1e-2), errs


@pytest.mark.gpu
def test_mhc_cuda_graph_replay_gpu():
    """Capture pre(+norm) → post once; replay on new inputs copied into the static buffers."""
    from glm5_kernels.mhc import mhc_post, mhc_pre
    from glm5_kernels.mhc_ref import mhc_post_ref, mhc_pre_ref
    t, h, dtype = 8, 4096, torch.bfloat16
    fn, base, scale = _params(N, h, "cuda", 5)
    w = torch.ones(h, device="cuda", dtype=dtype)
    st = _streams(t, N, h, dtype, "cuda", 6)
    y = torch.randn(t, h, device="cuda", dtype=dtype)

    def site() -> tuple[torch.Tensor, torch.Tensor]:
        xn, post, comb = mhc_pre(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)
        return xn, mhc_post(y, st, post, comb)

    site()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xn_g, out_g = site()
    for seed in (7, 8):
        st.copy_(_streams(t, N, h, dtype, "cuda", seed))
        y.copy_(torch.randn(t, h, device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        xn_e, out_e = site()
        assert torch.equal(xn_g, xn_e) and torch.equal(out_g, out_e)
        xr, pr, cr = mhc_pre_ref(st, fn, base, scale, N, HC_EPS, NORM_EPS, ITERS, w, NORM_EPS)
        assert _max_rel(xn_g, xr) < 1e-2 and _max_rel(out_g, mhc_post_ref(y, st, pr, cr)) < 1e-2
