"""FlashInfer backend: sparse NoPE MLA decode and sampling vs the torch references.

``gpu`` tests run on the H200 with flashinfer-python installed (docs/gpu.md, "FlashInfer
(optional)"); they build FlashInfer's JIT modules on first use. The CPU tests check the fail-fast
paths: an explicit FlashInfer setting must raise with the reason when the library is missing or the
tensors are not on CUDA, never fall back silently.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from glm5.layers import backends


# ------------------------------------------------------------------------------------------ CPU tests
@pytest.fixture
def _clean_backends():
    backends.reset_backends()
    backends.import_error.cache_clear()
    yield
    backends.reset_backends()
    backends.import_error.cache_clear()


def test_explicit_flashinfer_on_cpu_fails_fast(_clean_backends):
    backends.set_backends(decode_attn="flashinfer", sampling="flashinfer")
    with pytest.raises(backends.BackendUnavailable, match="decode_attn_backend='flashinfer'.*not on a CUDA device"):
        backends.decode_attn_backend(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(backends.BackendUnavailable, match="sampling_backend='flashinfer'.*not on a CUDA device"):
        backends.sampling_backend(torch.device("cpu"))


def test_explicit_flashinfer_missing_library_fails_fast(_clean_backends, monkeypatch):
    """With flashinfer unimportable, asking for it on a CUDA device names the import error (no CUDA call is
    made before the check, so this runs on a CPU-only machine too)."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    backends.set_backends(decode_attn="flashinfer", sampling="flashinfer")
    with pytest.raises(backends.BackendUnavailable, match=r"flashinfer'.*cannot run: .*Error.*flashinfer"):
        backends.decode_attn_backend(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(backends.BackendUnavailable, match=r"Install flashinfer-python"):
        backends.sampling_backend(torch.device("cuda"))
    backends.set_backends(decode_attn="auto", sampling="auto")
    assert backends.sampling_backend(torch.device("cuda")) == "torch"  # auto never picks a missing library


def test_flashinfer_mla_class_refuses_cpu():
    from glm5_kernels.flashinfer_mla import FlashInferSparseMLA, flashinfer_mla_unavailable_reason

    reason = flashinfer_mla_unavailable_reason("cpu")
    assert reason is not None and ("not a CUDA device" in reason or "does not import" in reason)
    with pytest.raises(RuntimeError, match="FlashInferSparseMLA cannot run: .*(CUDA|import)"):
        FlashInferSparseMLA(64, 4, 16, 0.1, device="cpu")


def test_flashinfer_sample_input_checks_cpu():
    from glm5.flashinfer_sampling import _row_tensors, flashinfer_sample

    with pytest.raises(ValueError, match="CUDA tensor"):
        flashinfer_sample(torch.zeros(2, 8), [1.0, 1.0], [0, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match="row 1: temperature 0.0 <= 0 is greedy"):
        _row_tensors(2, 8, [1.0, 0.0], [0, 0], [1.0, 1.0], None, torch.device("cpu"))
    with pytest.raises(ValueError, match="top_ks has 1 entries but logits have 2 rows"):
        _row_tensors(2, 8, [1.0, 1.0], [0], [1.0, 1.0], None, torch.device("cpu"))
    temp, k, p, mp = _row_tensors(3, 8, [0.5, 1.0, 2.0], [0, -1, 8], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0],
                                  torch.device("cpu"))
    assert temp.tolist() == [0.5, 1.0, 2.0] and k is None and p is None and mp is None  # all filters off
    _, k, p, mp = _row_tensors(2, 8, [1.0, 1.0], [3, 0], [0.5, 1.0], [0.0, 0.2], torch.device("cpu"))
    assert k.tolist() == [3, 8] and p.tolist() == [0.5, 1.0] and mp.tolist() == pytest.approx([0.0, 0.2])


# ------------------------------------------------------------------------------------------ GPU: MLA
H, R, K_MAX, SLOTS = 64, 512, 2051, 1 << 20
SCALE = 256 ** -0.5


@pytest.fixture(scope="module")
def fi_mla():
    from glm5_kernels.flashinfer_mla import FlashInferSparseMLA

    return FlashInferSparseMLA(H, 256, K_MAX, SCALE, head_dim=R, dtype=torch.bfloat16, device="cuda")


@pytest.fixture(scope="module")
def latent():
    g = torch.Generator(device="cuda").manual_seed(1234)
    return torch.randn(SLOTS, R, device="cuda", dtype=torch.bfloat16, generator=g)


def _selection(counts: list[int], k: int, seed: int) -> torch.Tensor:
    """[N, k] int32: row n holds counts[n] distinct random slots, then -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, SLOTS, (len(counts), k), device="cuda", dtype=torch.int32, generator=g)
    cols = torch.arange(k, device="cuda")
    return torch.where(cols[None, :] < torch.tensor(counts, device="cuda")[:, None], idx, -1).to(torch.int32)


def _counts(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(1, K_MAX + 1, (n,), generator=g).tolist()
    c[0] = K_MAX            # full selection
    if n > 1:
        c[-1] = 1           # a single token (the row's own)
    if n > 2:
        c[1] = 2            # tiny, to hit the short-row path
    return c


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,rows_per_req", [(1, 1), (1, 4), (8, 1), (8, 3), (64, 1), (64, 4)])
def test_flashinfer_mla_matches_reference(fi_mla, latent, batch, rows_per_req):
    from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref

    n = batch * rows_per_req
    seed = 100 * batch + rows_per_req
    counts = _counts(n, seed)
    idx = _selection(counts, K_MAX, seed)
    q = torch.randn(n, H, R, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(seed))
    fi_mla.plan(counts)
    got = fi_mla.run(q, latent, idx)
    assert got.shape == (n, H, R) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    ref = torch.cat([sparse_mla_decode_ref(q[i:i + 16].double(), latent, idx[i:i + 16], SCALE) for i in range(0, n, 16)])
    rel = _rel(got, ref)
    row_rel = ((got.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item()
    print(f"batch={batch} rows/req={rows_per_req} counts[min,max]=[{min(counts)},{max(counts)}] rel={rel:.2e} "
          f"worst_row_rel={row_rel:.2e}")
    assert rel <= 2e-2, rel
    assert row_rel <= 2e-2, row_rel


@pytest.mark.gpu
def test_flashinfer_mla_cuda_graph_replay_after_replan(fi_mla, latent):
    """Capture run() once, re-plan with different counts (same row count, a padding row included), write
    new inputs into the static tensors and replay: the graph must read the refreshed schedule."""
    from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref

    n = 24
    q = torch.empty(n, H, R, device="cuda", dtype=torch.bfloat16)
    idx = torch.empty(n, K_MAX, device="cuda", dtype=torch.int32)

    def load(seed: int, counts: list[int]) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(n, H, R, device="cuda", generator=g).to(torch.bfloat16))
        idx.copy_(_selection(counts, K_MAX, seed))

    counts_a = _counts(n, 7)
    load(7, counts_a)
    fi_mla.plan(counts_a)
    out = fi_mla.run(q, latent, idx)  # warm (JIT, allocator) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi_mla.run(q, latent, idx)
    for seed in (8, 9):
        counts_b = _counts(n, seed)
        counts_b[5] = 0  # a CUDA-graph padding row: all -1, planned as one slot
        load(seed, counts_b)
        fi_mla.plan(counts_b)
        graph.replay()
        torch.cuda.synchronize()
        real = [i for i in range(n) if counts_b[i] > 0]
        ref = sparse_mla_decode_ref(q[real].double(), latent, idx[real], SCALE)
        rel = _rel(out[real], ref)
        print(f"graph replay seed={seed} rel={rel:.2e}")
        assert rel <= 2e-2, rel
        assert torch.isfinite(out[5]).all()


@pytest.mark.gpu
def test_flashinfer_mla_rejects_bad_calls(latent):
    from glm5_kernels.flashinfer_mla import FlashInferSparseMLA

    with pytest.raises(ValueError, match="workspace_bytes=16777216 < .* needed"):
        FlashInferSparseMLA(H, 4, 16, SCALE, head_dim=R, device="cuda", workspace_bytes=16 << 20)
    m = FlashInferSparseMLA(H, 4, 16, SCALE, head_dim=R, device="cuda")
    q = torch.zeros(2, H, R, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(2, 16, device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError, match="before plan"):
        m.run(q, latent, idx)
    with pytest.raises(ValueError, match=r"counts span \[1, 17\]"):
        m.plan([1, 17])
    with pytest.raises(ValueError, match="5 rows planned"):
        m.plan([1] * 5)
    with pytest.raises(ValueError, match="pass host counts"):
        m.plan(torch.tensor([1, 2], device="cuda"))
    m.plan([3, 4])
    with pytest.raises(ValueError, match="re-plan"):
        m.run(q[:1], latent, idx[:1])
    with pytest.raises(ValueError, match="must both be torch.bfloat16"):
        m.run(q.float(), latent, idx)


# ------------------------------------------------------------------------------------------ GPU: sampling
def _chi2_pvalue(stat: float, df: int) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, df))
    except ImportError:  # Wilson-Hilferty normal approximation
        z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))


# (temperature, top_k, top_p, min_p): each config exercises one FlashInfer path.
_SAMPLING_CONFIGS = [
    (0.8, 0, 1.0, 0.0),     # plain draw (sampling_from_logits)
    (1.0, 6, 1.0, 0.0),     # top-k only
    (1.3, 0, 0.7, 0.0),     # top-p only
    (0.9, 10, 0.8, 0.0),    # top-k then top-p (fused rejection sampler)
    (1.1, 0, 0.9, 0.05),    # min-p path (with top-p)
    (1.0, 12, 1.0, 0.02),   # min-p path (with top-k)
]


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["one-config-per-call", "mixed-batch"])
def test_flashinfer_sampling_distribution_matches_torch_sampler(mixed):
    """Chi-square goodness of fit of FlashInfer's draws against the torch sampler's exact distribution
    (softmax of Sampler.process_logits), V = 32; filtered tokens must never be drawn."""
    from glm5.flashinfer_sampling import flashinfer_sample
    from glm5.sampler import Sampler
    from glm5.sampling_params import SamplingParams

    vocab, reps, calls = 32, 2048, 50
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(len(_SAMPLING_CONFIGS), vocab, device="cuda", generator=g) * 2.0
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in _SAMPLING_CONFIGS]
    expected = torch.softmax(Sampler().process_logits(base, params, output_token_ids=[[] for _ in params]), dim=1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.zeros(len(params), vocab, dtype=torch.float64, device="cuda")
    groups = [list(range(len(params)))] if mixed else [[c] for c in range(len(params))]
    for rows in groups:
        logits = base[rows].repeat_interleave(reps, dim=0)
        cfg = [_SAMPLING_CONFIGS[c] for c in rows for _ in range(reps)]
        for _ in range(calls):
            ids = flashinfer_sample(logits, [c[0] for c in cfg], [c[1] for c in cfg], [c[2] for c in cfg],
                                    [c[3] for c in cfg], generator=gen)
            assert ids.dtype == torch.int64 and ids.shape == (len(cfg),)
            for j, c in enumerate(rows):
                counts[c] += torch.bincount(ids[j * reps:(j + 1) * reps], minlength=vocab).double()
    n = reps * calls
    for c, cfg in enumerate(_SAMPLING_CONFIGS):
        exp = expected[c].double() * n
        live = exp > 0
        assert counts[c][~live].sum().item() == 0, f"config {cfg}: drew a filtered token"
        stat = (((counts[c][live] - exp[live]) ** 2) / exp[live]).sum().item()
        df = int(live.sum().item()) - 1
        pval = _chi2_pvalue(stat, df) if df > 0 else 1.0
        print(f"config {cfg}: kept {df + 1} tokens, chi2={stat:.1f} df={df} p={pval:.3g}")
        assert pval > 1e-4, (cfg, stat, df)


@pytest.mark.gpu
def test_flashinfer_sampling_uses_the_given_generator():
    from glm5.flashinfer_sampling import flashinfer_sample

    logits = torch.randn(64, 1000, device="cuda")
    draws = []
    for _ in range(2):
        gen = torch.Generator(device="cuda").manual_seed(42)
        draws.append(flashinfer_sample(logits, [1.0] * 64, [50] * 64, [0.9] * 64, generator=gen))
    assert torch.equal(draws[0], draws[1])
    other = flashinfer_sample(logits, [1.0] * 64, [50] * 64, [0.9] * 64,
                              generator=torch.Generator(device="cuda").manual_seed(43))
    assert not torch.equal(draws[0], other)


# ----------------------------------------------------------------------------- inside the engine
def _engine_at_rank_512(tmp_path, **kw):
    """Tiny checkpoint with the real latent width (FA3 takes 128/256/512, the default tiny one has 32)."""
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    from oracle import engine
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt_rank512", text_overrides={"kv_lora_rank": 512})
    return engine(ckpt, device="cuda", dtype="bfloat16", max_model_len=1024, num_cache_blocks=600,
                  decode_path="batched", **kw)


@pytest.mark.gpu
def test_engine_decode_step_flashinfer_matches_triton_and_torch(tmp_path, _clean_backends):
    """One batched decode step of the whole model (random caches, positions in the dense and the sparse
    region, a pool boundary) through each decode-attention backend: logits within bf16 tolerance."""
    from glm5.engine.cuda_graph import DecodeRows
    eng = _engine_at_rank_512(tmp_path, enforce_eager=True)
    runner, cache = eng.runner, eng.runner.cache
    gen = torch.Generator(device="cuda").manual_seed(0)
    for group, scale in ((cache.latent, 1.0), (cache.pool_keys, 1.0), (cache.tail, 1.0), (cache.conv, 0.5),
                         (cache.recurrent, 0.02)):
        for t in group.values():
            t.copy_(scale * torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))
    saved = [t.clone() for g in (cache.latent, cache.pool_keys, cache.tail, cache.conv, cache.recurrent)
             for t in g.values()]
    positions = [0, 3, 15, 16, 40, 200, 513, 1000]
    rows = DecodeRows(tokens=[5 * i + 1 for i in range(8)], positions=positions, state_slots=list(range(8)),
                      block_tables=[list(range(64 * i, 64 * i + 64)) for i in range(8)])
    logits = {}
    for backend in ("torch", "triton", "flashinfer"):
        for t, s in zip((t for g in (cache.latent, cache.pool_keys, cache.tail, cache.conv, cache.recurrent)
                         for t in g.values()), saved):
            t.copy_(s)
        backends.set_backends(decode_attn=backend)
        batch = runner.stager.stage(rows, len(positions))
        runner._prepare_decode(batch)
        logits[backend] = runner.model.forward(batch, cache).logits.float()
    for backend in ("triton", "flashinfer"):
        rel = _rel(logits[backend], logits["torch"])
        print(f"decode step logits, {backend} vs torch reference: rel {rel:.2e}")
        assert rel < 2e-2, (backend, rel)


@pytest.mark.gpu
def test_engine_flashinfer_graph_replay_equals_eager(tmp_path, _clean_backends):
    """decode_attn=flashinfer end to end: planned outside the captured graphs, replayed inside; the greedy
    tokens equal the eager run's (same kernels, same plan)."""
    from oracle import engine_greedy, random_prompt
    backends.set_backends(decode_attn="flashinfer")
    prompts = [random_prompt(n, 640, seed=n) for n in (3, 40, 130)]
    outs = {}
    for name, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        eng = _engine_at_rank_512(tmp_path / name, **kw)
        assert (eng.runner.graphs is not None) == (name == "graphs")
        outs[name] = engine_greedy(eng, prompts, 24)
    assert outs["graphs"] == outs["eager"]
