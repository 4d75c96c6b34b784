"""fp8 weights in the engine on the GPU, on the *trained* tiny checkpoint (run on the H200).

Two comparisons (``tests/test_gpu_bf16.py`` explains why the checkpoint must be trained):

* greedy tokens: the bf16 engine on the checkpoint as it is vs the engine with ``quantization=fp8`` (every
  projection quantized at load to e4m3 with 128 x 128 block scales; CUDA graphs and the batched decode path
  on, as served): at least 18 of the 20 agreement prompts keep all 32 tokens.
* logits: an fp8 checkpoint (the trained weights quantized and saved with their ``weight_scale_inv``) run with
  fp8 kept (``quantization=auto``: the fp8 kernels) vs the same checkpoint dequantized to bf16 at load
  (``quantization=none``: bf16 GEMMs on the same values). The relative error of the prefill logits isolates the
  kernels' arithmetic; it is printed (and written to ``$GLM5_DIAG_OUT/fp8_logits.json``) and must stay below
  1e-1: prefill chunks of more than 64 rows run the w8a8 GEMMs, which also round the activations to e4m3
  (≤ 2^-4 relative each, compounding over 8 layers), while decode-sized rows run the W8A16 GEMV (1e-2 per GEMM).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from glm5 import trained_tiny_checkpoint as trained_tiny

pytestmark = pytest.mark.gpu
MIN_AGREE = 18
LOGITS_BOUND = 1e-1


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("GLM5_TRAINED_CKPT")
    if given:
        return Path(given)
    return trained_tiny.train_tiny_checkpoint(tmp_path_factory.mktemp("gpu_fp8_trained") / "ckpt", device="cuda")


@pytest.fixture(scope="session")
def prompts(trained_checkpoint: Path) -> list[list[int]]:
    vocab = int(json.loads((trained_checkpoint / "config.json").read_text())["text_config"]["vocab_size"])
    return trained_tiny.agreement_prompts(vocab)


@pytest.fixture(scope="session")
def fp8_checkpoint(trained_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glm5.weights import load_weights, quantize_weights, save_weights
    out = tmp_path_factory.mktemp("gpu_fp8_ckpt") / "ckpt"
    shutil.copytree(trained_checkpoint, out)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_weights(quantize_weights(load_weights(trained_checkpoint, progress=False)), out)
    return out


def test_gpu_fp8_engine_agrees_with_bf16(trained_checkpoint, prompts):
    want = trained_tiny.greedy_tokens(trained_checkpoint, prompts, "bfloat16", device="cuda", quantization="none")
    got = trained_tiny.greedy_tokens(trained_checkpoint, prompts, "bfloat16", device="cuda", quantization="fp8")
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(got, want)]
    agree = sum(d is None for d in first)
    print(f"cuda fp8 (online) vs cuda bf16 (trained tiny): {agree}/{len(prompts)} prompts agree on all "
          f"{trained_tiny.N_AGREE} tokens; first divergence {first}")
    assert agree >= MIN_AGREE, first


def _prefill_logits(ckpt: Path, prompts: list[list[int]], quantization: str) -> tuple[torch.Tensor, bool]:
    from glm5.engine import EngineArgs, LLMEngine
    from glm5.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=str(ckpt), device="cuda", dtype="bfloat16", block_size=16, num_cache_blocks=256,
                               max_num_seqs=16, max_num_batched_tokens=4096, load_progress=False,
                               quantization=quantization))
    model = eng.runner.model
    fp8 = model.layers[3].attn.q_b.quantized
    logits: list[torch.Tensor] = []
    forward = model.forward

    def recording_forward(batch, cache):
        out = forward(batch, cache)
        logits.append(out.logits.detach().float().cpu())
        return out

    model.forward = recording_forward  # instance attribute: the runner calls self.model.forward(...)
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return torch.cat(logits), fp8


def test_gpu_fp8_kernels_logits_vs_dequantized_bf16(fp8_checkpoint, prompts):
    got, fp8_on = _prefill_logits(fp8_checkpoint, prompts, "auto")
    want, fp8_off = _prefill_logits(fp8_checkpoint, prompts, "none")
    assert fp8_on and not fp8_off and got.shape == want.shape
    rel = float((got - want).norm() / want.norm())
    per_row = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    report = {"logits_rel_err": rel, "per_row_max": max(per_row), "top1_agreement": top1, "rows": len(per_row)}
    print("fp8 kernels vs dequantized bf16 (same fp8 checkpoint):", json.dumps(report))
    if out_dir := os.environ.get("GLM5_DIAG_OUT"):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "fp8_logits.json").write_text(json.dumps(report, indent=1) + "\n")
    assert rel < LOGITS_BOUND, report


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_gpu_pdl_off_and_on_give_the_same_tokens(trained_checkpoint, prompts, monkeypatch, quantization):
    """Programmatic dependent launch changes when kernels start, never what they compute: the served engine
    (CUDA graphs, batched decode) gives the same greedy tokens with ``GLM5_PDL=0`` and ``GLM5_PDL=1``."""
    from glm5_kernels import pdl
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.pdl_enabled(torch.device("cuda")), "PDL cannot run on this GPU; the comparison would be vacuous"
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, flag)
        outs[flag] = trained_tiny.greedy_tokens(trained_checkpoint, prompts[:8], "bfloat16", device="cuda", n=16,
                                                quantization=quantization)
    assert outs["0"] == outs["1"]
