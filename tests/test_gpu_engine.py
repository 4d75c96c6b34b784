"""The engine on a CUDA GPU (run on the H200): oracle agreement and the fla KDA backend.

Reference tokens come from ``bench/gpu_oracle_tokens.json``, computed on CPU in fp32 by
``bench/make_gpu_refs.py`` (transformers' mask-free greedy decoding = the oracle, and the CPU fp32
engine); the checkpoint is rebuilt here and its weight hash must match the one recorded there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from glm5.model import backends
from oracle import engine, engine_greedy

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "bench" / "gpu_oracle_tokens.json"


@pytest.fixture(scope="module")
def refs_and_ckpt(tmp_path_factory):
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    refs = json.loads(REFS.read_text())
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_tiny") / "ckpt")
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert digest == refs["sha256"], "rebuilt tiny checkpoint differs from the one the references were made on"
    return refs, ckpt


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    backends._overrides.clear()


def _agree(got: list[list[int]], want: list[list[int]]) -> list[bool]:
    return [a == b for a, b in zip(got, want)]


@pytest.mark.parametrize("kda", ["torch", "fla"])
def test_fp32_engine_on_gpu_matches_transformers(refs_and_ckpt, kda):
    refs, ckpt = refs_and_ckpt
    backends.set_backends(kda=kda, attn="auto")
    got = engine_greedy(engine(ckpt, device="cuda", dtype="float32"), refs["prompts"], refs["n_new"])
    ok = _agree(got, refs["hf_fp32_cpu"])
    print(f"fp32 cuda kda={kda}: {sum(ok)}/{len(ok)} prompts token-identical to transformers")
    assert all(ok), [i for i, o in enumerate(ok) if not o]


def test_bf16_engine_on_gpu_agrees_with_cpu_fp32(refs_and_ckpt):
    refs, ckpt = refs_and_ckpt
    backends.set_backends(kda="fla", attn="sdpa")
    got = engine_greedy(engine(ckpt, device="cuda", dtype="bfloat16"), refs["prompts"], refs["n_new"])
    ok = _agree(got, refs["engine_fp32_cpu"])
    print(f"bf16 cuda (fla+sdpa): {sum(ok)}/{len(ok)} prompts agree with CPU fp32 on all {refs['n_new']} tokens")
    assert sum(ok) >= 18


@pytest.mark.parametrize("n_tok,dtype", [(1, torch.float32), (3, torch.float32), (300, torch.float32),
                                         (300, torch.bfloat16)])
def test_fla_kda_matches_torch_reference(n_tok, dtype):
    """fla-core's kernels vs :func:`kda_recurrent` (fp64) at the real head shape, varlen with slots."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from glm5.model.kda import kda_gate, kda_recurrent
    from glm5.model.norms import l2_normalize

    gen = torch.Generator().manual_seed(n_tok)
    heads, d, lens, slots = 64, 128, [n_tok, max(1, n_tok // 2)], [5, 2]
    total = sum(lens)
    q = l2_normalize(torch.randn(total, heads, d, generator=gen))
    k = l2_normalize(torch.randn(total, heads, d, generator=gen))
    v = torch.randn(total, heads, d, generator=gen)
    g = kda_gate(torch.randn(total, heads * d, generator=gen), torch.log(1 + 15 * torch.rand(heads, generator=gen)),
                 torch.randn(heads * d, generator=gen), -5.0, d)
    beta = torch.rand(total, heads, generator=gen)
    pool = 0.05 * torch.randn(8, heads, d, d, generator=gen)
    scale = d ** -0.5
    ref_out, ref_state = [], pool.clone().double()
    start = 0
    for n, s in zip(lens, slots):
        o, st = kda_recurrent((q[start:start + n] * scale).double(), k[start:start + n].double(),
                              v[start:start + n].double(), g[start:start + n].double(), beta[start:start + n].double(),
                              ref_state[s])
        ref_out.append(o)
        ref_state[s] = st
        start += n
    ref_out = torch.cat(ref_out)
    dev = "cuda"
    cu = torch.tensor([0] + lens, device=dev).cumsum(0)
    args = [t.to(dev, dtype).unsqueeze(0) for t in (q, k, v)] + [g.to(dev).unsqueeze(0), beta.to(dev).unsqueeze(0)]
    state = pool.to(dev)
    if n_tok <= 8:
        idx = torch.tensor(slots, device=dev, dtype=torch.int32)[:, None].expand(-1, max(lens)).contiguous()
        out, _ = fused_recurrent_kda_fwd(*args, initial_state=state, scale=scale, inplace_final_state=True,
                                         cu_seqlens=cu, ssm_state_indices=idx)
    else:
        st = torch.tensor(slots, device=dev)
        out, final = chunk_kda(*args, scale=scale, initial_state=state[st].contiguous(), output_final_state=True,
                               cu_seqlens=cu)
        state[st] = final
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    rel_o = ((out[0].double().cpu() - ref_out).norm() / ref_out.norm()).item()
    rel_s = max(((state[s].double().cpu() - ref_state[s]).norm() / ref_state[s].norm()).item() for s in slots)
    print(f"fla kda n={n_tok} {dtype}: rel out {rel_o:.2e}, rel state {rel_s:.2e}")
    assert rel_o < tol and rel_s < tol
    untouched = [i for i in range(8) if i not in slots]
    assert torch.equal(state[untouched].cpu(), pool[untouched])

