"""fp8 index-key cache: the Hadamard rotation is exact, quantisation is bounded, and the selected
pools overlap exact mode's (measured at the real indexer shape and through the engine)."""

from __future__ import annotations

import torch

from glm5_kernels.fp8_index_ref import dequantize, encode_keys, fp8_index_scores, hadamard_rotate, quantize_e4m3
from oracle import engine, engine_greedy, random_prompt


def test_hadamard_rotation_preserves_dot_products():
    g = torch.Generator().manual_seed(0)
    for d in (32, 128, 256):
        a, b = torch.randn(50, d, generator=g), torch.randn(70, d, generator=g)
        assert torch.allclose(hadamard_rotate(a) @ hadamard_rotate(b).t(), a @ b.t(), atol=1e-4)


def test_e4m3_quantisation_has_power_of_two_scales_and_bounded_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 128, generator=g) * torch.logspace(-3, 3, 200).unsqueeze(1)
    q, s = quantize_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)          # powers of two
    absmax = x.abs().amax(-1, keepdim=True)
    err = (dequantize(q, s) - x).abs()
    assert (err <= absmax * 2 ** -4 + s * 2 ** -9).all()               # 3 mantissa bits


def _selection_overlap(scores_a: torch.Tensor, scores_b: torch.Tensor, k: int) -> float:
    a = scores_a.topk(k, dim=-1).indices
    b = scores_b.topk(k, dim=-1).indices
    hits = [len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)]
    return sum(hits) / (k * a.shape[0])


def test_topk_overlap_with_exact_mode_at_the_real_indexer_shape():
    """32 heads × 128, 2048 pooled keys, top 512 pools (index_topk 2048 / kpool 4)."""
    g = torch.Generator().manual_seed(2)
    heads, d, pools, n = 32, 128, 2048, 16
    keys = torch.randn(pools, d, generator=g).to(torch.bfloat16)
    q = torch.randn(n, heads, d, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g) * heads ** -0.5
    exact = torch.matmul(w.unsqueeze(-2), torch.relu(q.float() @ keys.float().t() * d ** -0.5)).squeeze(-2)
    keys8, scale = encode_keys(keys)
    fp8 = fp8_index_scores(q, w, keys8, scale, d ** -0.5)
    rel = ((fp8 - exact).norm() / exact.norm()).item()
    overlap = _selection_overlap(exact, fp8, 512)
    print(f"fp8 index scores: relative error {rel:.3e}, top-512 overlap with exact {overlap:.4f}")
    assert rel < 0.05 and overlap > 0.9


def test_engine_in_fp8_index_mode(tiny_checkpoint_dir):
    prompts = [random_prompt(n, 600, seed=n) for n in (30, 60, 90, 120)]
    exact_eng = engine(tiny_checkpoint_dir)
    fp8_eng = engine(tiny_checkpoint_dir, index_cache="fp8")
    exact = engine_greedy(exact_eng, prompts, 16)
    fp8 = engine_greedy(fp8_eng, prompts, 16)
    layer = exact_eng.model_config.text.mla_layer_ids[0]
    assert fp8_eng.runner.cache.pool_keys[layer].dtype == torch.float8_e4m3fn
    scales = fp8_eng.runner.cache.pool_scales[layer]
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    same = sum(a == b for a, b in zip(exact, fp8))
    print(f"fp8 index mode: {same}/{len(prompts)} prompts give exact mode's 16 greedy tokens")
    assert all(len(t) == 16 for t in fp8)
