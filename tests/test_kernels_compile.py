"""Every Triton kernel we own compiles for the H200 (sm90) — on the CPU, without a GPU.

The interpreter tests run the kernels' Python semantics; they do not run Triton's compiler, which is
stricter (a ``tl.constexpr`` annotation inside a ``static_range`` body ran in the interpreter and only
failed on the H200). Here each kernel goes through Triton's full pipeline (TTIR → TTGIR → LLVM → PTX →
cubin with the bundled ptxas) at the real GLM-5.3-Flash shapes and each dtype / mode the engine
launches, so a compile error shows up in CI instead of on the device.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on the H200


def _compile(fn, ptrs: dict[str, str], constexprs: dict, floats: tuple[str, ...] = (), i64: tuple[str, ...] = (),
             target: GPUTarget = SM90, smem_limit: int = SMEM_LIMIT, **options):
    """Compile ``fn`` for ``target`` with pointer element types ``ptrs`` (name → triton type), scalars i32 unless
    named in ``floats`` (fp32) or ``i64``, and the given constexpr values; ``options``: num_warps / num_stages.
    Returns the compiled kernel, whose shared memory must fit ``smem_limit`` (the H200's by default)."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ptrs:
            sig[p.name] = "*" + ptrs[p.name]
        elif p.name.endswith("_ptr"):
            raise AssertionError(f"{fn.__name__}: no element type given for {p.name}")
        else:
            sig[p.name] = "fp32" if p.name in floats else "i64" if p.name in i64 else "i32"
    if any(p.name == "USE_PDL" for p in fn.params):   # the ordinary launch unless a test asks for PDL
        constexprs = {"USE_PDL": False, **constexprs}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"{fn.__name__}: constexpr values missing for {missing}"
    if constexprs.get("USE_PDL"):
        options = {**options, "launch_pdl": True}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=target, options=options or None)
    assert kernel.metadata.shared <= smem_limit, f"{fn.__name__}: {kernel.metadata.shared} B of shared memory"
    return kernel


@pytest.mark.parametrize("has_cnt", [False, True])
def test_select_slots_kernel_compiles(has_cnt):
    from glm5_kernels.indexer import _select_slots_kernel
    _compile(_select_slots_kernel, dict(scores_ptr="fp32", nc_ptr="i64", pos_ptr="i64", bt_ptr="i32",
                                        row_seq_ptr="i32", out_ptr="i32", cnt_ptr="i32"),
             dict(KPOOL=4, BS=64, BLOCK=1024, HAS_CNT=has_cnt))


@pytest.mark.parametrize("fp8", [False, True])
def test_index_scores_kernel_compiles(fp8):
    from glm5_kernels.indexer import _index_scores_kernel
    _compile(_index_scores_kernel, dict(q_ptr="fp8e4nv" if fp8 else "bf16", w_ptr="fp32",
                                        keys_ptr="fp8e4nv" if fp8 else "bf16", kscale_ptr="fp32", bt_ptr="i32",
                                        row_seq_ptr="i32", nc_ptr="i64", out_ptr="fp32"),
             dict(HI=32, HI_PAD=32, D=128, BLOCK_P=64, TILES=2, FP8=fp8, IEEE=False, UPCAST=False),
             floats=("softmax_scale",))


@pytest.mark.parametrize("dtype,has_cnt,normalize", [("bf16", True, False), ("bf16", False, False),
                                                    ("bf16", True, True), ("fp32", True, False), ("fp32", True, True)])
