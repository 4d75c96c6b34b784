"""Tensor / expert parallelism pieces that need no second process: the parallel layout's checks, the sharding
table, the sharded loader (each rank reads only its slices; the slices put back together are the full tensors,
fp8 scales included), the memory plan, EPLB placement and routing maps, the fused MoE's expert map."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glm5.config import ModelConfig
from glm5.distributed import ParallelConfig, Ranks
from glm5.distributed.eplb import ExpertMap, initial_placement, rebalance, transfers
from glm5.distributed.parallel_state import ParallelConfigError
from glm5.distributed.sharding import ShardIndex, WeightSharding, check_fp8_alignment, padded_vocab
from glm5.weights import dummy_weights, expected_weight_shapes, load_weights, save_weights
from glm5.weights.memory_plan import rank_cache_bytes, rank_weight_bytes, render_markdown, tensor_bytes
from glm5_kernels.moe_ref import fused_moe_ref

ROOT = Path(__file__).resolve().parents[1]
TEXT = dict(vocab_size=70, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=32, v_head_dim=32, index_topk=8,
            index_head_dim=32, index_n_heads=4, index_kpool=4, linear_head_dim=16, linear_num_heads=4, hc_mult=2,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_nextn_predict_layers=1)
CFG = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": TEXT})


def ranks(pc: ParallelConfig) -> list[Ranks]:
    return [Ranks.of(r, pc) for r in range(pc.world_size)]


# ------------------------------------------------------------------------------------------------ layout
def test_layout_rank_coordinates_and_replicas():
    pc = ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4)
    assert pc.world_size == 4 and pc.attention_replicas == 2
    assert [(r.tp_rank, r.replica, r.ep_rank) for r in ranks(pc)] == [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)]
    assert ParallelConfig.from_args(tensor_parallel_size=4, enable_expert_parallel=True).expert_parallel_size == 4


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel_size=2, expert_parallel_size=3), "multiple of tensor_parallel_size"),
    (dict(tensor_parallel_size=4, expert_parallel_size=2), "use expert_parallel_size=4"),
    (dict(enable_eplb=True), "need expert parallelism"),
    (dict(tensor_parallel_size=2, expert_parallel_size=2, ep_dispatch="deepep"), "ep_dispatch"),
])
def test_layout_errors_name_the_fix(kw, match):
    with pytest.raises(ParallelConfigError, match=match):
        ParallelConfig(**kw)


def test_model_split_errors_name_the_value():
    with pytest.raises(ParallelConfigError, match="does not divide num_attention_heads=4"):
        ParallelConfig(tensor_parallel_size=3).check_model(CFG.text)
    with pytest.raises(ParallelConfigError, match="does not divide the 9 physical experts"):
        ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, num_redundant_experts=1,
                       enable_eplb=True).check_model(CFG.text)


# ------------------------------------------------------------------------------------------------ sharding table
@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=4),
                                dict(tensor_parallel_size=2, expert_parallel_size=2),
                                dict(tensor_parallel_size=1, expert_parallel_size=2, num_redundant_experts=2,
                                     enable_eplb=True)])
def test_shards_tile_every_tensor(kw):
    """Range shards of all TP ranks tile the split dim (vocab padded), replicated tensors are whole, and the EP
    ranks' expert lists together hold every logical expert."""
    pc = ParallelConfig(**kw)
    shardings = [WeightSharding(CFG, pc, r) for r in ranks(pc)]
    for name, shape in expected_weight_shapes(CFG).items():
        idx = [s.index(name, shape) for s in shardings]
        if idx[0].indices is not None:
            held = sorted({e for i in idx for e in i.indices})
            assert held == list(range(CFG.text.n_routed_experts)), name
            continue
        if idx[0].dim is None:
            assert all(i.dim is None for i in idx), name
            continue
        tp = pc.tensor_parallel_size
        first = idx[:tp]  # one TP group
        size = padded_vocab(shape[0], tp) if name in ("embed_tokens.weight", "lm_head.weight") else shape[idx[0].dim]
        assert [(i.start, i.stop) for i in first] == [(r * size // tp, (r + 1) * size // tp) for r in range(tp)], name


def test_layer_parts_split_as_documented():
    s = WeightSharding(CFG, ParallelConfig(tensor_parallel_size=2), Ranks.of(1, ParallelConfig(tensor_parallel_size=2)))
    full = expected_weight_shapes(CFG)
    cases = {"layers.0.self_attn.q_proj.weight": 0, "layers.0.self_attn.A_log": 0, "layers.0.self_attn.o_proj.weight": 1,
             "layers.0.self_attn.f_a_proj.weight": None, "layers.1.self_attn.kv_b_proj.weight": 0,
             "layers.1.self_attn.q_a_proj.weight": None, "layers.1.self_attn.indexer.wq_b.weight": 0,
             "layers.1.self_attn.indexer.wk.weight": None, "layers.1.mlp.experts.down_proj": 2,
             "layers.1.mlp.shared_experts.down_proj.weight": 1, "layers.1.mlp.gate.weight": None,
             "layers.4.eh_proj.weight": None, "layers.0.hc_attn_fn": None}
    for name, dim in cases.items():
        assert s.index(name, full[name]).dim == dim, name


def test_fp8_alignment_check_names_the_weight():
    check_fp8_alignment("w", ShardIndex(0, 256, 512), (1024, 640), (128, 128))
    with pytest.raises(ParallelConfigError, match=r"w: the shard \[96, 192\) of dim 0"):
        check_fp8_alignment("w", ShardIndex(0, 96, 192), (384, 640), (128, 128))


# ------------------------------------------------------------------------------------------------ sharded loading
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    w = dummy_weights(CFG, dtype=torch.float32, seed=3)
    out = {}
    for layout in ("original", "packed"):
        d = tmp_path_factory.mktemp(layout)
        save_weights(w, d, layout=layout, max_shard_bytes=200_000)
        (d / "config.json").write_text('{"model_type": "glm5_next", "text_config": %s}' % __import__("json").dumps(TEXT))
        out[layout] = d
    return w, out


def _assemble(parts: list[torch.Tensor], idx: list[ShardIndex], full: torch.Tensor) -> torch.Tensor:
    if idx[0].dim is None:
        return parts[0]
    return torch.cat(parts, dim=idx[0].dim).narrow(idx[0].dim, 0, full.shape[idx[0].dim])


@pytest.mark.parametrize("layout", ["original", "packed"])
def test_sharded_load_reassembles_the_full_checkpoint(saved, layout):
    full, dirs = saved
    pc = ParallelConfig(tensor_parallel_size=2)
    shards = [(s, load_weights(dirs[layout], CFG, progress=False, sharding=s))
              for s in (WeightSharding(CFG, pc, r) for r in ranks(pc))]
    for name, t in full.items():
        idx = [s.index(name, tuple(t.shape)) for s, _ in shards]
        parts = [w[name] for _, w in shards]
        assert all(tuple(p.shape) == i.local_shape(tuple(t.shape)) for p, i in zip(parts, idx)), name
        assert torch.equal(_assemble(parts, idx, t), t), name
    emb = shards[1][1]["embed_tokens.weight"]           # vocab 70 over 2 ranks: 35 rows each, no padding
    assert emb.shape[0] == 35


def test_expert_parallel_load_reads_only_the_ranks_experts(saved):
    full, dirs = saved
    pc = ParallelConfig(tensor_parallel_size=1, expert_parallel_size=2, num_redundant_experts=2, enable_eplb=True)
    p2l = initial_placement(8, 2)
    for r in ranks(pc):
        w = load_weights(dirs["original"], CFG, progress=False, sharding=WeightSharding(CFG, pc, r))
        mine = p2l[r.ep_rank * 5:(r.ep_rank + 1) * 5]
        assert torch.equal(w["layers.1.mlp.experts.up_proj"], full["layers.1.mlp.experts.up_proj"][mine])
        assert torch.equal(w["layers.1.self_attn.q_b_proj.weight"], full["layers.1.self_attn.q_b_proj.weight"])


def test_vocab_padding_rows_are_zero(saved):
    full, dirs = saved
    pc = ParallelConfig(tensor_parallel_size=4)                    # 70 rows -> 4 x 18, last rank 16 real + 2 pad
    w = load_weights(dirs["original"], CFG, progress=False, sharding=WeightSharding(CFG, pc, Ranks.of(3, pc)))
    head = w["lm_head.weight"]
    assert head.shape[0] == 18 and torch.equal(head[:16], full["lm_head.weight"][54:]) and not head[16:].any()


def test_fp8_shard_gets_each_elements_own_block_scale(tmp_path):
    """A TP shard of a block-scaled fp8 weight that starts inside a 128-row block dequantizes exactly like the
    same rows of the whole weight (the scale slice covers the touched blocks, offset by the shard start)."""
    from safetensors.torch import load_file, save_file

    text = dict(TEXT, hidden_size=64, intermediate_size=320)     # 320 / 2 = 160: rank 1 starts mid-block
    cfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    w = dummy_weights(cfg, dtype=torch.float32, seed=1)
    save_weights(w, tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "glm5_next", "text_config": %s}' % __import__("json").dumps(text))
    t = load_file(str(tmp_path / "model.safetensors"))
    key = "model.language_model.layers.0.mlp.gate_proj.weight"
    rows, cols = t[key].shape
    scale = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128)) + 0.5
    t[key] = (t[key] * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    t[key + "_scale_inv"] = scale
    save_file(t, str(tmp_path / "model.safetensors"))
    whole = load_weights(tmp_path, cfg, progress=False)["layers.0.mlp.gate_proj.weight"]
    pc = ParallelConfig(tensor_parallel_size=2)
    parts = [load_weights(tmp_path, cfg, progress=False, sharding=WeightSharding(cfg, pc, r))
             ["layers.0.mlp.gate_proj.weight"] for r in ranks(pc)]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(parts[1][:96], whole[:96])  # sanity: rank 1 really holds other rows


# ------------------------------------------------------------------------------------------------ memory plan
def test_memory_plan_counts_what_the_sharded_dummy_weights_allocate():
    for kw in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2)):
        pc = ParallelConfig(**kw)
        for r in ranks(pc):
            w = dummy_weights(CFG, dtype=torch.bfloat16, sharding=WeightSharding(CFG, pc, r))
            assert rank_weight_bytes(CFG, pc, "bf16", r.rank).total == sum(t.numel() * t.element_size()
                                                                           for t in w.values())


