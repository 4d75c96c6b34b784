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


def _expected_tables(tables: list[list[int]], padded: int, width: int, scratch: int) -> torch.Tensor:
    want = torch.full((padded, width), scratch, dtype=torch.int32)
    for i, t in enumerate(tables):
        want[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return want


def test_stager_writes_block_tables_incrementally_and_exactly():
    """Staging writes only what changed in the host block tables, and the staged rows always equal a
    from-scratch layout (each request's table, scratch past it, padding rows all scratch): lists that grow,
    lists replaced by new ones (preemption, a finished request's row reused), shorter tables on a row that
    held a longer one, one list on several rows (verification), a batch that shrinks and grows again."""
    import types
    cache = types.SimpleNamespace(block_size=4, scratch_block=99, scratch_slot=7)
    st = DecodeStager(cache, max_batch=6, max_blocks=8, device=torch.device("cpu"))
    a, b, c = [1, 2], [10, 11, 12], [20]
    steps = [
        ([a, b, c], 4),
        "grow",                    # a and b gain a block in place (KV cache manager extend)
        ([b, a], 4),               # rows swap: each row now holds another list
        ([b, b, b, c], 5),         # one list on three rows (k + 1 verification rows)
        ([[5]], 2),                # a short new list where long ones were
        ([c, a, b], 6),            # the batch grows again over rows that held padding
        ([list(a), b], 2),         # an equal but new list object
    ]
    for step in steps:
        if step == "grow":
            a.append(3)
            b.append(13)
            tables, padded = [a, b, c], 4
        else:
            tables, padded = step
        rows = DecodeRows(tokens=[0] * len(tables), positions=[len(t) * 4 - 1 for t in tables],
                          state_slots=list(range(len(tables))), block_tables=tables)
        batch = st.stage(rows, padded)
        want = _expected_tables(tables, padded, 8, 99)
        assert torch.equal(st.host_bt[:padded], want), (step, st.host_bt[:padded], want)
        assert torch.equal(batch.decode.block_tables, want), step
        # the latent slot of each row's token: last entry of its table
        assert batch.decode.slot_mapping[: len(tables)].tolist() == [t[-1] * 4 + 3 for t in tables]
    # an unchanged list is not rewritten: a poked entry survives the next step; a grown one gets its tail only
    d = [30, 31]
    rows = DecodeRows(tokens=[0], positions=[7], state_slots=[0], block_tables=[d])
    st.stage(rows, 1)
    st.host_bt[0, 0] = -5
    st.stage(rows, 1)
    assert st.host_bt[0, :3].tolist() == [-5, 31, 99]
    d.append(32)
    st.stage(DecodeRows(tokens=[0], positions=[11], state_slots=[0], block_tables=[d]), 1)
    assert st.host_bt[0, :4].tolist() == [-5, 31, 32, 99]


def test_stager_matches_a_from_scratch_layout_under_random_steps():
    """Random steps (tables growing in place, replaced, shared by rows, batches shrinking and growing, rows
    past a table's blocks): the staged block tables and latent slots equal what a full rewrite gives."""
    import random
    import types
    rng = random.Random(0)
    bs = 4
    cache = types.SimpleNamespace(block_size=bs, scratch_block=99, scratch_slot=7)
    for trial in range(100):
        width, max_batch = rng.randint(1, 10), rng.randint(1, 8)
        st = DecodeStager(cache, max_batch, width, torch.device("cpu"))
        pool = [[rng.randint(0, 50) for _ in range(rng.randint(0, width))] for _ in range(6)]
        for step in range(30):
            for t in pool:
                if rng.random() < 0.3 and len(t) < width:
                    t.append(rng.randint(0, 50))
            if rng.random() < 0.2:
                pool[rng.randrange(6)] = [rng.randint(0, 50) for _ in range(rng.randint(0, width))]
            n = rng.randint(0, max_batch)
            padded = rng.randint(n, max_batch)
            tables = [rng.choice(pool) for _ in range(n)]
            positions = [rng.randint(0, width * bs + 3) for _ in range(n)]
            st.stage(DecodeRows([0] * n, positions, list(range(n)), tables), padded)
            assert torch.equal(st.host_bt[:padded], _expected_tables(tables, padded, width, 99)), (trial, step)
            slots = [t[p // bs] * bs + p % bs if p // bs < len(t) else 99 * bs for t, p in zip(tables, positions)]
            assert st.host_i64[3, :padded].tolist() == slots + [99 * bs] * (padded - n), (trial, step)
