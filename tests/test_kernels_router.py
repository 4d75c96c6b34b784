"""The fused MoE router kernel vs its torch reference (``glm5_kernels.router_ref``).

Interpreter tests (CPU, ``TRITON_INTERPRET=1``) use inputs whose logits are exact in any summation order
(multiples of 1/8 and 1/16), so the kernel must reproduce the reference selection exactly, ties included:
duplicated experts, all-equal scores (the lowest ids win), group ties, several token blocks, the decode
(split-K) and prefill launch shapes, bf16 and fp32. ``gpu`` tests run the real shape (288 experts, hidden
4096, top-8, bf16): the epilogue equals the reference on the kernel's own logits bit for bit, the logits are
the fp32 GEMM's up to summation order, the expert choice agrees with the fp32 router, and CUDA-graph replays
(the semaphores reset themselves) repeat the eager result.
"""

from __future__ import annotations


import pytest
import torch

from interpreter import run_interpreted


def _interpret(body: str, timeout: int = 300) -> str:
    return run_interpreted(body, timeout)


def test_router_kernel_matches_reference_exactly_interpreter():
    _interpret("""
        import torch
        from glm5_kernels.router import RouterWorkspace, router_topk
        from glm5_kernels.router_ref import route_ref
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        ws = RouterWorkspace()
        # (tokens, experts, hidden, top_k, n_group, topk_group, dtype): decode shape with K splits, several
        # prefill token blocks, groups, bf16
        cases = [(5, 24, 1024, 4, 1, 1, torch.float32), (70, 32, 96, 6, 4, 2, torch.float32),
                 (3, 16, 128, 3, 4, 1, torch.bfloat16), (9, 12, 64, 12, 1, 1, torch.float32)]
        # the fused epilogue (last GEMM program of a token block) and the separate select launch
        epilogues = [{"fused": True, "EPI_T": 4}, {"fused": False, "EPI_T": 1, "epi_warps": 1},
                     {"fused": False, "EPI_T": 2, "epi_warps": 2}]
        for (t, e, h, k, ng, tg, dt), epi in [(c, ep) for c in cases for ep in epilogues]:
            x = (torch.randint(-4, 5, (t, h), generator=g).float() / 8).to(dt)
            w = (torch.randint(-3, 4, (e, h), generator=g).float() / 16).to(dt)
            bias = torch.randint(-8, 8, (e,), generator=g).float() / 64
            w[e - 1], bias[e - 1] = w[1], bias[1]                    # duplicated experts tie exactly
            x[0] = 0                                                 # token 0: every score 0.5 ...
            bias[: e // 2] = 0.25                                    # ... and half the experts tie on the bias
            logits = torch.empty(t, e)
            got_w, got_i = router_topk(x, w, bias, k, ng, tg, True, 2.5, ws, logits_out=logits, config=epi)
            want_w, want_i = route_ref(x, w, bias, k, ng, tg, True, 2.5)
            assert torch.equal(logits, x.float() @ w.float().t()), (t, e)
            assert torch.equal(got_i, want_i), (t, e, epi, got_i, want_i)
            torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)
            assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
        assert all(int(b.abs().sum()) == 0 for b in ws._buffers), "semaphores are reset after every launch"
        # token 0 of the last case: all 12 experts chosen, in (score desc, id asc) order
        assert got_i[0].tolist() == want_i[0].tolist()
    """)


def test_route_ref_ties_go_to_lower_ids_and_match_topk_without_ties():
    """The reference is the old topk routing when there are no ties (random fp32: same experts, same
    weights), and breaks ties towards the lower expert / group id when there are."""
    from glm5_kernels.router_ref import route_ref, select_experts_ref
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(40, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g) * 0.1
    weights, experts = route_ref(x, w, bias, 6, 1, 1, True, 2.5)
    scores = (x @ w.t()).sigmoid()
    top = (scores + bias).topk(6, dim=-1).indices
    assert torch.equal(experts, top)
    torch.testing.assert_close(weights, scores.gather(1, top) / scores.gather(1, top).sum(-1, keepdim=True) * 2.5)
    tied = torch.zeros(2, 8)
    _, ids = select_experts_ref(tied, torch.zeros(8), 3, 1, 1, False, 1.0)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    _, ids = select_experts_ref(tied, torch.tensor([0., 0., 1., 1., 0., 0., 1., 1.]), 2, 4, 2, False, 1.0)
    assert ids.tolist() == [[2, 3], [2, 3]]        # groups 1 and 3 tie: group 1 (lower id) is kept first


