"""Sparse NoPE MLA prefill kernel vs its torch reference, and the selection that feeds it.

The interpreter test runs the kernel on CPU (``TRITON_INTERPRET=1`` in a subprocess) on small shapes with
ragged counts, ``-1`` holes, a strided query and a head-major output view; the ``gpu`` tests run the real
shape on the H200 (64 heads, 512-wide latent, kpool 4, top 2048: up to 2051 rows per query), fed by the
real selection kernels from a 32K-token cache, against the fp64 reference.
"""

from __future__ import annotations


import pytest
import torch

from interpreter import run_interpreted


def _interpret(body: str, timeout: int = 300) -> str:
    return run_interpreted(body, timeout)


def test_sparse_mla_prefill_matches_reference_interpreter():
    """fp32 and bf16 through the interpreter: ragged counts (1 .. W), a -1 inside a valid prefix (skipped),
    entries past a count ignored even when valid, a non-contiguous q_lat and a head-major ``out`` view."""
    _interpret("""
        import torch
        from glm5_kernels.sparse_mla_decode import AttnConfig
        from glm5_kernels.sparse_mla_prefill import sparse_mla_prefill
        from glm5_kernels.sparse_mla_ref import sparse_mla_prefill_ref
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        n, h, r, slots, w = 7, 6, 32, 90, 37
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            q = torch.randn(h, n, r, generator=g).to(dtype).transpose(0, 1)        # strided rows
            lat = torch.randn(slots, r, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(slots, generator=g)[:w] for _ in range(n)]).int()
            counts = torch.tensor([1, 5, 37, 20, 16, 17, 33], dtype=torch.int32)
            idx[3, 4] = -1                                                       # a hole inside row 3's prefix
            ref = sparse_mla_prefill_ref(q.double(), lat.double(), idx, counts, 0.3)
            for cfg in (AttnConfig(block_h=16, block_k=16, num_warps=4), AttnConfig(block_h=4, block_k=8),
                        AttnConfig(block_h=8, block_k=32, num_stages=1)):
                got = sparse_mla_prefill(q, lat, idx, counts, 0.3, config=cfg)
                assert got.dtype == dtype and got.shape == (n, h, r)
                err = ((got.double() - ref).norm() / ref.norm()).item()
                assert err < tol, (dtype, cfg, err)
            out = torch.empty(h, n, r, dtype=dtype)
            got = sparse_mla_prefill(q, lat, idx, counts, 0.3, out=out.transpose(0, 1),
                                     config=AttnConfig(block_h=16, block_k=16, num_warps=4))
            assert ((out.transpose(0, 1).double() - ref).norm() / ref.norm()).item() < tol
            # row 0 (count 1) is exactly its one latent row
            torch.testing.assert_close(got[0].double(), lat[idx[0, 0].long()].double().expand(h, r), rtol=tol, atol=tol)
    """)


def test_sparse_mla_prefill_reference_counts_semantics():
    """The reference itself: row n sees exactly ``idx[n, :counts[n]]`` (entries after a count and -1 ignored)."""
    from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
    g = torch.Generator().manual_seed(1)
    q, lat = torch.randn(3, 2, 8, generator=g), torch.randn(20, 8, generator=g)
    idx = torch.randint(0, 20, (3, 6), generator=g)
    counts = torch.tensor([2, 6, 4])
    got = sparse_mla_prefill_ref(q, lat, idx, counts, 0.5, rows_per_chunk=2)
    for i in range(3):
        want = sparse_mla_decode_ref(q[i:i + 1], lat, idx[i:i + 1, : int(counts[i])], 0.5)
        torch.testing.assert_close(got[i:i + 1], want)


def test_selected_pairs_counts_dense_then_capped():
    from glm5_kernels.indexer_ref import count_selected
    from glm5_kernels.sparse_mla_prefill import selected_pairs
    assert selected_pairs(0, 4, 512, 4) == 1 + 2 + 3 + 4
    for ctx, n in ((0, 3000), (2040, 20), (5000, 7)):
        assert selected_pairs(ctx, n, 512, 4) == sum(count_selected(list(range(ctx, ctx + n)), 512, 4))


# ---------------------------------------------------------------------------------------------- GPU
def _prefill_case(n: int, ctx: int, dtype: torch.dtype, seed: int):
    """A request whose ``ctx`` cached tokens plus ``n`` new ones sit in shuffled 64-token blocks: real index
    scores → select_token_slots (the engine's prefill selection) → idx, counts."""
    from glm5_kernels.indexer import indexer_scores, select_token_slots
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(seed)
    kp, bs, n_select, hi, d, h, r = 4, 64, 512, 32, 128, 64, 512
    total = ctx + n
    nb = total // bs + 1
    bt = torch.randperm(2 * nb, generator=g)[:nb].to(dev, torch.int32)
    pool_keys = torch.randn(2 * nb * (bs // kp), d, generator=g).to(dev, dtype)
    latent = torch.randn(2 * nb * bs, r, generator=g).to(dev, dtype)
    pos = torch.arange(ctx, total, device=dev)
    nc = torch.div(pos + 1, kp, rounding_mode="floor")
    qi = torch.randn(n, hi, d, generator=g).to(dev, dtype)
    wi = torch.randn(n, hi, generator=g).to(dev) * hi ** -0.5
    rows = torch.zeros(n, dtype=torch.int32, device=dev)
    scores = indexer_scores(qi, wi, pool_keys, None, bt[None], rows, nc, bs // kp, d ** -0.5, total // kp)
    counts = torch.empty(n, dtype=torch.int32, device=dev)
    idx = select_token_slots(scores, nc, pos, bt[None], rows, n_select, kp, bs, counts_out=counts)
    q = torch.randn(n, h, r, generator=g).to(dev, dtype)
    return q, latent, idx, counts


@pytest.mark.gpu
@pytest.mark.parametrize("n,ctx,dtype", [(512, 0, torch.bfloat16), (256, 30000, torch.bfloat16),
                                         (300, 1900, torch.bfloat16), (64, 8000, torch.float32)])
def test_sparse_mla_prefill_matches_reference_gpu(n, ctx, dtype):
    """Real shapes (64 heads × 512 latent), selection from real index scores: dense rows (pos < 2051), the
    threshold crossing and capped rows (2051 entries) against the fp64 reference."""
    from glm5_kernels.sparse_mla_prefill import sparse_mla_prefill
    from glm5_kernels.sparse_mla_ref import sparse_mla_prefill_ref
    q, lat, idx, counts = _prefill_case(n, ctx, dtype, seed=n + ctx)
    assert int(counts.max()) <= 2051 and int(counts.min()) >= 1
    got = sparse_mla_prefill(q, lat, idx, counts, 256 ** -0.5)
    ref = sparse_mla_prefill_ref(q.double(), lat.double(), idx, counts, 256 ** -0.5, rows_per_chunk=16)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-4), err
