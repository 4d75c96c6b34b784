"""The streaming GEMV (``glm5_kernels.gemv``) against ``F.linear``, and how 16-bit linears choose it.

CPU: the kernel under ``TRITON_INTERPRET=1`` over fp16 weights at awkward shapes (N not a multiple of the strip,
K not a multiple of the tile, split K, a bias, several rows); fp16 inputs are exact in fp32, so the kernel and a
float64 reference differ by the fp32 summation order and one fp16 output rounding (2^-11 relative): bound 1e-3.
The table choice (nearest M, an entry serving at most its rows, cuBLAS where there is none) and the ``gemv``
backend's routing of :class:`glm5.layers.linear.UnquantizedMethod`.

GPU (``-m gpu``): bf16 at the bench shapes against ``F.linear`` (both fp32 accumulation, each rounds once to
bf16: 2^-9 relative per output, bound 1e-2 as for the fp8 GEMVs), and the kernel inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from interpreter import run_interpreted

INTERPRETER_CODE = """
    import torch
    from glm5_kernels.gemv import gemv16
    g = torch.Generator().manual_seed(0)
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    out = {}
    for n, k in ((200, 300), (37, 64)):
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        bias = torch.randn(n, generator=g).half()
        for m in (1, 3):
            x = torch.randn(m, k, generator=g).half()
            for has_bias in (False, True):
                b = bias if has_bias else None
                ref = x.double() @ w.double().t() + (b.double() if has_bias else 0)
                for bm, bn, bk, split in ((1, 8, 64, 1), (4, 4, 128, 3), (4, 16, 32, 2)):
                    if bm < m:
                        continue
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4,
                           "num_stages": 2}
                    y = gemv16(x, w, b, cfg)
                    assert y.dtype == torch.float16 and y.shape == (m, n)
                    out[f"n{n} k{k} m{m} bias{has_bias} {bm}/{bn}/{bk}/{split}"] = rel(y, ref)
    # leading dimensions and the default tiles
    x = torch.randn(2, 1, 300, generator=g).half()
    w = (torch.randn(200, 300, generator=g) / 300 ** 0.5).half()
    y = gemv16(x, w)
    assert y.shape == (2, 1, 200)
    out["3-D default"] = rel(y, x.double() @ w.double().t())
    print("RESULTS", out)
    assert max(out.values()) < 1e-3, out
