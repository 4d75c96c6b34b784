"""The prefill path on the H200: the sparse Triton attention against SDPA and an fp32 reference at the real
MLA shape, and no host synchronisation anywhere in a prefill forward.

``test_sparse_prefill_layer_matches_sdpa_real_shape``: one MLA layer at the real per-layer shapes (64 heads,
d_qk = d_v = 256, kv_lora_rank 512, indexer 32 × 128, kpool 4, top 2048) prefills a 6K-token request in 3K
chunks plus a 1K one (dense), in bf16 through ``attn=triton`` and ``attn=sdpa``, and in fp32 through SDPA (the
reference: same weights, same selection); the sparse path's error against it must be no worse than SDPA's.

``test_prefill_forward_has_no_host_sync``: the tiny checkpoint in bf16 with the CUDA backends (fla KDA,
sparse attention, Triton index / MoE / router / mHC kernels): after a warm-up, a prefill step (a request
from position 0 past the selection threshold, one resuming from cached context, one short run) runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call (``.item()``,
``nonzero``, a blocking host-device copy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glm5.layers import backends

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    backends.reset_backends()


def _one_mla_layer_config() -> dict:
    d = json.loads((ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json").read_text())
    t = d["text_config"]
    t.update(num_hidden_layers=1, layer_types=["deepseek_sparse_attention"], mlp_layer_types=["dense"],
             intermediate_size=1024, vocab_size=4096, num_nextn_predict_layers=0)
    t["linear_attn_config"] = {**t["linear_attn_config"], "kda_layers": [], "full_attn_layers": [0]}
    t.pop("index_topk_pattern", None)
    d.pop("vision_config", None)
    return d


def _prefill_layer(attn: str, dtype: torch.dtype, weights_bf16: dict, x: torch.Tensor) -> torch.Tensor:
    from glm5.cache.hybrid_cache import CacheConfig, HybridCache
    from glm5.config import ModelConfig
    from glm5.layers.batch import ForwardBatch, SeqChunk
    from glm5.layers.mla import MLALayer
    cfg = ModelConfig.from_dict(_one_mla_layer_config())
    weights = {k: (v.to(dtype) if v.dtype == torch.bfloat16 else v) for k, v in weights_bf16.items()}
    layer = MLALayer(weights, 0, cfg.text)
    cache = HybridCache(cfg.text, CacheConfig(block_size=64, num_blocks=128, num_state_slots=2), "cuda", dtype)
    backends.set_backends(attn=attn)
    outs = []
    # request 0: 6144 tokens in two 3072 chunks (blocks 0..95); request 1: 1000 tokens (blocks 100..115)
    for chunks in ([(0, 0, 3072), (1, 0, 1000)], [(0, 3072, 6144)]):
        seqs, rows, start = [], [], 0
        for slot, lo, hi in chunks:
            bt = torch.arange(0, 96, device="cuda") if slot == 0 else torch.arange(100, 116, device="cuda")
            seqs.append(SeqChunk(start, hi - lo, lo, bt, slot))
            rows.append(torch.arange(lo, hi, device="cuda"))
            start += hi - lo
        pos = torch.cat(rows)
        xb = torch.cat([x[slot][lo:hi] for slot, lo, hi in chunks]).to(dtype)
        batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long, device="cuda"), positions=pos,
                             seqs=seqs, logits_indices=torch.zeros(1, dtype=torch.long, device="cuda"))
        outs.append(layer(xb, batch, cache).float())
    return torch.cat(outs)


def test_sparse_prefill_layer_matches_sdpa_real_shape():
    from glm5.config import ModelConfig
    from glm5.weights import dummy_weights
    cfg = ModelConfig.from_dict(_one_mla_layer_config())
    weights = {k: v for k, v in dummy_weights(cfg, "cuda", torch.bfloat16, include_mtp=False).items()
               if k.startswith("layers.0.self_attn")}
    g = torch.Generator(device="cuda").manual_seed(0)
    x = {0: torch.randn(6144, 4096, device="cuda", generator=g), 1: torch.randn(1000, 4096, device="cuda", generator=g)}
    ref = _prefill_layer("sdpa", torch.float32, weights, x)
    sparse = _prefill_layer("triton", torch.bfloat16, weights, x)
    dense = _prefill_layer("sdpa", torch.bfloat16, weights, x)
    err_sparse = ((sparse - ref).norm() / ref.norm()).item()
    err_sdpa = ((dense - ref).norm() / ref.norm()).item()
    print(f"MLA prefill vs fp32 SDPA: sparse triton {err_sparse:.3e}, bf16 sdpa {err_sdpa:.3e}")
    assert torch.isfinite(sparse).all()
    assert err_sparse < 3e-2 and err_sparse <= 2 * err_sdpa + 2e-3


def test_prefill_forward_has_no_host_sync(tmp_path):
    pytest.importorskip("fla")
    from glm5.layers.batch import ForwardBatch, SeqChunk
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    from oracle import engine
    eng = engine(make_tiny_checkpoint(tmp_path / "ckpt"), device="cuda", dtype="bfloat16", max_model_len=512,
                 decode_path="batched", enforce_eager=True)
    dev = torch.device("cuda")
    assert backends.attn_backend(dev, torch.bfloat16, 32) == "triton" and backends.kda_backend(dev, torch.bfloat16) == "fla"
    model, cache = eng.runner.model, eng.runner.cache

    def batch(chunks):
        seqs, pos, start = [], [], 0
        for slot, lo, hi in chunks:
            seqs.append(SeqChunk(start, hi - lo, lo, torch.arange(slot * 8, slot * 8 + 8, device=dev), slot))
            pos.append(torch.arange(lo, hi, device=dev))
            start += hi - lo
        return ForwardBatch(input_ids=torch.randint(0, 600, (start,), device=dev), positions=torch.cat(pos),
                            seqs=seqs, logits_indices=torch.tensor([start - 1], device=dev))

    first = batch([(0, 0, 60), (1, 0, 40), (2, 0, 5)])
    second = batch([(0, 60, 100), (1, 40, 43), (2, 5, 6)])
    with torch.no_grad():
        model.forward(first, cache)                 # warm-up: compiles, autotunes, allocates workspaces
        model.forward(second, cache)
        for slot in (0, 1, 2):
            cache.reset_slot(slot)
        first, second = batch([(0, 0, 60), (1, 0, 40), (2, 0, 5)]), batch([(0, 60, 100), (1, 40, 43), (2, 5, 6)])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out1 = model.forward(first, cache)
            out2 = model.forward(second, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out1.logits).all() and torch.isfinite(out2.logits).all()