# ---------------------------------------------------------------------------------------------- GPU
EPILOGUES = {"default": None, "fused": {"fused": True, "EPI_T": 4},
             "select_2rows": {"fused": False, "EPI_T": 2, "epi_warps": 2},
             "split_gemm": {"BLOCK_T": 16, "BLOCK_E": 32, "SPLITS": 4}}


@pytest.mark.gpu
@pytest.mark.parametrize("epi", list(EPILOGUES))
@pytest.mark.parametrize("t", [1, 3, 16, 64, 65, 256, 4096])
def test_router_kernel_real_shape_gpu(t, epi):
    from glm5_kernels.router import RouterWorkspace, router_topk
    from glm5_kernels.router_ref import route_ref, select_experts_ref
    g = torch.Generator(device="cpu").manual_seed(t)
    e, h = 288, 4096
    x = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(e, h, generator=g) * h ** -0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(e, generator=g) * 0.01).cuda()
    ws = RouterWorkspace()
    logits = torch.empty(t, e, device="cuda")
    ep = EPILOGUES[epi]
    got_w, got_i = router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, logits_out=logits, config=ep)
    # the epilogue, exactly: the reference selection on the kernel's own logits
    ref_w, ref_i = select_experts_ref(logits, bias, 8, 1, 1, True, 2.5)
    assert torch.equal(got_i, ref_i)
    # the weights: sigmoid, renormalisation and scaling in fp32 in another operation order (measured on the
    # H200: at most 2.9e-7 relative, about 2 fp32 ulps)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=0)
    # the GEMM: fp32 accumulation of the same bf16 products
    fp32 = x.float() @ w.float().t()
    assert ((logits - fp32).abs().max() / fp32.abs().max()).item() < 1e-5
    # agreement with the fp32 router (same expert set per token)
    _, fp_i = route_ref(x, w, bias, 8, 1, 1, True, 2.5)
    same = (got_i.sort(1).values == fp_i.sort(1).values).all(1)
    print(f"T={t}: expert sets equal to the fp32 router's for {same.float().mean().item():.4%} of tokens")
    assert int((~same).sum()) <= max(1, t // 100)      # a flip needs a near tie (~1e-6 apart)
    assert all(int(b.abs().sum()) == 0 for b in ws._buffers)
    # CUDA-graph replays repeat the eager result (the kernel resets its semaphores)
    out_w, out_i = router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, config=ep)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cw, ci = router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, config=ep)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ci, out_i) and torch.equal(cw, out_w)


@pytest.mark.gpu
def test_router_kernel_groups_gpu():
    """DeepSeek-style groups (8 groups, keep 4) at the real width."""
    from glm5_kernels.router import RouterWorkspace, router_topk
    from glm5_kernels.router_ref import select_experts_ref
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(40, 4096, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(256, 4096, generator=g) * 0.02).to("cuda", torch.bfloat16)
    bias = (torch.randn(256, generator=g) * 0.01).cuda()
    logits = torch.empty(40, 256, device="cuda")
    got_w, got_i = router_topk(x, w, bias, 8, 8, 4, True, 2.5, RouterWorkspace(), logits_out=logits)
    ref_w, ref_i = select_experts_ref(logits, bias, 8, 8, 4, True, 2.5)
    assert torch.equal(got_i, ref_i)
    torch.testing.assert_close(got_w, ref_w, rtol=2e-7, atol=0)
