"""MTP speculative decoding: exactness against plain decoding, the rejection sampler's distribution,
the MTP layer against a plain re-implementation of model-spec §8, metrics and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from glm5.engine.spec_decode import greedy_verify, rejection_sample
from glm5.layers.batch import ForwardBatch, SeqChunk
from glm5.sampling_params import SamplingParams
from oracle import engine, greedy, make_pair, random_prompt

VOCAB = 600  # below the tiny checkpoint's 640


@pytest.fixture(scope="module")
def spec_ckpt(tmp_path_factory):
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    # kpool 4, topk 16: prompts past ~18 tokens are in the sparse regime
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), seed=5)


def twenty_prompts() -> list[list[int]]:
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 18, 19, 20, 33, 40, 47, 64, 70, 90]
    return [random_prompt(n, VOCAB, seed=1000 + n) for n in lengths]


def test_greedy_speculative_is_token_identical_batched_and_alone(spec_ckpt):
    prompts = twenty_prompts()
    ref = [o.token_ids for o in engine(spec_ckpt).generate(prompts, greedy(24))]
    for k in (1, 2, 3, 5):
        eng = engine(spec_ckpt, num_speculative_tokens=k, max_num_batched_tokens=96)
        batched = [o.token_ids for o in eng.generate(prompts, greedy(24))]
        assert batched == ref, f"k={k} batched"
        assert eng.spec_stats.steps > 0 and sum(eng.spec_stats.proposed) > 0
        alone_eng = engine(spec_ckpt, num_speculative_tokens=k)
        for i in (0, 9, 13, 19):  # short, pool boundary, just past dense, long sparse
            assert alone_eng.generate([prompts[i]], greedy(24))[0].token_ids == ref[i], f"k={k} prompt {i} alone"
        # every cache block and state slot is back after the run
        assert eng.blocks.num_used == 0 and eng.slots.num_free == eng.slots.capacity


def test_speculation_respects_max_tokens_and_stop_tokens(spec_ckpt):
    prompt = random_prompt(30, VOCAB, seed=7)
    ref = engine(spec_ckpt).generate([prompt], greedy(12))[0].token_ids
    eng = engine(spec_ckpt, num_speculative_tokens=3)
    for n in (1, 2, 5, 12):
        out = eng.generate([prompt], greedy(n))[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    stop_id = ref[6]
    first = ref.index(stop_id)
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    out = eng.generate([prompt], p)[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"


def test_seeded_speculative_sampling_is_reproducible(spec_ckpt):
    prompts = twenty_prompts()[:6]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    a = [o.token_ids for o in engine(spec_ckpt, num_speculative_tokens=3).generate(prompts, params)]
    b = [o.token_ids for o in engine(spec_ckpt, num_speculative_tokens=3).generate(prompts[::-1], params[::-1])][::-1]
    assert a == b


def _chi2(observed: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def test_rejection_sampling_distribution_equals_target():
    torch.manual_seed(0)
    v = 6
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.40, 0.05, 0.20, 0.05, 0.10, 0.20])
    g = torch.Generator().manual_seed(1234)
    n = 6000
    counts = torch.zeros(v)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        tok = rejection_sample(torch.stack([p, p]), q[None], [d], g)[0]
        counts[tok] += 1
    stat = _chi2(counts, p * n)
    assert stat < 20.5, f"chi2={stat:.1f} (df=5, p=0.001 critical value 20.5): {counts.tolist()}"
    # and a sampler that ignored the correction would fail the same test
    naive = torch.zeros(v)
    for _ in range(n):
        naive[int(torch.multinomial(q, 1, generator=g))] += 1
    assert _chi2(naive, p * n) > 20.5


def test_greedy_verify_accepts_longest_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 1.0
    assert greedy_verify(logits, [2, 3, 1]) == [2, 3, 1, 4]
    assert greedy_verify(logits, [2, 0, 1]) == [2, 3]
    assert greedy_verify(logits, [0, 3, 1]) == [2]


def reference_mtp(hf, weights: dict, layer: int, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Plain torch model-spec §8 over a whole sequence (positions 0..n-1), with transformers' own MLA +
    kpool indexer and MoE modules carrying the MTP layer's weights. Returns logits [n, V]."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextMoE

    cfg = hf.config.text_config
    mla_idx = cfg.layer_types.index("indexed_attention")
    attn = Glm5NextTextAttention(cfg, mla_idx).eval()
    moe = Glm5NextTextMoE(cfg).eval()
    p = f"layers.{layer}."
    attn.load_state_dict({k[len(p + "self_attn."):]: v for k, v in weights.items() if k.startswith(p + "self_attn.")})
    moe_sd = {k[len(p + "mlp."):]: v for k, v in weights.items()
              if k.startswith(p + "mlp.") and ".experts." not in k}
    moe_sd["experts.gate_up_proj"] = torch.cat([weights[p + "mlp.experts.gate_proj"],
                                                weights[p + "mlp.experts.up_proj"]], dim=1)
    moe_sd["experts.down_proj"] = weights[p + "mlp.experts.down_proj"]
    moe.load_state_dict(moe_sd)

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    e = hf.get_input_embeddings()(next_tokens).clone()
    e[0] = 0.0  # position 0
    u = torch.nn.functional.linear(torch.cat([rms(e, weights[p + "enorm.weight"]),
                                              rms(hidden, weights[p + "hnorm.weight"])], -1), weights[p + "eh_proj.weight"])
    mask = torch.ones(1, u.shape[0], dtype=torch.bool)
    a, _, _ = attn(rms(u, weights[p + "input_layernorm.weight"])[None], attention_mask=mask)
    u = u + a[0]
    u = u + moe(rms(u, weights[p + "post_attention_layernorm.weight"])[None])[0]
    return hf.lm_head(rms(u, weights[p + "shared_head.norm.weight"]))


@torch.no_grad()
def test_mtp_layer_matches_plain_reimplementation(tmp_path):
    ckpt, hf = make_pair(tmp_path, seed=21)
    eng = engine(ckpt, num_speculative_tokens=2)
    mtp = eng.runner.mtp
    n = 50  # kpool 4, topk 16: sparse for the later rows
    ids = torch.tensor(random_prompt(n + 1, VOCAB, seed=3))
    hidden = hf.model.language_model(input_ids=ids[None, :n]).last_hidden_state[0]
    ref = reference_mtp(hf, eng.runner.model.weights, mtp.layer, ids[1:], hidden)
    slot = eng.slots.allocate_one()
    eng.runner.cache.reset_slot(slot)
    blocks = torch.tensor(eng.blocks.allocate(-(-n // eng.args.block_size)))
    batch = ForwardBatch(input_ids=ids[1:], positions=torch.arange(n), seqs=[SeqChunk(0, n, 0, blocks, slot)],
                         logits_indices=torch.arange(n))
    got, _ = mtp.forward(batch, hidden, eng.runner.cache)
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_missing_mtp_weights_is_a_clear_error(tmp_path):
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path, num_mtp_layers=0)
    engine(ckpt)  # fine without speculation
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine(ckpt, num_speculative_tokens=2)


def test_cli_reports_acceptance_metrics(spec_ckpt):
    cmd = [sys.executable, "-m", "glm5.cli", "--log-level", "WARNING", "generate", "--model", str(spec_ckpt),
           "--prompt-ids", "5,6,7,8,9", "--max-tokens", "12", "--temperature", "0", "--dtype", "float32",
           "--device", "cpu", "--ignore-eos", "--json", "--num-speculative-tokens", "3"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    spec = out["speculative"]
    assert spec["num_speculative_tokens"] == 3 and len(spec["acceptance_rate_per_position"]) == 3
    assert spec["steps"] > 0 and 1.0 <= spec["mean_accepted_length"] <= 4.0
    assert len(out["token_ids"]) == 12
