"""Fused MoE kernels vs their torch reference, the device-side token alignment, config selection.

The interpreter test runs both Triton kernels on CPU under ``TRITON_INTERPRET=1`` at small shapes
(including an expert nobody is routed to, ragged tails along K and N, top-1/2/3); ``gpu`` tests run
bf16 and fp32 on the H200 plus a CUDA-graph capture/replay with routing changed in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glm5_kernels.fused_moe import (default_config, down_config, fused_moe, max_padded_rows, moe_align_block_size,
                                    select_config, validate_config)

from glm5_kernels.moe_ref import fused_moe_ref

ROOT = Path(__file__).resolve().parent.parent


def _routing(t: int, e: int, k: int, g: torch.Generator, skip: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (like top-k), optionally never choosing expert ``skip``."""
    pool = [i for i in range(e) if i != skip]
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, w


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (5, 288, 8, 16), (200, 6, 4, 32),
                                           (64, 16, 1, 64)])
def test_alignment_is_a_padded_permutation(t, e, k, block_m):
    g = torch.Generator().manual_seed(t * 31 + e)
    ids, _ = _routing(t, e, k, g, skip=e - 1)
    r = moe_align_block_size(ids, e, block_m)
    n = t * k
    sid = r.sorted_ids
    assert sid.numel() == max_padded_rows(n, e, block_m) and sid.numel() % block_m == 0
    assert r.block_expert.numel() == sid.numel() // block_m
    total = int(r.total_rows.item())
    assert total % block_m == 0 and total <= sid.numel()
    # every (token, slot) pair exactly once, in the used region only; everything else is padding
    valid = sid < n
    assert valid[total:].sum() == 0 and (sid[~valid] == n).all()
    assert torch.equal(torch.sort(sid[valid]).values, torch.arange(n, dtype=sid.dtype))
    # each block holds pairs of one expert only, the expert the block says
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    for b in range(total // block_m):
        rows = sid[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n].long()
        assert rows.numel() > 0, "a used block with only padding"
        assert (flat[rows] == int(r.block_expert[b])).all()
    # stable: token order within an expert
    for ex in range(e):
        rows = sid[valid][flat[sid[valid].long()] == ex]
        assert torch.equal(rows, torch.sort(rows).values)
    assert (r.block_expert >= 0).all() and (r.block_expert < e).all()


def test_config_selection_nearest_with_ties_to_smaller():
    table = tuple((m, {"BLOCK_SIZE_M": 16 * (i + 1), "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                       "num_warps": 4, "num_stages": 3}) for i, m in enumerate((1, 8, 64, 512)))
    assert select_config(table, 1)["BLOCK_SIZE_M"] == 16
    assert select_config(table, 3)["BLOCK_SIZE_M"] == 16    # |3-1| < |3-8|
    assert select_config(table, 36)["BLOCK_SIZE_M"] == 32   # tie 8 vs 64 → smaller
    assert select_config(table, 37)["BLOCK_SIZE_M"] == 48
    assert select_config(table, 100000)["BLOCK_SIZE_M"] == 64
    picked = select_config(table, 1)
    picked["BLOCK_SIZE_M"] = 999                             # a fresh copy: the cached table is untouched
    assert table[0][1]["BLOCK_SIZE_M"] == 16


def test_default_config_is_valid_and_small_for_decode():
    for t in (1, 8, 64, 512, 4096, 16384):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = default_config(t, 8, 288, dtype)
            validate_config(cfg)
            assert set(down_config(cfg)) == set(cfg) - {"down"}
    assert default_config(1, 8, 288)["BLOCK_SIZE_M"] == 16
    assert default_config(16384, 8, 288)["BLOCK_SIZE_M"] >= 64
    with pytest.raises(ValueError, match="power of two"):
        validate_config({**default_config(1, 8, 288), "BLOCK_SIZE_M": 8})
    with pytest.raises(ValueError, match="BLOCK_SIZE_M is shared"):
        validate_config({**default_config(1, 8, 288), "down": {"BLOCK_SIZE_M": 32}})


def test_rejects_bad_shapes():
    x = torch.randn(3, 40)
    w = torch.randn(4, 32, 40)
    ids = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="multiples of 16"):
        fused_moe(x, w, w, torch.randn(4, 40, 32), torch.ones(3, 1), ids, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(torch.randn(3, 32), torch.randn(4, 32, 32, dtype=torch.float64), torch.randn(4, 32, 32),
                  torch.randn(4, 32, 32), torch.ones(3, 1), ids, 1.0)


def test_fused_moe_interpreter_cpu():
    """Both kernels through the Triton interpreter (fp32, ieee dots) vs the fp64 reference; runs in a
    subprocess so TRITON_INTERPRET is set before triton is imported."""
    import triton  # noqa: F401
    code = textwrap.dedent("""
        import torch
        from glm5_kernels.fused_moe import fused_moe, moe_sum
        from glm5_kernels.moe_ref import fused_moe_ref, moe_sum_ref
        g = torch.Generator().manual_seed(0)
        def case(t, e, h, i, k, limit, config=None):
            x = torch.randn(t, h, generator=g) * 2
            wg = torch.randn(e, i, h, generator=g) / h ** 0.5
            wu = torch.randn(e, i, h, generator=g) / h ** 0.5
            wd = torch.randn(e, h, i, generator=g) / i ** 0.5
            pool = torch.arange(e - 1)                      # expert e-1 gets no tokens
            ids = torch.stack([pool[torch.randperm(e - 1, generator=g)[:k]] for _ in range(t)])
            w = torch.rand(t, k, generator=g)
            got = fused_moe(x, wg, wu, wd, w, ids, limit, config=config)
            ref = fused_moe_ref(x, wg, wu, wd, w, ids, limit, compute_dtype=torch.float64)
            assert got.dtype == torch.float32 and got.shape == (t, h)
            rel = ((got.double() - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, (t, e, h, i, k, config, rel)
            gate = torch.einsum("eih,th->tei", wg, x)       # the clamps must bite, or they go untested
            assert ((gate > limit).float().mean() > 0.1) == (limit < 10), (gate > limit).float().mean()
            return rel
        rels = [case(t, 8, 32, 64, k, 0.7) for t in (1, 5, 37) for k in (2, 3)]
        small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 2,
                 "num_warps": 4, "num_stages": 2, "down": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32}}
        rels.append(case(37, 8, 48, 80, 3, 0.7, small))     # K and N tails: 48 % 32, 80 % 32
        rels.append(case(37, 8, 48, 80, 1, 0.7, small))     # top-1: no reduction
        rels.append(case(20, 4, 32, 32, 3, 1e4))            # clamp inactive
        # the shared expert's output added in the slot-sum launch: the same as adding it afterwards (fp32)
        x = torch.randn(5, 48, generator=g)
        wg, wu = torch.randn(2, 8, 80, 48, generator=g) / 48 ** 0.5
        wd = torch.randn(8, 48, 80, generator=g) / 80 ** 0.5
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(5)])
        w, add = torch.rand(5, 3, generator=g), torch.randn(5, 48, generator=g)
        for k_ids in (ids, ids[:, :1]):
            plain = fused_moe(x, wg, wu, wd, w[:, : k_ids.shape[1]], k_ids, 0.7, config=small)
            # before_add (a caller's join of the stream computing add) runs once, after the expert GEMMs
            import glm5_kernels.fused_moe as fm
            calls, moe_down = [], fm.moe_down
            fm.moe_down = lambda *a, **kw: (calls.append("down"), moe_down(*a, **kw))[1]
            both = fused_moe(x, wg, wu, wd, w[:, : k_ids.shape[1]], k_ids, 0.7, config=small, add=add,
                             before_add=lambda: calls.append("join"))
            fm.moe_down = moe_down
            assert calls == ["down", "join"], calls
            assert torch.allclose(both, plain + add, rtol=1e-6, atol=1e-6), (both - plain - add).abs().max()
        slots = torch.randn(5 * 3, 48, generator=g)
        assert torch.equal(moe_sum(slots, 3, add), moe_sum_ref(slots, 3, add)) and torch.equal(moe_sum(slots, 3),
                                                                                             moe_sum_ref(slots, 3))
        print("ok", max(rels))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_reference_matches_moe_loop_semantics():
    """fused_moe_ref is the routed part of MoE.__call__ (same per-expert loop, fp32 here)."""
    g = torch.Generator().manual_seed(1)
    t, e, h, i, k = 9, 5, 16, 24, 2
    x = torch.randn(t, h, generator=g)
    wg, wu = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    wd = torch.randn(e, h, i, generator=g)
    ids, w = _routing(t, e, k, g)
    want = torch.zeros(t, h)
    for tok in range(t):
        for s in range(k):
            ex = int(ids[tok, s])
            gate, up = wg[ex] @ x[tok], wu[ex] @ x[tok]
            hid = torch.nn.functional.silu(gate.clamp(max=3.0)) * up.clamp(-3.0, 3.0)
            want[tok] += w[tok, s] * (wd[ex] @ hid)
    torch.testing.assert_close(fused_moe_ref(x, wg, wu, wd, w, ids, 3.0), want, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------------ GPU

def _gpu_case(t: int, e: int, h: int, i: int, k: int, dtype: torch.dtype, seed: int, limit: float = 10.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    wg = (torch.randn(e, i, h, device="cuda", generator=g) * h ** -0.5 * 3).to(dtype)
    wu = (torch.randn(e, i, h, device="cuda", generator=g) * h ** -0.5 * 3).to(dtype)
    wd = (torch.randn(e, h, i, device="cuda", generator=g) * i ** -0.5).to(dtype)
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(t, k, device="cuda", generator=g)
    return x, wg, wu, wd, w, ids, limit


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
def test_fused_moe_bf16_matches_reference_gpu(t):
    # real E / I / top-k; H=1024 keeps the experts at 3.6 GB and the fp64 reference quick
    args = _gpu_case(t, 288, 1024, 2048, 8, torch.bfloat16, seed=t, limit=4.0)
    got = fused_moe(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 1024) and torch.isfinite(got).all()
    ref = fused_moe_ref(*args, compute_dtype=torch.float64)
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(fused_moe(*args), got, rtol=0, atol=0)  # run-to-run deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 300])
def test_fused_moe_fp32_ieee_matches_reference_gpu(t):
    args = _gpu_case(t, 64, 1024, 512, 8, torch.float32, seed=100 + t, limit=4.0)
    got = fused_moe(*args)
    ref = fused_moe_ref(*args, compute_dtype=torch.float64)
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 8), (64, 8), (4096, 8), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_sum_with_shared_add_is_two_roundings_gpu(t, k, dtype):
    """The slot sum plus the shared expert's output in one launch equals, bit for bit, the fp32 slot-order sum
    rounded to the dtype and then the dtype add (``y.sum(1) + shared``); and without ``add`` the sum alone."""
    from glm5_kernels.fused_moe import moe_sum
    from glm5_kernels.moe_ref import moe_sum_ref
    g = torch.Generator(device="cuda").manual_seed(t * 10 + k)
    y = torch.randn(t * k, 4096, device="cuda", generator=g).to(dtype)
    add = torch.randn(t, 4096, device="cuda", generator=g).to(dtype)
    assert torch.equal(moe_sum(y, k), moe_sum_ref(y, k))          # slot order, fp32, one rounding
    assert torch.equal(moe_sum(y, k, add), moe_sum_ref(y, k, add))
    torch.testing.assert_close(moe_sum(y, k), y.view(t, k, 4096).sum(1), rtol=1e-2 if dtype != torch.float32 else 1e-6,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.gpu
def test_fused_moe_all_tokens_on_few_experts_gpu():
    """Worst-case imbalance: every token picks the same 8 experts (one long group per expert)."""
    x, wg, wu, wd, w, ids, limit = _gpu_case(1000, 288, 1024, 512, 8, torch.bfloat16, seed=7)
    ids = torch.arange(280, 288, device="cuda").expand(1000, 8).contiguous()
    got = fused_moe(x, wg, wu, wd, w, ids, limit)
    ref = fused_moe_ref(x, wg, wu, wd, w, ids, limit, compute_dtype=torch.float64)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 256])
def test_fused_moe_cuda_graph_replay_with_new_routing_gpu(t):
    x, wg, wu, wd, w, ids, limit = _gpu_case(t, 288, 1024, 512, 8, torch.bfloat16, seed=11 + t)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles kernels, loads the config table) off the capture
        fused_moe(x, wg, wu, wd, w, ids, limit)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, wg, wu, wd, w, ids, limit)
    # new inputs in place: different tokens, weights, and a much more skewed routing
    g = torch.Generator(device="cuda").manual_seed(999)
    x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype))
    w.copy_(torch.rand(w.shape, device="cuda", generator=g))
    skew = torch.rand(t, 288, device="cuda", generator=g)
    skew[:, :16] += 1.0                                    # most pairs land on 16 experts
    ids.copy_(skew.topk(8, dim=-1).indices)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(x, wg, wu, wd, w, ids, limit)
    assert torch.equal(out, eager)
    ref = fused_moe_ref(x, wg, wu, wd, w, ids, limit, compute_dtype=torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
