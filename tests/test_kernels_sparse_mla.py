"""Sparse NoPE MLA decode kernel vs its torch reference.

``gpu`` tests run on the H200 at real shapes (64 heads, 512-wide latent, up to 2051 selected rows);
the interpreter test runs the same kernel on CPU under ``TRITON_INTERPRET=1`` at a small shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _case(n: int, h: int, r: int, k: int, slots: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(n, h, r, generator=g).to(device=device, dtype=dtype)
    lat = torch.randn(slots, r, generator=g).to(device=device, dtype=dtype)
    idx = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(n)]).to(device)
    # ragged valid counts: row i keeps k - 7*i entries (>= 1), the rest -1
    for i in range(n):
        idx[i, max(1, k - 7 * i):] = -1
    return q, lat, idx


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,dtype", [(1, 2051, torch.bfloat16), (4, 2051, torch.bfloat16), (3, 100, torch.float32),
                                       (64, 517, torch.bfloat16)])
def test_sparse_mla_decode_matches_reference_gpu(n, k, dtype):
    from glm5_kernels.sparse_mla_decode import sparse_mla_decode
    from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref
    q, lat, idx = _case(n, 64, 512, k, 40000, dtype, "cuda", seed=n * 1000 + k)
    ref = sparse_mla_decode_ref(q.double(), lat.double(), idx, 256 ** -0.5)
    counts = (idx >= 0).sum(1).to(torch.int32)
    for kw in ({}, {"counts": counts}):
        got = sparse_mla_decode(q, lat, idx, 256 ** -0.5, **kw)
        assert torch.isfinite(got).all()
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-3), (kw.keys(), rel)


def test_sparse_mla_decode_interpreter_cpu():
    """Small shape through the Triton interpreter (CPU, fp32); runs in a subprocess so the env var
    is seen before triton is imported. triton is part of the ``test`` extra, so it must import."""
    import triton  # noqa: F401
    code = textwrap.dedent("""
        import torch
        from glm5_kernels.sparse_mla_decode import sparse_mla_decode
        from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 32, generator=g); lat = torch.randn(50, 32, generator=g)
        idx = torch.stack([torch.randperm(50, generator=g)[:37] for _ in range(2)]); idx[1, 20:] = -1
        ref = sparse_mla_decode_ref(q.double(), lat.double(), idx, 0.3)
        got = sparse_mla_decode(q, lat, idx, 0.3, splits=2, block_h=4, block_k=16)
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, rel
        # counts: stop at each row's valid prefix (row 1 has 20; a split that starts past it stays empty)
        counts = torch.tensor([37, 20], dtype=torch.int32)
        got_c = sparse_mla_decode(q, lat, idx, 0.3, splits=3, block_h=4, block_k=16, counts=counts)
        rel_c = ((got_c.double() - ref).norm() / ref.norm()).item()
        assert rel_c < 1e-4, rel_c
        # entries past a count are ignored even when valid: row 0 limited to its first 5
        short = sparse_mla_decode(q, lat, idx, 0.3, splits=2, block_h=4, block_k=16,
                                  counts=torch.tensor([5, 20], dtype=torch.int32))
        ref5 = sparse_mla_decode_ref(q[:1].double(), lat.double(), idx[:1, :5], 0.3)
        assert ((short[:1].double() - ref5).norm() / ref5.norm()).item() < 1e-4
        # bf16 (the kernel upcasts under the interpreter), output in the activation dtype from the combine kernel
        qb, lb = q.bfloat16(), lat.bfloat16()
        got_b = sparse_mla_decode(qb, lb, idx, 0.3, splits=3, block_h=4, block_k=16, counts=counts,
                                  out_dtype=torch.bfloat16)
        ref_b = sparse_mla_decode_ref(qb.double(), lb.double(), idx, 0.3)
        assert got_b.dtype == torch.bfloat16 and ((got_b.double() - ref_b).norm() / ref_b.norm()).item() < 1e-2
        print("ok", rel)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_default_tile_by_gpu_generation(monkeypatch):
    """Hopper (and the CPU interpreter) gets the 64-head tile; 16-bit inputs on an older GPU the smaller one that
    fits its shared memory; fp32 keeps its own tile everywhere."""
    from glm5_kernels import device as dev
    from glm5_kernels import sparse_mla_decode as m
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(dev, "_capability", lambda index: (8, 6))
    assert m.default_config(torch.bfloat16, cuda) == m.PRE_HOPPER_CONFIG
    assert m.default_config(torch.float32, cuda) == m.DEFAULT_CONFIGS[torch.float32]
    assert m.default_config(torch.bfloat16, cpu) == m.DEFAULT_CONFIGS[torch.bfloat16]
    monkeypatch.setattr(dev, "_capability", lambda index: (9, 0))
    assert m.default_config(torch.bfloat16, cuda) == m.DEFAULT_CONFIGS[torch.bfloat16]
    assert m.DEFAULT_CONFIGS[torch.bfloat16].block_h == 64