def test_memory_plan_fp8_counts_block_scales_and_docs_hold_its_tables():
    assert tensor_bytes("layers.1.mlp.shared_experts.up_proj.weight", (200, 300), CFG, "fp8") == 200 * 300 + 4 * 2 * 3
    assert tensor_bytes("layers.0.self_attn.o_proj.weight", (64, 64), CFG, "fp8") == 2 * 64 * 64  # KDA: bf16
    real = ModelConfig.from_pretrained(ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json")
    tp8 = ParallelConfig(tensor_parallel_size=8)
    per_rank = rank_weight_bytes(real, tp8, "fp8", 1).total
    assert 38 * 2**30 < per_rank < 40 * 2**30                      # 1/8 of the ~306 GiB fp8 checkpoint
    assert rank_cache_bytes(real, tp8).per_token == 12 * 2 * (512 + 32)
    assert render_markdown(real) in (ROOT / "docs" / "parallelism.md").read_text()


# ------------------------------------------------------------------------------------------------ EPLB
def test_rebalance_replicates_hot_experts_and_balances_ranks():
    load = [100.0, 1, 1, 1, 50, 1, 1, 1]
    current = initial_placement(8, 2)
    new = rebalance(load, current, 2)
    assert sorted(set(new)) == list(range(8)) and len(new) == 10
    assert new.count(0) >= 2                                       # the hottest expert got a copy
    per_copy = [load[e] / new.count(e) for e in new]
    ranks_load = [sum(per_copy[:5]), sum(per_copy[5:])]
    assert max(ranks_load) / (sum(ranks_load) / 2) < 1.2
    assert rebalance(load, current, 2) == new                      # deterministic
    assert rebalance([1.0] * 8, list(range(8)), 2) == list(range(8))  # balanced: nothing moves
    for s, ks, d, j in transfers(current, new, 2):
        assert current[s * 5 + ks] == new[d * 5 + j] and new[d * 5 + j] not in current[d * 5:(d + 1) * 5]


def test_expert_map_routes_to_replicas_and_counts_load():
    m = ExpertMap.build(initial_placement(4, 2), 4, ep_rank=1, ep_size=2, device=torch.device("cpu"))
    logical = torch.tensor([[0, 1], [0, 2], [0, 3]])
    phys = m.to_physical(logical, count_load=True)
    assert torch.equal(m.physical_to_logical[phys], logical)     # every pair lands on a copy of its expert
    assert len(set(phys[:, 0].tolist())) == 2                     # expert 0's tokens spread over its two copies
    assert int(m.load.sum()) == 6 and m.local_of_physical.tolist() == [-1, -1, -1, 0, 1, 2]


def test_moe_reference_partials_over_an_expert_map_sum_to_the_whole():
    g = torch.Generator().manual_seed(0)
    t, e, h, i, k = 11, 6, 16, 24, 2
    x = torch.randn(t, h, generator=g)
    wg, wu, wd = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    whole = fused_moe_ref(x, wg, wu, wd, w, ids, 3.0)
    parts = []
    for r in range(2):
        emap = torch.full((e,), -1, dtype=torch.long)
        emap[r * 3:(r + 1) * 3] = torch.arange(3)
        parts.append(fused_moe_ref(x, wg[r * 3:(r + 1) * 3], wu[r * 3:(r + 1) * 3], wd[r * 3:(r + 1) * 3], w, ids,
                                   3.0, expert_map=emap))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_fused_moe_expert_map_interpreter_cpu():
    """The Triton fused MoE with an expert map (pairs of other ranks' experts skipped) under TRITON_INTERPRET."""
    import triton  # noqa: F401
    code = textwrap.dedent("""
        import torch
        from glm5_kernels.fused_moe import fused_moe
        from glm5_kernels.moe_ref import fused_moe_ref
        g = torch.Generator().manual_seed(0)
        t, e, h, i, k = 9, 6, 32, 32, 2
        x = torch.randn(t, h, generator=g)
        wg, wu = torch.randn(e, i, h, generator=g) / 6, torch.randn(e, i, h, generator=g) / 6
        wd = torch.randn(e, h, i, generator=g) / 6
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        emap = torch.tensor([-1, 0, -1, 1, 2, -1])
        local = [1, 3, 4]
        got = fused_moe(x, wg[local], wu[local], wd[local], w, ids, 3.0, expert_map=emap)
        ref = fused_moe_ref(x, wg[local], wu[local], wd[local], w, ids, 3.0, expert_map=emap)
        assert (got - ref).abs().max() < 1e-4, (got - ref).abs().max()
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("inter,kept", [(256, True), (320, False)])
def test_fp8_shards_stay_fp8_on_the_block_grid(tmp_path, inter, kept):
    """quantization=auto: a TP shard on the 128 grid keeps the checkpoint's e4m3 slice and exactly its scale
    blocks; a shard off the grid (320 / 2 = 160 rows) is dequantized instead, to the same values."""
    from safetensors.torch import load_file, save_file

    text = dict(TEXT, intermediate_size=inter)
    cfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    save_weights(dummy_weights(cfg, dtype=torch.float32, seed=2), tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "glm5_next", "text_config": %s}' % __import__("json").dumps(text))
    t = load_file(str(tmp_path / "model.safetensors"))
    key = "model.language_model.layers.0.mlp.gate_proj.weight"
    rows, cols = t[key].shape
    t[key] = (t[key] * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    t[key + "_scale_inv"] = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128)) + 0.5
    save_file(t, str(tmp_path / "model.safetensors"))
    name = "layers.0.mlp.gate_proj.weight"
    whole = load_weights(tmp_path, cfg, progress=False, quantization="auto")
    assert whole[name].dtype == torch.float8_e4m3fn
    pc = ParallelConfig(tensor_parallel_size=2)
    half = rows // 2
    for r in ranks(pc):
        w = load_weights(tmp_path, cfg, progress=False, quantization="auto", sharding=WeightSharding(cfg, pc, r))
        if kept:
            assert w[name].dtype == torch.float8_e4m3fn and torch.equal(
                w[name].view(torch.uint8), whole[name][r.rank * half:(r.rank + 1) * half].view(torch.uint8))
            assert torch.equal(w[name + "_scale_inv"], whole[name + "_scale_inv"][r.rank * half // 128:
                                                                                 (r.rank + 1) * half // 128])
        else:
            assert name + "_scale_inv" not in w and w[name].dtype == torch.float32
            full = load_weights(tmp_path, cfg, progress=False)[name]
            assert torch.equal(w[name], full[r.rank * half:(r.rank + 1) * half])


def test_one_rank_groups_skip_their_collectives_unless_asked():
    """A gloo world of one: every collective and the driver's step message are the identity without launching
    (as vLLM's collectives are at size 1); with ``collectives_at_size_one`` (the bench's measurement of their
    cost) they run, with the same results."""
    code = textwrap.dedent("""
        import datetime
        import torch
        import torch.distributed as dist
        from glm5.distributed import ParallelConfig
        from glm5.distributed.parallel_state import build_context, destroy_parallel_context, join_world
        from glm5.engine.worker_processes import free_port
        store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 1, is_master=True,
                              timeout=datetime.timedelta(seconds=60))
        backend, control = join_world(0, 1, torch.device("cpu"), store)
        par = build_context(ParallelConfig(), 0, backend, control)
        x = torch.arange(12.0).view(3, 4)
        def all_of(par):
            return [par.tp_all_reduce(x.clone()), par.tp_all_gather(x), par.ep_all_reduce(x.clone()),
                    par.ep_reduce_scatter_gather(x), par.ep_all_gather(x)[0], par.broadcast(x.clone()),
                    par.ep_all_to_all(x, [3], [3]), par.broadcast_object(x)]
        skipped = all_of(par)
        par.barrier()
        assert par.distributed and par.collective_calls == 0
        par.collectives_at_size_one = True
        launched = all_of(par)
        par.barrier()
        assert par.collective_calls == 9, par.collective_calls
        assert all(torch.equal(a, x) and torch.equal(b, x) for a, b in zip(skipped, launched))
        destroy_parallel_context(par)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
