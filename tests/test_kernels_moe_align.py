"""The one-launch MoE token alignment (``glm5_kernels.moe_align``) equals ``moe_align_block_size`` exactly.

Same sorted pair order (stable by expert, then pair), padding, per-block expert and padded total, for decode
batch shapes (1 .. 128 tokens × top-8 of 288), duplicated tokens (every expert of one token shared with
another), tiny expert counts and block sizes 1 .. 64; on the CPU through the interpreter and at the real
shapes on the H200, where ``align_routing`` picks the kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

_CHECK = """
import torch
from glm5_kernels.fused_moe import align_routing, max_padded_rows, moe_align_block_size
from glm5_kernels.moe_align import moe_align_small
torch.set_num_threads(1)

def check(cases, device):
    g = torch.Generator().manual_seed(0)
    for t, k, e, bm in cases:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
        if t > 2:
            ids[1] = ids[0]
        ref = moe_align_block_size(ids, e, bm)
        s, b, tot = moe_align_small(ids, e, bm, max_padded_rows(t * k, e, bm))
        assert torch.equal(s, ref.sorted_ids) and torch.equal(b, ref.block_expert), (t, k, e, bm)
        assert torch.equal(tot, ref.total_rows), (t, k, e, bm)
        got = align_routing(ids, e, bm)
        assert torch.equal(got.sorted_ids, ref.sorted_ids) and got.num_pairs == ref.num_pairs
"""


def test_moe_align_small_matches_reference_interpreter():
    code = textwrap.dedent(_CHECK) + textwrap.dedent("""
        check([(1, 8, 288, 16), (3, 8, 288, 16), (64, 8, 288, 64), (5, 2, 8, 4), (7, 3, 5, 1), (128, 8, 288, 32)],
              "cpu")
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_align_routing_keeps_the_torch_ops_on_cpu_and_for_large_batches():
    from glm5_kernels.fused_moe import align_routing, moe_align_block_size
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(300)])     # 1200 pairs > MAX_PAIRS
    a, b = align_routing(ids, 16, 8), moe_align_block_size(ids, 16, 8)
    assert torch.equal(a.sorted_ids, b.sorted_ids) and torch.equal(a.block_expert, b.block_expert)


@pytest.mark.gpu
def test_moe_align_small_matches_reference_gpu():
    ns: dict = {}
    exec(textwrap.dedent(_CHECK), ns)
    ns["check"]([(1, 8, 288, 16), (2, 8, 288, 16), (8, 8, 288, 16), (64, 8, 288, 64), (100, 8, 288, 64),
                 (128, 8, 288, 128), (16, 8, 256, 32)], "cuda")
