"""The engine against transformers' glm5_next (fp32, tiny random checkpoints): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from glm5.layers.batch import ForwardBatch, SeqChunk
from oracle import engine, engine_greedy, hf_greedy, make_pair, random_prompt

N_NEW = 64
# A short stack that still has every block kind: KDA, two consecutive MLA layers, dense and MoE FFNs.
SHORT_STACK = {
    "layer_types": ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention", "linear_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_hidden_layers": 4,
    "index_n_heads": 16,  # 4 heads make exact-zero index-score ties frequent; HF breaks them by row shape
}
SWEEP = [(kp, topk) for kp in (1, 2, 4, 16) for topk in (kp, 8, 64) if topk % kp == 0 and topk >= kp]
SWEEP = sorted(set(SWEEP))


def prompt_lengths(kp: int, topk: int) -> list[int]:
    return sorted({n for n in (1, kp - 1, kp, kp + 1, 3 * topk + 5) if n >= 1})


@pytest.mark.parametrize("kp,topk", SWEEP, ids=[f"kpool{kp}-topk{t}" for kp, t in SWEEP])
def test_greedy_matches_transformers_across_kpool_and_topk(tmp_path, kp, topk):
    ckpt, hf = make_pair(tmp_path, seed=kp * 100 + topk, text_overrides={**SHORT_STACK, "index_kpool": kp,
                                                                         "index_topk": topk})
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in prompt_lengths(kp, topk)]
    eng = engine(ckpt, block_size=max(16, kp))
    ours = engine_greedy(eng, prompts, N_NEW)  # all prompts batched together
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, N_NEW), f"prompt length {len(p)}"


def test_prefill_logits_match_transformers(tmp_path):
    ckpt, hf = make_pair(tmp_path, seed=3)
    eng = engine(ckpt)
    vocab = hf.config.text_config.vocab_size
    for n in (1, 7, 40, 101):
        ids = random_prompt(n, vocab, seed=n)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
        slot = eng.slots.allocate_one()
        eng.runner.cache.reset_slot(slot)
        blocks = eng.blocks.allocate(-(-n // eng.args.block_size))
        batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(n),
                             seqs=[SeqChunk(0, n, 0, torch.tensor(blocks), slot)], logits_indices=torch.arange(n))
        got = eng.runner.model.forward(batch, eng.runner.cache).logits
        eng.blocks.free(blocks)
        eng.slots.free([slot])
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, f"prompt length {n}: max relative error {rel:.2e}"


@pytest.mark.parametrize("stack", [
    {"layer_types": ["linear_attention", "deepseek_sparse_attention"] * 2, "mlp_layer_types": ["dense"] * 4,
     "num_hidden_layers": 4},
    {"layer_types": ["deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention", "linear_attention"],
     "mlp_layer_types": ["sparse"] * 4, "num_hidden_layers": 4},
    {**SHORT_STACK, "n_group": 4, "topk_group": 2, "n_routed_experts": 8, "num_experts_per_tok": 2},
    {**SHORT_STACK, "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                           "gate_lower_bound": None, "safe_gate": False}},
], ids=["dense-only", "moe-only", "grouped-routing", "unbounded-kda-gate"])
def test_layer_mixes_match_transformers(tmp_path, stack):
    ckpt, hf = make_pair(tmp_path, seed=11, text_overrides={**stack, "index_kpool": 4, "index_topk": 8})
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (3, 29)]
    for p, got in zip(prompts, engine_greedy(engine(ckpt), prompts, 32)):
        assert got == hf_greedy(hf, p, 32)


def test_default_tiny_checkpoint_matches_transformers(tmp_path):
    ckpt, hf = make_pair(tmp_path)
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=100 + n) for n in (5, 60, 120)]
    for p, got in zip(prompts, engine_greedy(engine(ckpt), prompts, N_NEW)):
        assert got == hf_greedy(hf, p, N_NEW)
