"""The engine on a CUDA GPU (run on the H200): oracle agreement and the fla KDA backend.

Reference tokens come from ``tests/fixtures/gpu_oracle_tokens.json``, computed on CPU in fp32 by
``tests/make_gpu_refs.py`` (transformers' mask-free greedy decoding = the oracle, and the CPU fp32
engine); the checkpoint is rebuilt here and its weight hash must match the one recorded there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from glm5.layers import backends
from oracle import engine, engine_greedy

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "tests" / "fixtures" / "gpu_oracle_tokens.json"


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


@pytest.mark.parametrize("kda,decode", [("torch", "per_request"), ("torch", "graphs"), ("torch", "batched_eager")])
def test_fp32_engine_on_gpu_matches_transformers(refs_and_ckpt, kda, decode):
    """fp32 on CUDA, token-identical to transformers. ``graphs``: the batched decode path (Triton index,
    sparse-MLA and fused-MoE kernels in IEEE fp32) captured in CUDA graphs; ``batched_eager``: the same
    path launched eagerly. fla's chunked KDA is not held to token identity in fp32 (its matmuls run at
    reduced precision: 10/20 prompts); it is checked against the fp64 recurrence in
    :func:`test_fla_kda_matches_torch_reference` and runs in bf16."""
    refs, ckpt = refs_and_ckpt
    backends.set_backends(kda=kda, attn="auto")
    kw = {"per_request": dict(decode_path="per_request", enforce_eager=True),
          "graphs": dict(decode_path="batched"),
          "batched_eager": dict(decode_path="batched", enforce_eager=True)}[decode]
    eng = engine(ckpt, device="cuda", dtype="float32", max_model_len=512, **kw)
    assert (eng.runner.graphs is not None) == (decode == "graphs")
    got = engine_greedy(eng, refs["prompts"], refs["n_new"])
    ok = _agree(got, refs["hf_fp32_cpu"])
    print(f"fp32 cuda kda={kda} decode={decode}: {sum(ok)}/{len(ok)} prompts token-identical to transformers")
    assert all(ok), [i for i, o in enumerate(ok) if not o]


def test_bf16_graph_replay_equals_eager_batched_decode(refs_and_ckpt):
    """The captured graph computes exactly what the eager batched path computes (same kernels, bf16)."""
    refs, ckpt = refs_and_ckpt
    outs = {}
    for name, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        eng = engine(ckpt, device="cuda", dtype="bfloat16", max_model_len=512, decode_path="batched", **kw)
        outs[name] = engine_greedy(eng, refs["prompts"][:8], 24)
    assert outs["graphs"] == outs["eager"]


def _kda_layer_and_cache(ckpt, seed: int):
    """A bf16 eager engine's first KDA layer and its cache, with random conv / recurrent states."""
    eng = engine(ckpt, device="cuda", dtype="bfloat16", max_model_len=512, decode_path="batched", enforce_eager=True)
    layer = next(lay.attn for lay in eng.runner.model.layers if hasattr(lay.attn, "_core_fla"))
    cache = eng.runner.cache
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in (cache.conv[layer.layer], cache.recurrent[layer.layer]):
        t.copy_(0.1 * torch.randn(t.shape, device="cuda", generator=gen))
    return eng.runner, layer, cache, gen


def _torch_vs_fla(layer, x, batch, cache, slots: list[int], **fast: str) -> list[float]:
    """Run the layer on the torch KDA path, then with the ``fast`` backends (default: ``kda=fla``) from the same
    states; relative differences of the output, the recurrent states and the conv states of ``slots``."""
    saved = (cache.conv[layer.layer].clone(), cache.recurrent[layer.layer].clone())
    results = {}
    for name, choice in (("torch", dict(kda="torch", kda_step="torch")), ("fast", fast or dict(kda="fla"))):
        cache.conv[layer.layer].copy_(saved[0])
        cache.recurrent[layer.layer].copy_(saved[1])
        backends.set_backends(**choice)
        out = layer(x, batch, cache)
        results[name] = (out.float(), cache.recurrent[layer.layer][slots].float().clone(),
                         cache.conv[layer.layer][slots].float().clone())
        backends.reset_backends()
    return [((results["fast"][i] - results["torch"][i]).norm() / results["torch"][i].norm()).item() for i in range(3)]


