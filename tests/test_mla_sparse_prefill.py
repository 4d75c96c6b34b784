"""The MLA layer's sparse prefill path (Triton backend) against its reference path, on the CPU.

``attn_backend="triton"`` gives every prefill / verification chunk per-query latent-row lists from the indexer
(:meth:`KPoolIndexer.prefill_select`) and the sparse absorbed kernel; ``"torch"`` is the reference (selection
mask, expanded K/V, transformers' rounding). Under ``TRITON_INTERPRET=1`` an explicit triton choice runs the
kernels on the CPU, so the whole layer path — selection, ``W_UK``/``W_UV`` batched GEMMs, the kernel — is
compared here in fp32 on the tiny checkpoint: two requests per step, a chunk that starts from 0, one with
cached context crossing the selection threshold (index_topk 16, kpool 4: sparse from position 18), a
short (3-row) run and a single token. The index scoring and selection stay on their torch references here
(the Triton ones are pinned against them in test_kernels_kpool_indexer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import sys, torch
from glm5.layers import backends
from glm5.layers.batch import ForwardBatch, SeqChunk
sys.path.insert(0, sys.argv[2])
from oracle import engine
torch.set_num_threads(1)
eng = engine(sys.argv[1], max_model_len=256)
model, cache = eng.runner.model, eng.runner.cache
g = torch.Generator().manual_seed(0)
ids = {0: torch.randint(0, 600, (40,), generator=g), 1: torch.randint(0, 600, (70,), generator=g)}
tables = {0: torch.arange(0, 4), 1: torch.arange(4, 9)}   # block size 16

def step(chunks):
    seqs, tok, pos, start = [], [], [], 0
    for slot, lo, hi in chunks:
        seqs.append(SeqChunk(start, hi - lo, lo, tables[slot], slot))
        tok.append(ids[slot][lo:hi]); pos.append(torch.arange(lo, hi)); start += hi - lo
    batch = ForwardBatch(input_ids=torch.cat(tok), positions=torch.cat(pos), seqs=seqs,
                         logits_indices=torch.arange(start))
    return model.forward(batch, cache).logits

def run(attn):
    backends.set_backends(attn=attn)
    for slot in (0, 1):
        cache.reset_slot(slot)
    out = [step([(0, 0, 20), (1, 0, 30)]),        # from position 0 (request 1 crosses the threshold at 18)
           step([(1, 30, 66), (0, 20, 23)]),       # 36 rows with context, and a 3-row run
           step([(0, 23, 24), (1, 66, 70)])]       # one token, four rows
    return torch.cat(out)

ref, got = run("torch"), run("triton")
err = ((got - ref).norm() / ref.norm()).item()
same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
print("rel", err, "argmax agreement", same)
assert err < 1e-4 and same == 1.0, (err, same)
print("ok")
"""


def test_sparse_prefill_path_matches_reference_path_interpreter(tiny_checkpoint_dir):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tiny_checkpoint_dir),
                          str(ROOT / "tests")], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_prefill_select_equals_the_visibility_mask(tiny_checkpoint_dir):
    """prefill_select's row lists hold exactly the tokens :meth:`KPoolIndexer.visible` marks (torch path)."""
    from glm5.layers.batch import SeqChunk
    from oracle import engine
    eng = engine(tiny_checkpoint_dir, max_model_len=256)
    layer = next(lay.attn for lay in eng.runner.model.layers if hasattr(lay.attn, "indexer"))
    cache = eng.runner.cache
    g = torch.Generator().manual_seed(3)
    for k in cache.pool_keys.values():
        k.copy_(torch.randn(k.shape, generator=g))
    bt = torch.tensor([5, 2, 7, 0])
    hidden = eng.model_config.text.hidden_size
    for ctx, n in ((0, 12), (0, 40), (25, 30), (50, 3)):
        s = SeqChunk(0, n, ctx, bt, 0)
        x = torch.randn(n, hidden, generator=g)
        q_resid = torch.randn(n, layer.q_lora_rank, generator=g)
        pos = torch.arange(ctx, ctx + n)
        idx, counts = layer.indexer.prefill_select(x, q_resid, s, pos, cache, layer.layer)
        visible = layer.indexer.visible(x, q_resid, s, cache, layer.layer)
        slots = cache.token_slots(bt, torch.arange(ctx + n))
        assert counts.tolist() == visible.sum(1).tolist()
        for i in range(n):
            want = slots[visible[i]].tolist()
            assert idx[i, : counts[i]].tolist() == want, (ctx, n, i)
            assert (idx[i, counts[i]:] == -1).all()
