"""Compute (on CPU, fp32) the reference tokens the H200 oracle checks compare against.

Writes ``tests/fixtures/gpu_oracle_tokens.json`` (read by ``tests/test_gpu_engine.py`` and
``bench/bf16_diag.py``): for the default tiny checkpoint (seed 0), 20 random prompts,
transformers' greedy tokens (``tests/oracle.hf_greedy``, the correctness oracle) and the CPU fp32
engine's greedy tokens, 32 each, plus a checksum of the checkpoint's weights so the GPU side can
prove it rebuilt the same checkpoint. Any CPU gives the same fp32 reference (on a 2-core machine it
takes over 30 minutes; run it with ``CUDA_VISIBLE_DEVICES=`` and without fla on the path).
Run: ``python tests/make_gpu_refs.py [out_dir_for_ckpt]``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))   # oracle.py
OUT = ROOT / "tests" / "fixtures" / "gpu_oracle_tokens.json"

N_PROMPTS, N_NEW = 20, 32


def weights_digest(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


def prompts(vocab: int) -> list[list[int]]:
    from oracle import random_prompt
    lengths = [3 + 11 * i for i in range(N_PROMPTS)]  # 3 .. 212: dense (< 16) and sparse selection (topk 16)
    return [random_prompt(n, vocab, seed=1000 + i) for i, n in enumerate(lengths)]


def main() -> None:
    from oracle import engine, engine_greedy, hf_greedy, make_pair

    ckdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_ref_ckpt")
    ckpt, hf = make_pair(ckdir)
    ps = prompts(hf.config.text_config.vocab_size)
    hf_tokens = []
    for i, p in enumerate(ps):
        hf_tokens.append(hf_greedy(hf, p, N_NEW))
        print(f"hf {i + 1}/{len(ps)}", flush=True)
    cpu_tokens = engine_greedy(engine(ckpt), ps, N_NEW)
    out = {"checkpoint": "make_tiny_checkpoint(dir) defaults (seed 0, fp32)", "sha256": weights_digest(ckpt),
           "n_new": N_NEW, "prompts": ps, "hf_fp32_cpu": hf_tokens, "engine_fp32_cpu": cpu_tokens,
           "engine_equals_hf_on_cpu": [a == b for a, b in zip(hf_tokens, cpu_tokens)],
           "torch": torch.__version__}
    OUT.write_text(json.dumps(out))
    print("engine==hf on CPU:", sum(out["engine_equals_hf_on_cpu"]), "/", N_PROMPTS)


if __name__ == "__main__":
    main()
