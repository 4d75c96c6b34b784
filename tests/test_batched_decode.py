"""The batched, sync-free decode path (the one CUDA graphs capture) against the oracle, on CPU.

``decode_path="batched"`` routes every pure decode step through ``DecodeMeta``: the kpool append /
pool completion, the index scores, the (score, pool id) top-k with expansion and the sparse MLA
decode run once for the whole batch, with their torch references on CPU (the Triton kernels are
checked against the same references in tests/test_kernels_*). Greedy tokens must equal
transformers' and the per-request path's, including past the dense region (position >
index_topk + kpool - 2), where the selection is sparse, and across pool boundaries.
"""

from __future__ import annotations

import pytest
import torch

from glm5.engine.cuda_graph import DecodeRows, DecodeStager
from oracle import engine, engine_greedy, hf_greedy, make_pair, random_prompt
from test_engine_oracle import SHORT_STACK


@pytest.mark.parametrize("kp,topk", [(4, 8), (2, 4), (1, 4)])
def test_batched_decode_matches_transformers(tmp_path, kp, topk):
    ckpt, hf = make_pair(tmp_path, seed=40 + kp, text_overrides={**SHORT_STACK, "index_kpool": kp,
                                                                 "index_topk": topk})
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (1, kp + 1, 2 * topk + 3, 37)]
    eng = engine(ckpt, decode_path="batched")
    assert eng.runner.batched_decode
    for p, got in zip(prompts, engine_greedy(eng, prompts, 40)):
        assert got == hf_greedy(hf, p, 40), f"prompt length {len(p)}"


def test_batched_and_per_request_paths_agree_with_staggered_arrivals(tiny_checkpoint_dir):
    from oracle import greedy

    vocab = 640
    prompts = [random_prompt(n, vocab, seed=200 + n) for n in (2, 9, 17, 33, 64, 90)]
    results = {}
    for path in ("batched", "per_request"):
        eng = engine(tiny_checkpoint_dir, decode_path=path, max_num_seqs=4)
        outs: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        step = 0
        while pending or eng.has_unfinished():
            if pending and step % 3 == 0:  # a new request every third step: decode rows mix with prefills
                i, p = pending.pop(0)
                eng.add_request(f"r{i}", p, greedy(24 + i))
            for o in eng.step():  # outputs carry the new tokens of the step
                outs.setdefault(o.request_id, []).extend(o.token_ids)
            step += 1
        results[path] = outs
    assert results["batched"] == results["per_request"]
    assert sorted(len(v) for v in results["batched"].values()) == [24 + i for i in range(len(prompts))]


def test_padding_rows_touch_only_scratch_cache(tiny_checkpoint_dir):
    """A decode batch padded to a bucket size writes its padding rows to the scratch block/slot only."""
    eng = engine(tiny_checkpoint_dir, decode_path="batched")
    runner = eng.runner
    cache = runner.cache
    for t in list(cache.latent.values()) + list(cache.recurrent.values()) + list(cache.tail.values()):
        t.normal_()
    before = {k: v.clone() for k, v in _cache_tensors(cache).items()}
    slot, blocks = 3, [5, 9]
    rows = DecodeRows(tokens=[7], positions=[20], state_slots=[slot], block_tables=[blocks])
    stager: DecodeStager = runner.stager
    batch = stager.stage(rows, padded=4)
    runner.model.forward(batch, cache)
    bs = cache.block_size
    own_latent_rows = {blocks[20 // bs] * bs + 20 % bs}
    scratch_rows = set(range(cache.scratch_block * bs, (cache.scratch_block + 1) * bs))
    for name, t in _cache_tensors(cache).items():
        changed = (t != before[name]).flatten(1).any(1).nonzero().flatten().tolist()
        if name.startswith(("conv", "recurrent", "tail")):
            assert set(changed) <= {slot, cache.scratch_slot}, (name, changed)
            if not name.startswith("tail"):
                assert slot in changed and cache.scratch_slot in changed, (name, changed)
        elif name.startswith("latent"):
            assert set(changed) <= own_latent_rows | scratch_rows, (name, changed)
            assert own_latent_rows <= set(changed)


def _cache_tensors(cache) -> dict[str, torch.Tensor]:
    out = {}
    for group in ("latent", "pool_keys", "tail", "conv", "recurrent"):
        for layer, t in getattr(cache, group).items():
            out[f"{group}{layer}"] = t
    return out