def test_sparse_mla_kernel_compiles(dtype, has_cnt, normalize):
    """The default tile of each dtype at the real shape (64 heads, 512-wide latent): split partials (decode) and
    the normalised single-split output (prefill, large decode batches)."""
    import torch
    from glm5_kernels.sparse_mla_decode import DEFAULT_CONFIGS, _sparse_mla_kernel
    cfg = DEFAULT_CONFIGS[torch.bfloat16 if dtype == "bf16" else torch.float32]
    _compile(_sparse_mla_kernel, dict(q_ptr=dtype, lat_ptr=dtype, idx_ptr="i32", cnt_ptr="i32",
                                      o_ptr=dtype if normalize else "fp32", m_ptr="fp32", l_ptr="fp32"),
             dict(H=64, R=512, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SPLITS=1 if normalize else 8,
                  IEEE=dtype == "fp32", HAS_CNT=has_cnt, UPCAST=False, NORMALIZE=normalize),
             floats=("qk_scale",), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@pytest.mark.parametrize("cap,limit_kb", [(80, 163), (86, 99)])
def test_sparse_mla_pre_hopper_tile_fits(cap, limit_kb):
    """The bf16 tile ``default_config`` picks before Hopper fits those GPUs' shared memory per block (the
    Hopper default does not: 164 KB as compiled for sm80 / sm86)."""
    from glm5_kernels.sparse_mla_decode import PRE_HOPPER_CONFIG as cfg
    from glm5_kernels.sparse_mla_decode import _sparse_mla_kernel
    _compile(_sparse_mla_kernel, dict(q_ptr="bf16", lat_ptr="bf16", idx_ptr="i32", cnt_ptr="i32", o_ptr="bf16",
                                      m_ptr="fp32", l_ptr="fp32"),
             dict(H=64, R=512, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SPLITS=1, IEEE=False, HAS_CNT=True,
                  UPCAST=False, NORMALIZE=True),
             floats=("qk_scale",), target=GPUTarget("cuda", cap, 32), smem_limit=limit_kb * 1024,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("t,n_group", [(1, 1), (256, 1), (4096, 1), (8, 8)])
def test_router_kernels_compile(t, n_group, fused):
    """Decode (split-K) and prefill launch shapes at 288 experts × 4096, top-8, DeepSeek-style groups: the GEMM
    with the fused epilogue or without it, and the separate selection launch."""
    from glm5_kernels.router import _router_kernel, _router_select_kernel, default_config
    cfg = {**default_config(t, 4096), **({"fused": True, "EPI_T": 4} if fused else {})}
    warps, epi_warps = cfg.pop("num_warps"), cfg.pop("epi_warps")
    use_fused = cfg.pop("fused")
    select = dict(E=288 if n_group == 1 else 256, E_PAD=512 if n_group == 1 else 256, SPLITS=cfg.pop("SPLITS"),
                  EPI_T=cfg.pop("EPI_T"), TOP_K=8, K_PAD=8, N_GROUP=n_group, G_PAD=n_group,
                  TOPK_GROUP=min(4, n_group), RENORM=True, PRECISE=True)
    ptrs = dict(bias_ptr="fp32", part_ptr="fp32", wout_ptr="fp32", iout_ptr="i64")
    _compile(_router_kernel, dict(x_ptr="bf16", w_ptr="bf16", sem_ptr="i32", **ptrs),
             dict(IEEE=False, UPCAST=False, FUSED=use_fused, **select, **cfg), floats=("scaling",), num_warps=warps)
    if not use_fused:
        _compile(_router_select_kernel, ptrs, select, floats=("scaling",), num_warps=epi_warps)


@pytest.mark.parametrize("width,pdl", [(4096, False), (1536, False), (512, False), (4096, True)])
def test_rms_norm_kernel_compiles(width, pdl):
    from glm5_kernels.norms import _rms_norm_kernel
    block_n = triton.next_power_of_2(width)
    _compile(_rms_norm_kernel, dict(x_ptr="bf16", w_ptr="bf16", out_ptr="bf16"),
             dict(BLOCK_M=max(1, min(16, 2048 // block_n)), BLOCK_N=block_n, PRECISE=True, X_BF16=True, O_BF16=True,
                  USE_PDL=pdl),
             floats=("inv_n", "eps"), num_warps=8 if block_n >= 4096 else 4)


def test_decode_elementwise_kernels_compile():
    """KDA gated norm (128-wide heads), clamped SwiGLU, KDA conv step (3 × 8192 channels, K = 4, β copy) and
    the sparse-MLA split combine (64 heads × 512)."""
    from glm5_kernels.kda_decode import _conv_step_kernel
    from glm5_kernels.norms import _gated_rms_norm_kernel
    from glm5_kernels.sparse_mla_decode import _combine_kernel
    from glm5_kernels.swiglu import _clamped_swiglu_kernel
    _compile(_gated_rms_norm_kernel, dict(x_ptr="bf16", g_ptr="bf16", w_ptr="bf16", out_ptr="bf16"),
             dict(D=128, BLOCK_M=32, PRECISE=True, O_BF16=True), floats=("inv_d", "eps"))
    _compile(_clamped_swiglu_kernel, dict(g_ptr="bf16", u_ptr="bf16", out_ptr="bf16"),
             dict(BLOCK=1024, PRECISE=True, BF16=True),
             floats=("limit",))
    _compile(_conv_step_kernel, dict(mixed_ptr="bf16", state_ptr="bf16", slot_ptr="i64", w_ptr="bf16", out_ptr="bf16",
                                     esrc_ptr="bf16", edst_ptr="bf16"),
             dict(K=4, BLOCK=1024, BLOCK_E=64, HAS_EXTRA=True, PRECISE=True, BF16=True))
    _compile(_combine_kernel, dict(o_ptr="fp32", m_ptr="fp32", l_ptr="fp32", out_ptr="bf16"),
             dict(H=64, R=512, SPLITS=17, SPLITS_P2=32, BLOCK_R=128), num_warps=1)


@pytest.mark.parametrize("pairs,block_m", [(8, 16), (512, 64), (1024, 64)])
def test_moe_align_kernel_compiles(pairs, block_m):
    import triton as _triton
    from glm5_kernels.moe_align import _align_kernel
    _compile(_align_kernel, dict(ids_ptr="i64", sorted_ptr="i32", bexp_ptr="i32", total_ptr="i64", scratch_ptr="i32"),
             dict(E=288, E_PAD=512, P_PAD=max(16, _triton.next_power_of_2(pairs)), BM=block_m, FILL=1024, NB=16))


@pytest.mark.parametrize("dtype,precision,block_t", [("bf16", "tf32x3", 64), ("bf16", "tf32x3", 16),
                                                     ("fp32", "ieee", 16), ("bf16", "split3", 64),
                                                     ("bf16", "fma", 1), ("bf16", "fma", 8), ("fp32", "fma", 4)])
def test_mhc_kernels_compile(dtype, precision, block_t):
    """``split3``: the prefill projection's three bf16 dots over the k-major split of fn; ``fma``: the decode
    projection on the CUDA cores (``mhc_pre(proj_fma=True)``)."""
    from glm5_kernels.mhc import _mhc_post_kernel, _mhc_pre_row_kernel, _mhc_proj_kernel
    split3, fma = precision == "split3", precision == "fma"
    _compile(_mhc_proj_kernel, dict(x_ptr=dtype, fn_ptr="bf16" if split3 else "fp32", part_ptr="fp32"),
             dict(MIX=24, MIX_PAD=32, SPLITS=8, BLOCK_T=block_t, BLOCK_K=64,
                  PRECISION="tf32x3" if split3 or fma else precision, SPLIT3=split3, FMA=fma))
    _compile(_mhc_pre_row_kernel, dict(x_ptr=dtype, part_ptr="fp32", base_ptr="fp32", scale_ptr="fp32",
                                       w_ptr=dtype, out_ptr=dtype, post_ptr="fp32", comb_ptr="fp32"),
             dict(N=4, MIX=24, MIX_PAD=32, SPLITS=8, SPLITS_P2=8, BLOCK_H=4096, HAS_NORM=True),
             floats=("eps", "norm_eps", "block_eps"))
    _compile(_mhc_post_kernel, dict(y_ptr=dtype, x_ptr=dtype, post_ptr="fp32", comb_ptr="fp32", out_ptr=dtype),
             dict(N=4, BLOCK_H=512))


@pytest.mark.parametrize("dtype,has_add", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_moe_sum_kernel_compiles(dtype, has_add):
    from glm5_kernels.fused_moe import _moe_sum_kernel
    _compile(_moe_sum_kernel, dict(y_ptr=dtype, add_ptr=dtype, out_ptr=dtype),
             dict(TOP_K=8, BLOCK_H=1024, HAS_ADD=has_add))


# bf16/fp32 as before; fp8 experts (bf16 activations) with the decode tile (16 x 256, K spanning two scale blocks)
# and the prefill tile; the w8a8 mode (one 128-channel K step, e4m3 dots accumulated in fp32) with the decode
# tile and the 128-row prefill tile at the stages its launcher keeps (3 of the table's 4). The fp32 fp8 path
# (oracle mode) runs under the interpreter test.
# The pre-quantised w8a8 mode (e4m3 x and h with their scales; h quantised in the gate/up epilogue) with the
# 128-row prefill tile at 4 stages (one-byte A tiles leave room for them) and the swapped decode tile.
@pytest.mark.parametrize("dtype,fp8,block_m,block_k,a_fp8,stages,swap,pre", [
    ("bf16", False, 64, 64, False, 3, False, False), ("fp32", False, 64, 64, False, 3, False, False),
    ("bf16", True, 16, 256, False, 3, False, False), ("bf16", True, 64, 64, False, 3, False, False),
    ("bf16", True, 16, 128, True, 3, False, False), ("bf16", True, 128, 128, True, 3, False, False),
    ("bf16", True, 16, 128, True, 3, True, False), ("bf16", True, 16, 128, True, 5, True, False),
    ("bf16", True, 128, 128, True, 4, False, True), ("bf16", True, 16, 128, True, 4, True, True)])
def test_fused_moe_kernels_compile(dtype, fp8, block_m, block_k, a_fp8, stages, swap, pre):
    from glm5_kernels.fused_moe import _moe_down_kernel, _moe_gate_up_kernel
    common = dict(sorted_ids_ptr="i32", block_expert_ptr="i32", total_ptr="i32")
    w = "fp8e4nv" if fp8 else dtype
    s = "fp32" if fp8 else dtype  # without fp8 the scale pointers are unused placeholders (the weights)
    act = "fp8e4nv" if pre else dtype
    tiles = dict(BLOCK_M=block_m, BLOCK_N=128 if block_m >= 64 or a_fp8 else 64, BLOCK_K=block_k, GROUP_M=8,
                 EVEN_K=True, IEEE=dtype == "fp32", W_FP8=fp8, SB=128, A_FP8=a_fp8, FP8_MAX_=448.0,
                 MIN_AMAX_=1e-12, FP8_ACC=32, SWAP_AB=swap, A_PRE=pre)
    warps = 8 if block_m == 128 else 4
    kernels = [
        _compile(_moe_gate_up_kernel, dict(x_ptr=act, wg_ptr=w, wu_ptr=w, h_ptr=act, sg_ptr=s, su_ptr=s, xs_ptr="fp32",
                                           hs_ptr="fp32", **common),
                 dict(TOP_K=8, H_FP16=False, **tiles), floats=("limit",), num_warps=warps, num_stages=stages),
        _compile(_moe_down_kernel, dict(h_ptr=act, wd_ptr=w, y_ptr=dtype, topk_w_ptr="fp32", sd_ptr=s, hs_ptr="fp32",
                                        **common),
                 tiles, num_warps=warps, num_stages=stages)]
    if swap or pre:
        for kernel in kernels:
            _assert_native_fp8_wgmma(kernel)


def _assert_native_fp8_wgmma(kernel) -> None:
    """The swapped w8a8 dot (``fp8_linear.w8a8_dot``) must compile to Hopper's warpgroup MMA on the e4m3 tiles as
    loaded: the 16-row orientation compiles to ``mma.sync`` with every weight widened to fp16 first."""
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx, "no e4m3 warpgroup MMA in the swapped kernel"
    assert "cvt.rn.f16x2.e4m3x2" not in ptx, "the swapped kernel widens e4m3 tiles before the MMA"


@pytest.mark.parametrize("dtype,block_m,block_n,block_k,split,bias,a_fp8,pdl,swap", [
    ("bf16", 16, 16, 256, 1, False, False, False, False), ("bf16", 16, 64, 256, 4, True, False, False, False),
    ("bf16", 64, 128, 256, 1, True, False, False, False), ("bf16", 16, 128, 128, 1, False, True, False, False),
    ("bf16", 64, 64, 128, 2, True, True, False, False), ("bf16", 16, 16, 32, 1, False, True, False, False),
    ("bf16", 64, 128, 128, 8, False, True, False, False), ("bf16", 16, 128, 128, 4, False, True, True, False),
    ("bf16", 16, 128, 128, 1, False, True, False, True), ("bf16", 16, 64, 128, 4, True, True, False, True),
    ("bf16", 16, 128, 128, 2, False, True, True, True)])
def test_fp8_gemv_kernel_compiles(dtype, block_m, block_n, block_k, split, bias, a_fp8, pdl, swap):
    """W8A16 tiles, and the w8a8 GEMV's (one 128-channel group per K step, or the 32-wide minimum); with PDL;
    the w8a8 tiles also swapped (weights on the MMA's M side, ``SWAP_AB``)."""
    from glm5_kernels.fp8_linear import _fp8_gemv_kernel
    kernel = _compile(_fp8_gemv_kernel, dict(x_ptr=dtype, w_ptr="fp8e4nv", s_ptr="fp32",
                                             y_ptr=dtype if split == 1 else "fp32", b_ptr=dtype if bias else "fp32"),
                      dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, SB=128, HAS_BIAS=bias,
                           EVEN_K=True, IEEE=dtype == "fp32", A_FP8=a_fp8, FP8_MAX_=448.0, MIN_AMAX_=1e-12,
                           FP8_ACC=32, SWAP_AB=swap, USE_PDL=pdl), num_stages=4)
    if swap:
        _assert_native_fp8_wgmma(kernel)


@pytest.mark.parametrize("block_m,block_n,block_k,split,pdl", [(1, 16, 512, 1, False), (1, 8, 512, 2, False),
                                                             (4, 16, 256, 1, False), (1, 8, 1024, 1, True)])
def test_fp8_gemv_fma_kernel_compiles(block_m, block_n, block_k, split, pdl):
    """The FMA GEMV over fp8 weights: the table tiles at M = 1 and a 4-row one (its 3D accumulator must stay in
    registers); with PDL, its first weight tile loaded before ``griddepcontrol.wait``."""
    from glm5_kernels.gemv import _gemv_fma_kernel
    _compile(_gemv_fma_kernel, dict(x_ptr="bf16", w_ptr="fp8e4nv", s_ptr="fp32",
                                    y_ptr="bf16" if split == 1 else "fp32", b_ptr="fp32"),
             dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, SB=128, HAS_BIAS=False,
                  EVEN_K=True, SCALED=True, USE_PDL=pdl), num_stages=2)


@pytest.mark.parametrize("block_m,block_n,block_k,split,even,bias", [(1, 4, 2048, 1, True, False),
                                                                    (4, 4, 512, 2, True, True),
                                                                    (2, 8, 1024, 1, False, False)])
def test_gemv16_kernel_compiles(block_m, block_n, block_k, split, even, bias):
    """The same kernel over bf16 weights (no scales): the default tiles, a split with a bias, a ragged K."""
    from glm5_kernels.gemv import _gemv_fma_kernel
    _compile(_gemv_fma_kernel, dict(x_ptr="bf16", w_ptr="bf16", s_ptr="bf16", y_ptr="bf16" if split == 1 else "fp32",
                                    b_ptr="bf16"),
             dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, SB=128, HAS_BIAS=bias,
                  EVEN_K=even, SCALED=False, USE_PDL=True), num_warps=4, num_stages=4)


@pytest.mark.parametrize("split,out", [(2, "bf16"), (8, "fp32")])
def test_split_sum_kernel_compiles(split, out):
    from glm5_kernels.gemv import _split_sum_kernel
    _compile(_split_sum_kernel, dict(p_ptr="fp32", y_ptr=out), dict(SPLIT=split, BLOCK=1024))


def test_fp8_group_quant_kernel_compiles():
    from glm5_kernels.fp8_linear import _group_quant_kernel
    for block_m, warps in ((1, 1), (16, 4)):
        _compile(_group_quant_kernel, dict(x_ptr="bf16", q_ptr="fp8e4nv", s_ptr="fp32"),
                 dict(GROUP=128, BLOCK_M=block_m, FP8_MAX_=448.0, MIN_AMAX_=1e-12), num_warps=warps)


@pytest.mark.parametrize("block_m,block_n,bias,split", [(64, 128, False, 1), (128, 128, True, 1), (64, 128, True, 8)])
def test_w8a8_gemm_kernel_compiles(block_m, block_n, bias, split):
    from glm5_kernels.fp8_linear import _w8a8_gemm_kernel
    _compile(_w8a8_gemm_kernel, dict(a_ptr="fp8e4nv", as_ptr="fp32", b_ptr="fp8e4nv", bs_ptr="fp32",
                                     c_ptr="bf16" if split == 1 else "fp32", bias_ptr="bf16" if bias else "fp32"),
             dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, HAS_BIAS=bias, SPLIT_K=split))


@pytest.mark.parametrize("fp8", [False, True])
def test_kpool_kernels_compile(fp8):
    from glm5_kernels.kpool import _append_pool_kernel, _append_tail_kernel, _compress_kernel
    keys = "fp8e4nv" if fp8 else "bf16"
    flags = dict(KP=4, D=128, BF16=True, FP8=fp8, PRECISE=True)
    _compile(_compress_kernel, dict(mem_ptr="bf16", ape_ptr="fp32", rows_ptr="i64", keys_ptr=keys, scales_ptr="fp32",
                                    had_ptr="fp32"), flags)
    _compile(_append_pool_kernel, dict(raw_ptr="bf16", pos_ptr="i64", slot_ptr="i64", bt_ptr="i32", tail_ptr="bf16",
                                       ape_ptr="fp32", keys_ptr=keys, scales_ptr="fp32", had_ptr="fp32"), flags)
    _compile(_append_tail_kernel, dict(raw_ptr="bf16", pos_ptr="i64", slot_ptr="i64", tail_ptr="bf16"),
             dict(KP=4, D2=256))


def test_flashinfer_pack_kernel_compiles():
    from glm5_kernels.flashinfer_mla import _pack_indices_kernel
    _compile(_pack_indices_kernel, dict(idx_ptr="i32", indptr_ptr="i32", lens_ptr="i32", out_ptr="i32"),
             dict(BLOCK=1024))
