"""KDALayer._conv_fla on the CPU: what it hands fla's causal_conv1d and how it updates the conv states.

fla's kernel is CUDA-only, so it is replaced here by a torch model of its documented semantics (varlen
rows by ``cu_seqlens``; ``initial_state [N, D, W]`` whose last ``W-1`` columns are each request's history,
oldest first; SiLU). The layer's own per-request conv (:meth:`KDALayer._conv`) is the reference, including
requests shorter than the conv history. The kernel itself is checked against torch on the H200
(``tests/test_gpu_engine.py::test_fla_in_kernel_gate_prefill_matches_torch``).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from glm5.layers.batch import ForwardBatch, SeqChunk
from oracle import engine


def _fla_causal_conv1d_model(x, weight, initial_state, activation, cu_seqlens, chunk_indices):
    assert activation == "silu"
    # the chunk list fla's prepare_chunk_indices derives from cu_seqlens (64-row chunks): (request, chunk)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    want = [[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))]
    assert chunk_indices.tolist() == want and chunk_indices.dtype == cu_seqlens.dtype
    outs = []
    for i in range(len(cu_seqlens) - 1):
        rows = x[0, cu_seqlens[i]: cu_seqlens[i + 1]]
        full = torch.cat([initial_state[i, :, 1:].t(), rows]).t().unsqueeze(0)
        outs.append(F.silu(F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])[0].t()))
    return torch.cat(outs).unsqueeze(0), None


def test_conv_fla_matches_the_per_request_conv(tiny_checkpoint_dir, monkeypatch):
    fake = types.ModuleType("fla.modules.causal_conv1d")
    fake.causal_conv1d = _fla_causal_conv1d_model
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", fake)
    eng = engine(tiny_checkpoint_dir, device="cpu", dtype="float32", max_model_len=256)
    layer = next(lay.attn for lay in eng.runner.model.layers if hasattr(lay.attn, "_conv_fla"))
    conv = eng.runner.cache.conv[layer.layer]
    g = torch.Generator().manual_seed(0)
    conv.copy_(torch.randn(conv.shape, generator=g))
    lens = [70, 2, 1, 5]            # 1 and 2 rows: shorter than the K-1 = 3 history; 70 rows: two 64-row chunks
    seqs, start = [], 0
    for i, n in enumerate(lens):
        seqs.append(SeqChunk(start, n, 10, torch.arange(4), state_slot=i + 1))
        start += n
    batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long), positions=torch.zeros(start, dtype=torch.long),
                         seqs=seqs, logits_indices=torch.tensor([0]))
    mixed = torch.randn(start, conv.shape[-1], generator=g)
    saved = conv.clone()
    want = layer._conv(mixed, batch, conv)
    want_state = conv.clone()
    conv.copy_(saved)
    thirds = layer._conv_fla(mixed, batch, conv)   # q, k, v: one conv launch each, contiguous for fla's kernels
    assert all(t.is_contiguous() and t.shape == (start, conv.shape[-1] // 3) for t in thirds)
    got = torch.cat(thirds, dim=-1)
    meta = batch.seq_tensors(mixed.device)
    assert meta.cu_seqlens.tolist() == [0, 70, 72, 73, 78] and meta.state_slots.tolist() == [1, 2, 3, 4]
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(conv, want_state)
