"""The prefix cache's parts on their own: the free list shared by blocks, slots and snapshots; the
reference-counted block table with content keys; chained keys (tokens, media, MTP lookahead); the
state-snapshot pool's copies (mid-block positions included) and its LRU eviction."""

from __future__ import annotations

import pytest
import torch

from glm5.cache.allocator import CacheFullError, FreeList
from glm5.cache.block_manager import BlockManager
from glm5.cache.hybrid_cache import CacheConfig, HybridCache
from glm5.cache.prefix_keys import ROOT_KEY, MediaSpan, TokenChain
from glm5.cache.snapshot_pool import Snapshot, StateSnapshotPool
from glm5.config import ModelConfig


# ---------------------------------------------------------------------------------------------
# FreeList
# ---------------------------------------------------------------------------------------------
def test_free_list_hands_out_empty_ids_before_evicting_the_least_recently_freed_cached_one():
    evicted = []
    fl = FreeList(5, "thing", "get more", on_evict=evicted.append)
    a = fl.allocate(5)
    assert a == [0, 1, 2, 3, 4] and fl.num_free == 0
    with pytest.raises(CacheFullError, match="need 1 things, 0 free; get more"):
        fl.allocate(1)
    fl.free([3, 1], cached=True)      # 3 freed before 1: evicted before it
    fl.free([4])                      # empty: handed out first, no eviction
    assert (fl.num_free, fl.num_cached, fl.num_used) == (3, 2, 2)
    assert fl.allocate(1) == [4] and evicted == []
    fl.touch(3)                       # 3 was just used: now 1 is the least recently used
    assert fl.allocate(1) == [1] and evicted == [1]
    fl.take(3)                        # a hit takes a specific cached id out
    assert not fl.is_free(3) and fl.num_free == 0
    with pytest.raises(ValueError, match="freed twice"):
        fl.free([0, 0])               # the first 0 is returned, the second refused
    fl.free([2], cached=True)
    fl.forget(2)                      # nothing to keep any more: empty, no eviction callback
    assert fl.allocate(2) == [0, 2] and evicted == [1]
    with pytest.raises(ValueError, match="not a free cached thing"):
        fl.take(2)


def test_free_list_capacity_error_names_the_fix():
    with pytest.raises(ValueError, match="state slot capacity 0.*raise max_num_seqs"):
        FreeList(0, "state slot", "raise max_num_seqs")


# ---------------------------------------------------------------------------------------------
# BlockManager
# ---------------------------------------------------------------------------------------------
def test_registered_blocks_are_shared_by_reference_and_stay_cached_in_the_free_pool():
    bm = BlockManager(4)
    a, b = bm.allocate(2)
    bm.register(a, b"k0", ROOT_KEY, [1, 2])
    bm.register(b, b"k1", b"k0", [3, 4])
    assert bm.lookup([b"k0", b"k1", b"k2"]) == [a, b]
    assert bm.lookup([b"k1"]) == [b]      # keys are chained by the caller: a lookup is by exact key
    bm.acquire(a)                          # a second request shares block a
    assert bm.ref_count[a] == 2 and bm.num_used == 2
    bm.free([b, a])
    # a is still referenced; b is cached but free: the cache costs no capacity
    assert bm.num_free == 3 and bm.num_used == 1 and bm.num_cached == 2
    bm.acquire(b)                          # a hit on a free cached block takes it back out
    assert bm.num_free == 2
    bm.free([a, b])
    assert bm.num_free == 4 and bm.lookup([b"k0", b"k1"]) == [a, b]
    # fresh allocations use the two empty blocks first, then evict a (freed before b)
    fresh = bm.allocate(3)
    assert a not in fresh[:2] and b not in fresh[:2] and fresh[2] == a
    assert bm.lookup([b"k0"]) == [] and bm.lookup([b"k1"]) == [b] and bm.num_cached == 1
    assert bm.children(ROOT_KEY) == [] and bm.children(b"k0") == [(3, 4)]


def test_block_registration_rules():
    bm = BlockManager(3)
    x, y = bm.allocate(2)
    assert bm.register(x, b"k", ROOT_KEY, [7])
    assert not bm.register(y, b"k", ROOT_KEY, [7]), "a second block with the same content stays private"
    bm.free([y])
    assert bm.num_cached == 1 and not bm.free_list.is_cached(y)
    with pytest.raises(ValueError, match="not registered"):
        bm.acquire(y)
    with pytest.raises(ValueError, match="must be referenced"):
        bm.register(y, b"other", ROOT_KEY, [8])
    with pytest.raises(ValueError, match="without a reference"):
        bm.free([y])


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------
def chain_of(tokens, bs=4, lookahead=0, media=()):
    c = TokenChain(bs, lookahead, list(media))
    c.update(lambda a, b: tokens[a:b], len(tokens))
    return c


