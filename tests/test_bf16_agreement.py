"""bf16 vs fp32 greedy agreement of the engine on a *trained* tiny checkpoint (CPU side).

A random checkpoint cannot test this: its top-1/top-2 logit margins are ~0.1, so bf16 rounding
flips greedy tokens early even in transformers' own model (0/20 prompts keep their fp32 tokens;
``bench/bf16_diag.py`` measures it). ``glm5.trained_tiny_checkpoint`` trains the same tiny
architecture on the tokenizer's corpus until its predictions are confident; on that model a correct bf16 engine keeps
the fp32 greedy tokens, and a bf16 bug (a lost fp32 accumulation, a wrong cast) would not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glm5 import trained_tiny_checkpoint as trained_tiny

#: The target: at least this many of the 20 prompts keep all 32 fp32 greedy tokens in bf16.
MIN_AGREE = 18


@pytest.fixture(scope="session")
def fp32_tokens(trained_checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = trained_tiny.agreement_prompts(_vocab(trained_checkpoint))
    return prompts, trained_tiny.greedy_tokens(trained_checkpoint, prompts, "float32")


def _vocab(ckpt: Path) -> int:
    return int(json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"])


def test_training_makes_predictions_confident(trained_checkpoint):
    rep = json.loads((trained_checkpoint / trained_tiny.REPORT_FILE).read_text())
    print(f"margin {rep['margin_before']:.3f} -> {rep['margin_after']:.3f}, accuracy {rep['accuracy_before']:.3f} "
          f"-> {rep['accuracy_after']:.3f}, loss {rep['loss_curve'][0][1]} -> {rep['loss_curve'][-1][1]}, "
          f"{rep['seconds']} s")
    assert rep["margin_before"] < 0.5, "the untrained model should have near-zero margins"
    assert rep["margin_after"] >= 3.0 and rep["accuracy_after"] >= 0.9


def test_trained_checkpoint_keeps_the_original_layout(trained_checkpoint, tiny_checkpoint_dir):
    """Same tensor names, shapes and dtypes as the random checkpoint; text weights changed, and the MTP
    layer (not modelled by transformers) changed too: glm5.tiny_mtp_training trains it against the target."""
    from safetensors.torch import load_file

    new = load_file(str(trained_checkpoint / "model.safetensors"))
    old = load_file(str(tiny_checkpoint_dir / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in new.items()} == {k: (v.shape, v.dtype) for k, v in old.items()}
    lm = "model.language_model."
    assert not torch.equal(new[lm + "embed_tokens.weight"], old[lm + "embed_tokens.weight"])
    assert not torch.equal(new[lm + "layers.7.self_attn.kv_b_proj.weight"], old[lm + "layers.7.self_attn.kv_b_proj.weight"])
    assert not torch.equal(new[lm + "layers.8.eh_proj.weight"], old[lm + "layers.8.eh_proj.weight"])
    assert torch.equal(new["model.visual.patch_embed.proj.weight"], old["model.visual.patch_embed.proj.weight"])


def test_fp32_engine_matches_transformers_on_trained_weights(trained_checkpoint, fp32_tokens):
    """The oracle property still holds: on prompt + the engine's greedy tokens, transformers' fp32
    mask-free forward (the oracle's math; ``tests/oracle.py``) predicts every one of those tokens.
    One teacher-forced forward per prompt is the same check as cached greedy decoding, without its
    per-token cost."""
    hf = trained_tiny.load_transformers_model(trained_checkpoint, "cpu").eval()
    prompts, tokens = fp32_tokens
    for i in (0, 6, 12, 16):  # corpus (3, 110 tokens), random ids (90), unseen text
        p, got = prompts[i], tokens[i]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + got[:-1]])).logits[0, len(p) - 1:]
        assert logits.argmax(-1).tolist() == got, f"prompt {i} ({len(p)} tokens)"


def test_cpu_bf16_engine_agrees_with_cpu_fp32(trained_checkpoint, fp32_tokens):
    prompts, want = fp32_tokens
    got = trained_tiny.greedy_tokens(trained_checkpoint, prompts, "bfloat16")
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(got, want)]
    agree = sum(d is None for d in first)
    print(f"cpu bf16 vs cpu fp32 on the trained checkpoint: {agree}/{len(prompts)} prompts agree on all "
          f"{trained_tiny.N_AGREE} tokens; first divergence per prompt {first}")
    assert all(len(t) == trained_tiny.N_AGREE for t in got)
    assert agree >= MIN_AGREE, first


_ROUTER_AGREEMENT = """
import sys, torch
from glm5 import trained_tiny_checkpoint as trained
from glm5.layers import moe as moe_mod
from glm5_kernels.router import RouterWorkspace, router_topk
from glm5_kernels.router_ref import route_ref
sys.path.insert(0, sys.argv[2])
from oracle import engine, engine_greedy
torch.set_num_threads(1)
captured = {}
orig = moe_mod.route
def capture(x, gate_w, bias, cfg, *a, **kw):
    captured.setdefault(id(gate_w), [gate_w, bias, []])[2].append(x.clone())
    return orig(x, gate_w, bias, cfg, *a, **kw)
moe_mod.route = capture
eng = engine(sys.argv[1], dtype="bfloat16", max_model_len=512)
cfg = eng.model_config.text
engine_greedy(eng, trained.agreement_prompts(cfg.vocab_size)[:6], 6)
args = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
same = total = 0
for gate_w, bias, xs in captured.values():
    x = torch.cat(xs)
    _, ki = router_topk(x, gate_w.to(x.dtype), bias, *args, workspace=RouterWorkspace())
    _, fi = route_ref(x, gate_w, bias, *args)
    same += int((ki.sort(1).values == fi.sort(1).values).all(1).sum())
    total += x.shape[0]
print(f"router kernel (bf16 products, fp32 accumulation) vs fp32 router on {total} MoE inputs of the trained "
      f"checkpoint: {same / total:.4%} same experts")
assert total > 1000 and same >= 0.995 * total, (same, total)
print("ok")
"""


def test_router_kernel_keeps_the_fp32_expert_choice_on_trained_weights(trained_checkpoint):
    """The Triton router (run by the interpreter: the kernel's code, numpy's fp32 summation order) picks the
    fp32 router's experts for the MoE inputs of a bf16 engine on the trained checkpoint (the GPU measurement
    at the real shape is ``bench/kernel_check.py``)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "kernels"), str(root / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", _ROUTER_AGREEMENT, str(trained_checkpoint), str(root / "tests")],
                         env=env, capture_output=True, text=True, timeout=600)
    print(res.stdout[-500:])
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
