"""The distributed engine on CUDA (NCCL): greedy tokens under TP = N on N GPUs equal one GPU's, and the NCCL path
at world size 1 (process groups and step messages with captured decode graphs) equals the plain engine.

fp32 (IEEE Triton kernels), the tiny checkpoint widened so that N ≤ 8 ranks split it with the fused-MoE tiles
(8 MLA / KDA heads, expert intermediate 128). With one GPU only the world-size-1 tests run.
"""

from __future__ import annotations

import pytest
import torch

from glm5.engine import EngineArgs, LLMEngine
from glm5.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

WIDE = {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 256, "moe_intermediate_size": 128,
        "linear_attn_config": {"num_heads": 8, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}}
PROMPTS = [[5, 17, 33, 2, 9, 100, 7] * 6, [3, 4, 5], list(range(40, 110)), list(range(200, 330))]
N_NEW = 32


def n_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    if n_gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", text_overrides=WIDE)


def tokens(ckpt, **kw) -> list[list[int]]:
    args = dict(model=str(ckpt), device="cuda", dtype="float32", block_size=16, num_cache_blocks=128,
                max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, load_progress=False)
    eng = LLMEngine(EngineArgs(**{**args, **kw}))
    try:
        return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N_NEW,
                                                                          ignore_eos=True))]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def one_gpu(wide_ckpt):
    return tokens(wide_ckpt)


def test_nccl_world_of_one_with_decode_graphs_matches_plain_engine(wide_ckpt, one_gpu):
    assert tokens(wide_ckpt, distributed=True) == one_gpu


def test_nccl_world_of_one_with_mtp_matches_plain_engine(wide_ckpt, one_gpu):
    assert tokens(wide_ckpt, distributed=True, num_speculative_tokens=2) == one_gpu


@pytest.mark.parametrize("layout", ["tp", "tp+ep", "tp+ep+eplb"])
def test_tp_on_every_gpu_matches_one_gpu(wide_ckpt, one_gpu, layout):
    if n_gpus() < 2:
        pytest.skip(f"needs at least 2 GPUs, found {n_gpus()}")
    n = max(k for k in (2, 4, 8) if k <= n_gpus())  # the widened checkpoint splits over 2, 4 or 8 ranks
    kw = {"tp": {}, "tp+ep": {"enable_expert_parallel": True},
          "tp+ep+eplb": {"enable_expert_parallel": True, "enable_eplb": True, "num_redundant_experts": n,
                         "eplb_step_interval": 5}}[layout]
    assert tokens(wide_ckpt, tensor_parallel_size=n, **kw) == one_gpu
