"""The cache memory plan (glm5.cache.memory): every cache the engine allocates is counted, the plan
equals the bytes actually allocated, and a configuration that does not fit is refused at start with
the numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from glm5.cache.hybrid_cache import CacheConfig, HybridCache
from glm5.cache.memory import MIB, CacheBudgetError, plan_cache_memory
from glm5.config import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from oracle import engine  # noqa: E402


@pytest.mark.parametrize("index_fp8", [False, True])
@pytest.mark.parametrize("with_mtp", [False, True])
def test_plan_equals_the_bytes_the_hybrid_cache_allocates(tiny_checkpoint_dir: Path, index_fp8: bool,
                                                          with_mtp: bool) -> None:
    cfg = ModelConfig.from_pretrained(tiny_checkpoint_dir).text
    layers = cfg.mla_layer_ids + (cfg.mtp_layer_ids[:1] if with_mtp else [])
    plan = plan_cache_memory(cfg, dtype=torch.float32, block_size=16, max_num_seqs=5, max_model_len=64,
                             budget_bytes=2**30, mla_layers=layers, index_fp8=index_fp8, num_blocks=40)
    cache = HybridCache(cfg, CacheConfig(block_size=16, num_blocks=40, num_state_slots=5), "cpu", torch.float32,
                        mla_layers=layers, index_fp8=index_fp8)
    assert plan.total_bytes == cache.nbytes()          # no encoder cache here: nothing else is allocated
    mtp = set(cfg.mtp_layer_ids)

    def nbytes(group: dict, want_mtp: bool) -> int:
        return sum(t.numel() * t.element_size() for i, t in group.items() if (i in mtp) == want_mtp)

    assert plan.bytes_of("mla_latent") == nbytes(cache.latent, False)
    assert plan.bytes_of("mla_index_pool_keys") == nbytes(cache.pool_keys, False) + nbytes(cache.pool_scales, False)
    assert plan.bytes_of("mla_index_tail") == nbytes(cache.tail, False)
    assert plan.bytes_of("kda_conv_state") == nbytes(cache.conv, False)
    assert plan.bytes_of("kda_recurrent_state") == nbytes(cache.recurrent, False)
    assert plan.bytes_of("mtp_latent") == nbytes(cache.latent, True)
    assert (plan.bytes_of("mtp_latent") > 0) == with_mtp


def test_real_shape_state_slots_are_counted(real_config_path: Path) -> None:
    """At the real shape one KDA state slot is 136 MiB of fp32 recurrent state (34 layers x 64 x 128 x 128 x 4 B)."""
    cfg = ModelConfig.from_pretrained(real_config_path).text
    layers = cfg.mla_layer_ids + cfg.mtp_layer_ids
    plan = plan_cache_memory(cfg, dtype=torch.bfloat16, block_size=64, max_num_seqs=64, max_model_len=4096,
                             budget_bytes=20 * 2**30, mla_layers=layers, encoder_cache_bytes=256 * MIB)
    per_slot = {g.name: g.bytes_per_unit for g in plan.groups if g.unit == "slot"}
    assert per_slot["kda_recurrent_state"] == 136 * MIB
    assert plan.bytes_of("kda_recurrent_state") == 65 * 136 * MIB  # 64 slots + the scratch slot
    assert plan.bytes_of("mtp_latent") > 0 and plan.bytes_of("vision_encoder_cache") == 256 * MIB
    assert plan.total_bytes <= 20 * 2**30
    text = plan.describe()
    assert "kda_recurrent_state" in text and "mtp_latent" in text and "vision_encoder_cache" in text
    # the old sizing (MLA latent + pool keys only) would have put 20 GiB into blocks and ~8.8 GiB on top
    with pytest.raises(CacheBudgetError) as err:
        plan_cache_memory(cfg, dtype=torch.bfloat16, block_size=64, max_num_seqs=64, max_model_len=4096,
                          budget_bytes=2**30, mla_layers=layers, encoder_cache_bytes=0)
    msg = str(err.value)
    assert "cache_memory_gb=1.000" in msg and "65 state slots" in msg and "max_model_len=4096" in msg
    assert "Raise cache_memory_gb to at least" in msg


def test_explicit_block_count_must_fit_the_budget(real_config_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(real_config_path).text
    with pytest.raises(CacheBudgetError, match=r"num_cache_blocks=100000 .* Raise cache_memory_gb"):
        plan_cache_memory(cfg, dtype=torch.bfloat16, block_size=64, max_num_seqs=4, max_model_len=4096,
                          budget_bytes=8 * 2**30, mla_layers=cfg.mla_layer_ids, num_blocks=100_000)
    with pytest.raises(CacheBudgetError, match="free device memory"):
        plan_cache_memory(cfg, dtype=torch.bfloat16, block_size=64, max_num_seqs=4, max_model_len=4096,
                          budget_bytes=8 * 2**30, mla_layers=cfg.mla_layer_ids, device_free_bytes=2**30)


def test_engine_sizes_its_cache_from_the_plan_and_refuses_what_does_not_fit(tiny_checkpoint_dir: Path) -> None:
    eng = engine(tiny_checkpoint_dir, num_cache_blocks=None, cache_memory_gb=0.02, max_model_len=128)
    plan = eng.memory_plan
    assert eng.blocks.num_blocks == plan.num_blocks and plan.total_bytes <= 0.02 * 2**30
    # everything the engine allocated is in the plan: the hybrid cache, the encoder cache bound and the
    # prefix cache's state snapshots (on by default)
    assert eng.kv.snapshots is not None and eng.kv.snapshots.capacity == plan.units_of("prefix_cache_snapshots") > 0
    assert (eng.runner.cache.nbytes() + eng.runner.encoder_cache.max_bytes + eng.kv.snapshots.nbytes()
            == plan.total_bytes)
    assert eng.runner.encoder_cache.max_bytes == plan.bytes_of("vision_encoder_cache") > 0
    with pytest.raises(CacheBudgetError, match="max_num_seqs"):
        engine(tiny_checkpoint_dir, num_cache_blocks=None, cache_memory_gb=0.0001, max_model_len=128)


def test_prefix_cache_snapshots_are_counted_in_the_budget(tiny_checkpoint_dir: Path) -> None:
    """The snapshot pool is sized from its own budget inside cache_memory_gb: one snapshot is one slot's
    states plus one block's rows, as the pool allocates it, and a budget that holds none is refused."""
    from glm5.cache.snapshot_pool import StateSnapshotPool

    eng = engine(tiny_checkpoint_dir, num_cache_blocks=None, cache_memory_gb=0.02, max_model_len=128,
                 prefix_cache_snapshot_memory_gb=0.004)
    plan = eng.memory_plan
    per = StateSnapshotPool.bytes_per_snapshot(eng.runner.cache)
    assert plan.units_of("prefix_cache_snapshots") == int(0.004 * 2**30 // per)
    assert plan.bytes_of("prefix_cache_snapshots") == eng.kv.snapshots.nbytes()
    off = engine(tiny_checkpoint_dir, num_cache_blocks=None, cache_memory_gb=0.02, max_model_len=128,
                 enable_prefix_caching=False)
    assert off.memory_plan.bytes_of("prefix_cache_snapshots") == 0
    assert off.memory_plan.num_blocks > plan.num_blocks      # the snapshots' bytes came out of the blocks
    with pytest.raises(CacheBudgetError, match="holds no state snapshot"):
        engine(tiny_checkpoint_dir, num_cache_blocks=None, cache_memory_gb=0.02, max_model_len=128,
               prefix_cache_snapshot_memory_gb=1e-9)


def test_encoder_cache_is_bounded_in_bytes() -> None:
    from glm5.engine.model_runner import EncoderCache

    cache = EncoderCache(max_bytes=10 * 4 * 8)          # room for 10 rows of 8 fp32
    for i in range(6):
        cache.put(f"k{i}", torch.zeros(3, 8))            # 96 B each: at most 3 fit in 320 B
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 3 and cache.get("k0") is None and cache.get("k5") is not None
    cache.put("huge", torch.zeros(100, 8))              # larger than the whole cache: not kept
    assert cache.get("huge") is None and cache.nbytes <= cache.max_bytes