"""


def test_gemv16_interpreter_cpu():
    pytest.importorskip("triton")
    run_interpreted(INTERPRETER_CODE, timeout=600)


def test_gemv16_rejects_what_it_cannot_read():
    pytest.importorskip("triton")
    from glm5_kernels.gemv import gemv16
    with pytest.raises(ValueError, match="bf16/fp16 weight"):
        gemv16(torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        gemv16(torch.randn(1, 8).half(), torch.randn(8, 4).half().t())


FMA = {"impl": "gemv_fma", "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
FMA4 = {**FMA, "BLOCK_M": 4, "BLOCK_K": 512}


@pytest.fixture
def fake_table(monkeypatch):
    pytest.importorskip("triton")
    from glm5_kernels import gemv
    monkeypatch.setattr(gemv, "device_name", lambda index: "FAKE")
    table = {(4096, 8192): ((1, FMA), (4, FMA4), (16, {"impl": "torch"})), (154880, 4096): ((1, {"impl": "torch"}),)}
    monkeypatch.setattr(gemv, "load_table16", lambda name: table)
    return gemv


def test_table_choice_nearest_m_within_an_entrys_rows(fake_table):
    cuda = torch.device("cuda", 0)
    sel = fake_table.select16
    assert sel(1, 4096, 8192, cuda) == FMA
    assert sel(2, 4096, 8192, cuda) == FMA4          # nearest is M = 1, but its tiles hold one row
    assert sel(4, 4096, 8192, cuda) == FMA4
    assert sel(8, 4096, 8192, cuda) is None          # the M = 16 entry: cuBLAS was faster
    assert sel(1, 154880, 4096, cuda) is None        # the LM head stays on cuBLAS
    assert sel(1, 4096, 4096, cuda) is None          # a shape the table lacks
    assert sel(1, 4096, 8192, torch.device("cpu")) is None
    assert sel(1, 4096, 8192, cuda) is not sel(1, 4096, 8192, cuda)   # copies: a caller may not edit the table


def test_linear16_takes_the_table_entry_or_f_linear(monkeypatch):
    """``linear16`` runs the kernel with the entry ``select16`` gives for the shape and row count, and
    ``F.linear`` where it gives none, for an fp32 weight, or where the weight or bias cannot be read as the
    kernel reads them (a weight without unit stride along K, a strided bias)."""
    pytest.importorskip("triton")
    from glm5_kernels import gemv
    calls, asked = [], []
    monkeypatch.setattr(gemv, "select16", lambda m, n, k, dev: asked.append((m, n, k)) or (FMA if n == 32 else None))
    monkeypatch.setattr(gemv, "gemv16", lambda x, w, b, cfg: calls.append(cfg) or torch.nn.functional.linear(x, w, b))
    x = torch.randn(2, 3, 64).bfloat16()
    w, w16 = torch.randn(32, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    gemv.linear16(x, w)
    assert calls == [FMA] and asked == [(6, 32, 64)]               # rows of all leading dimensions
    gemv.linear16(x, w16)
    assert len(calls) == 1 and asked[-1] == (6, 16, 64)            # no entry: cuBLAS
    strided_bias = torch.randn(64).bfloat16()[::2]
    for args in ((x.float(), w.float()), (x, torch.randn(64, 32).bfloat16().t()), (x, w, strided_bias)):
        y = gemv.linear16(*args)
        assert len(calls) == 1 and torch.equal(y, torch.nn.functional.linear(*args))
    assert len(asked) == 2                                         # never asked: the kernel could not read them


def test_table_entries_are_validated(tmp_path):
    pytest.importorskip("triton")
    from glm5_kernels import gemv
    gemv.validate_entry16({"impl": "torch"})
    gemv.validate_entry16(FMA)
    with pytest.raises(ValueError, match="impl must be one of"):
        gemv.validate_entry16({"impl": "cublas"})
    with pytest.raises(ValueError, match="BLOCK_K=0 must be a positive int"):
        gemv.validate_entry16({**FMA, "BLOCK_K": 0})
    path = tmp_path / "t.json"
    path.write_text('{"4096,8192": {"1": {"impl": "gemv_fma"}}, "_meta": {}}')
    with pytest.raises(ValueError, match="BLOCK_M=None"):
        gemv.read_table(path, gemv.validate_entry16, "gemv16")
    assert gemv.read_table(tmp_path / "missing.json", gemv.validate_entry16, "gemv16") == {}


def test_committed_tables_load():
    """Every committed 16-bit table parses and validates (a bad entry would fail at the first linear)."""
    pytest.importorskip("triton")
    from glm5_kernels import gemv
    paths = sorted(gemv.CONFIG_DIR.glob("gemv16_*.json"))
    assert paths, "no committed gemv16 table (the H100's is measured: bench/results/gemv16_h100.json)"
    for path in paths:
        table = gemv.read_table(path, gemv.validate_entry16, "gemv16")
        assert table and any(e["impl"] == "gemv_fma" for rows in table.values() for _, e in rows), path


def test_unquantized_linear_routes_by_the_gemv_backend(monkeypatch):
    pytest.importorskip("triton")
    from glm5.layers import backends
    from glm5.layers.linear import Linear
    from glm5_kernels import gemv
    calls = []
    monkeypatch.setattr(gemv, "linear16",
                        lambda x, w, b: calls.append(tuple(w.shape)) or torch.nn.functional.linear(x, w, b))
    lin = Linear(torch.randn(6, 4).bfloat16())
    x = torch.randn(2, 4).bfloat16()
    assert backends.gemv_backend(torch.device("cpu"), torch.bfloat16) == "torch"
    lin(x)
    assert calls == []
    monkeypatch.setattr(backends, "_triton_or_torch", lambda *a, **kw: "triton")   # as on a CUDA GPU
    lin(x)
    assert calls == [(6, 4)]


# ------------------------------------------------------------------------------------------------ GPU
SHAPES = [(2176, 4096), (4096, 8192), (24896, 4096), (4096, 12288), (4096, 4096), (4096, 2048), (4096, 16384)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv16_matches_f_linear_gpu(n, k):
    from glm5_kernels.gemv import default_config16, gemv16, select16
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    for m in (1, 2, 4):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        ref = torch.nn.functional.linear(x.float(), w.float())
        for cfg in (default_config16(m), select16(m, n, k, x.device),
                    {"BLOCK_M": m, "BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}):
            if cfg is None:
                continue
            got = gemv16(x, w, None, cfg)
            assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2, (m, cfg, _rel(got, ref))


@pytest.mark.gpu
def test_gemv16_is_graph_capturable_gpu():
    from glm5_kernels.gemv import gemv16
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    split = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}
    for cfg in (None, split):
        want = gemv16(x, w, None, cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv16(x, w, None, cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), cfg