@pytest.mark.parametrize("kernel", ["fla", "kda_step"])
def test_fla_in_kernel_gate_decode_matches_torch_step(refs_and_ckpt, kernel):
    """KDA batched decode: fla's recurrent kernel, or ours (the ``kda_step`` backend, the bf16 default), with
    in-kernel l2 norm / gate / β sigmoid vs the torch step (bf16)."""
    from glm5.engine.cuda_graph import DecodeRows
    refs, ckpt = refs_and_ckpt
    runner, layer, cache, gen = _kda_layer_and_cache(ckpt, seed=0)
    rows = DecodeRows(tokens=[1, 2, 3], positions=[5, 9, 40], state_slots=[2, 0, 7], block_tables=[[0], [1], [2, 3, 4]])
    batch = runner.stager.stage(rows, 3)
    x = torch.randn(3, runner.cfg.text.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    fast = dict(kda="fla", kda_step="torch") if kernel == "fla" else dict(kda="torch", kda_step="triton")
    rel_o, rel_s, _ = _torch_vs_fla(layer, x, batch, cache, [2, 0, 7], **fast)
    print(f"{kernel} in-kernel gate decode vs torch: rel out {rel_o:.2e}, rel state {rel_s:.2e}")
    assert rel_o < 2e-2 and rel_s < 1e-2


def test_fla_in_kernel_gate_prefill_matches_torch(refs_and_ckpt):
    """KDA prefill (two requests, one resuming from a cached state, one ≤ 8 rows): fla's chunk / recurrent
    kernels with in-kernel l2 norm, gate (safe_gate) and β sigmoid vs the torch reference path (bf16)."""
    from glm5.layers.batch import ForwardBatch, SeqChunk
    refs, ckpt = refs_and_ckpt
    runner, layer, cache, gen = _kda_layer_and_cache(ckpt, seed=1)
    bt = torch.arange(4, device="cuda")
    for lens in ([300, 150], [5, 3]):
        seqs, start = [], 0
        for i, n in enumerate(lens):
            seqs.append(SeqChunk(start, n, 40 * i, bt, state_slot=3 + i))
            start += n
        batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long, device="cuda"),
                             positions=torch.cat([torch.arange(s.context_len, s.total_len) for s in seqs]).cuda(),
                             seqs=seqs, logits_indices=torch.tensor([start - 1], device="cuda"))
        x = torch.randn(start, runner.cfg.text.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        rel = _torch_vs_fla(layer, x, batch, cache, [3, 4])
        print(f"fla in-kernel gate prefill {lens} vs torch: rel out {rel[0]:.2e}, state {rel[1]:.2e}, conv {rel[2]:.2e}")
        assert rel[0] < 2e-2 and rel[1] < 2e-2 and rel[2] == 0.0


@pytest.mark.parametrize("n_tok,dtype", [(1, torch.float32), (3, torch.float32), (300, torch.float32),
                                         (300, torch.bfloat16)])
def test_fla_kda_matches_torch_reference(n_tok, dtype):
    """fla-core's kernels vs :func:`kda_recurrent` (fp64) at the real head shape, varlen with slots."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from glm5.layers.kda import kda_gate, kda_recurrent
    from glm5_kernels.norms_ref import l2_normalize

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


def test_seeded_sampling_on_gpu_draws_on_the_gpu_and_ignores_the_batch(refs_and_ckpt):
    """A seeded request's generator lives on the engine's device (a CPU one drew the whole vocabulary on the
    host every step), and its tokens are the same alone and among other seeded, unseeded and greedy requests,
    on the graph-replayed batched path."""
    from glm5.sampling_params import SamplingParams
    refs, ckpt = refs_and_ckpt
    # fp32, so that a different batch size cannot move a logit enough to flip a draw
    eng = engine(ckpt, device="cuda", dtype="float32", max_model_len=512, decode_path="batched")
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    prompt = refs["prompts"][0]
    alone = eng.generate([prompt], target)[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True) for s in range(3)] + \
             [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True), SamplingParams(temperature=0.0,
                                                                                              max_tokens=24)]
    batch = eng.generate([refs["prompts"][i % len(refs["prompts"])] for i in range(1, 6)] + [prompt],
                         others + [target])
    assert batch[-1].token_ids == alone and len(alone) == 24
    eng.add_request("probe", prompt, target)
    # on the logits' device exactly ("cuda:N", not "cuda"), so the sampler draws into the row in place
    assert eng._requests["probe"].seq.generator.device == torch.device("cuda", torch.cuda.current_device())