def test_block_keys_are_chained_and_media_sensitive():
    t = list(range(100, 112))
    base = chain_of(t)
    assert len(base.keys) == 3 and base.keys == chain_of(t).keys
    early = chain_of([0] + t[1:])
    assert all(a != b for a, b in zip(base.keys, early.keys)), "a change in block 0 changes every later key"
    late = chain_of(t[:8] + [0] + t[9:])
    assert late.keys[:2] == base.keys[:2] and late.keys[2] != base.keys[2]
    # the same placeholder ids with different image content, or the same image at another position
    img_a, img_b = MediaSpan(5, 7, "aaa"), MediaSpan(5, 7, "bbb")
    ka, kb = chain_of(t, media=[img_a]), chain_of(t, media=[img_b])
    assert ka.keys[0] == kb.keys[0] == base.keys[0], "block 0 holds no media"
    assert ka.keys[1] != kb.keys[1] and ka.keys[2] != kb.keys[2]
    assert chain_of(t, media=[MediaSpan(6, 8, "aaa")]).keys[1] != ka.keys[1]


def test_lookahead_keys_cover_the_next_token():
    t = list(range(12))
    la = chain_of(t, lookahead=1)
    assert len(la.keys) == 2, "block 2 needs token 12, not known yet"
    assert chain_of(t[:4] + [99] + t[5:], lookahead=1).keys[0] != la.keys[0]
    assert chain_of(t[:4] + [99] + t[5:]).keys[0] == chain_of(t).keys[0]
    get = lambda a, b: t[a:b]  # noqa: E731
    s6 = la.snapshot_key(get, 6)
    other = t[:6] + [55] + t[7:]
    assert chain_of(other, lookahead=1).snapshot_key(lambda a, b: other[a:b], 6) != s6
    assert chain_of(other).snapshot_key(lambda a, b: other[a:b], 6) == chain_of(t).snapshot_key(get, 6)


# ---------------------------------------------------------------------------------------------
# StateSnapshotPool
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache(tiny_checkpoint_dir) -> HybridCache:
    cfg = ModelConfig.from_pretrained(str(tiny_checkpoint_dir))
    c = HybridCache(cfg.text, CacheConfig(block_size=8, num_blocks=6, num_state_slots=3), "cpu", torch.float32,
                    mla_layers=list(cfg.text.mla_layer_ids) + [cfg.text.num_hidden_layers])
    g = torch.Generator().manual_seed(0)
    for group in (c.latent, c.pool_keys, c.tail, c.conv, c.recurrent):
        for t in group.values():
            t.copy_(torch.randn(t.shape, generator=g))
    return c


def state_of(c: HybridCache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for g in (c.conv, c.recurrent, c.tail) for t in g.values()]


def test_snapshot_round_trip_restores_state_and_the_partial_block(cache):
    pool = StateSnapshotPool(cache, 2)
    assert pool.nbytes() == 2 * StateSnapshotPool.bytes_per_snapshot(cache)
    before = state_of(cache, 0)
    position = 3 * 8 + 6          # block 3, 6 rows in: 6 latent rows and one complete pool (kpool 4)
    src_block, dst_block = 3, 5
    lat_rows = {i: t[src_block * 8: src_block * 8 + 6].clone() for i, t in cache.latent.items()}
    pool_rows = {i: t[src_block * 2: src_block * 2 + 1].clone() for i, t in cache.pool_keys.items()}
    i = pool.save(Snapshot(b"key", position, b"chain", (1, 2)), state_slot=0, partial_block=src_block)
    assert pool.find(b"key") == i and pool.under(b"chain")[0][0] == i
    pool.restore(i, state_slot=2, partial_block=dst_block)
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(cache, 2)))
    for layer, rows in lat_rows.items():
        assert torch.equal(cache.latent[layer][dst_block * 8: dst_block * 8 + 6], rows)
        assert torch.equal(cache.pool_keys[layer][dst_block * 2: dst_block * 2 + 1], pool_rows[layer])


def test_snapshot_pool_evicts_least_recently_used_and_deduplicates(cache):
    pool = StateSnapshotPool(cache, 2)
    a = pool.save(Snapshot(b"a", 8, b"c", ()), 0, None)
    b = pool.save(Snapshot(b"b", 8, b"c", ()), 1, None)
    assert pool.save(Snapshot(b"a", 8, b"c", ()), 1, None) == a and pool.saved == 2, "same key: no copy"
    pool.restore(a, 2, None)                                   # a used last: b is evicted next
    c = pool.save(Snapshot(b"c", 16, b"c", ()), 0, None)
    assert c == b and pool.find(b"b") is None and pool.find(b"a") == a
    assert {i for i, _ in pool.under(b"c")} == {a, c}
    assert pool.num_free == pool.capacity == 2, "saved snapshots are cached data in the free pool"
    with pytest.raises(ValueError, match="needs the request's partial block"):
        pool.save(Snapshot(b"d", 9, b"c", ()), 0, None)
