"""Prefix caching on a CUDA GPU (run on the H200): decode CUDA graphs are unaffected by restored
states, fp32 outputs are token-identical with the cache on and off, and the bf16 / fla path hits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glm5 import trained_tiny_checkpoint as trained_tiny
from glm5.layers import backends
from oracle import engine, greedy, random_prompt

pytestmark = pytest.mark.gpu
VOCAB = 600


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_prefix") / "ckpt")


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    backends._overrides.clear()


def _random_tokens(n: int, seed: int) -> list[int]:
    return random_prompt(n, VOCAB, seed)


def _corpus_tokens(n: int, seed: int) -> list[int]:
    """A window of the trained checkpoint's training stream (text it predicts confidently)."""
    ids = trained_tiny.corpus_ids()
    off = (131 * seed) % (len(ids) - n)
    return ids[off:off + n]


def workload(eng, tokens=_random_tokens) -> tuple[list[list[int]], list[int]]:
    """Shared-system-prompt requests (mid-block end) one after another, then a three-turn conversation."""
    head = tokens(70, 1)
    prompts = [head + tokens(9, 10 + i) for i in range(4)]
    outs = [eng.generate([p], greedy(12))[0] for p in prompts]
    hist = tokens(50, 2)
    for t in range(3):
        o = eng.generate([hist], greedy(12))[0]
        outs.append(o)
        hist = hist + o.token_ids + tokens(6, 20 + t)
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("decode", ["graphs", "eager"])
def test_fp32_cache_on_equals_cache_off_with_decode_graphs(ckpt, decode):
    backends.set_backends(kda="torch")   # fla's fp32 chunked KDA is not token-exact (test_gpu_engine)
    kw = dict(device="cuda", dtype="float32", max_model_len=512, block_size=16, decode_path="batched",
              enforce_eager=decode == "eager")
    on, off = engine(ckpt, **kw), engine(ckpt, enable_prefix_caching=False, **kw)
    assert (on.runner.graphs is not None) == (decode == "graphs")
    got, cached = workload(on)
    ref, none = workload(off)
    assert got == ref
    assert cached[2] >= 0.9 * 70 and cached[5] > 0 and cached[6] > 0 and not any(none)
    kv = on.kv
    assert kv.blocks.num_free == kv.blocks.num_blocks and kv.slots.num_free == kv.slots.capacity
    assert kv.snapshots.num_free == kv.snapshots.capacity


@pytest.fixture(scope="module")
def trained(request) -> Path:
    given = os.environ.get("GLM5_TRAINED_CKPT")
    return Path(given) if given else request.getfixturevalue("trained_checkpoint")


def test_bf16_fla_prefix_cache_hits_and_agrees(trained):
    """bf16 with the default GPU backends (fla KDA), on the trained tiny checkpoint and its own text. A hit
    (and a snapshot taken at a prompt end or junction) is a chunk boundary, so bf16 rounding differs from one
    long chunk; on a random checkpoint that flips near-tied greedy choices (the first H200 run of this test on
    random weights: 2 of 7 requests identical, including requests without a hit), on a model that predicts
    its text confidently the tokens must not change."""
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=512, block_size=16)
    on, off = engine(trained, **kw), engine(trained, enable_prefix_caching=False, **kw)
    got, cached = workload(on, _corpus_tokens)
    ref, _ = workload(off, _corpus_tokens)
    same = sum(a == b for a, b in zip(got, ref))
    print(f"bf16 fla: {same}/{len(got)} requests token-identical with the cache on; cached tokens {cached}")
    assert cached[2] >= 0.9 * 70 and cached[5] > 0
    assert same >= len(got) - 1
