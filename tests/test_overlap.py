"""Side-stream overlap on the CPU: the choice of forking (glm5.layers.backends.overlap_backend) and the inline
branch, which runs its body in order and joins as a no-op; the MoE joins its shared-expert branch before the
shared output is added. The forked path is checked on the GPU (tests/test_gpu_overlap.py)."""

from __future__ import annotations

import pytest
import torch

from glm5.layers import backends
from glm5.layers.overlap import Branch, StreamOverlap


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    backends.reset_backends()


def test_cpu_never_forks():
    cpu = torch.device("cpu")
    for rows in (1, 64, 10_000):
        assert backends.overlap_backend(cpu, rows) == "inline"
    backends.set_backends(overlap="inline")
    assert backends.overlap_backend(cpu, 1) == "inline"


def test_explicit_stream_on_cpu_fails_with_the_fix():
    backends.set_backends(overlap="stream")
    with pytest.raises(backends.BackendUnavailable, match="GLM5_OVERLAP_BACKEND=inline"):
        backends.overlap_backend(torch.device("cpu"), 1)


def test_bad_choice_names_the_choices():
    with pytest.raises(ValueError, match="auto, stream, inline"):
        backends.set_backends(overlap="sideways")


def test_inline_branch_runs_in_order_and_join_is_a_no_op():
    x = torch.ones(3, 4)
    with StreamOverlap().branch(x) as side:
        y = x * 2
    assert isinstance(side, Branch) and side.stream is None
    side.join()
    side.join()
    assert torch.equal(y, torch.full((3, 4), 2.0))


def test_moe_joins_the_shared_branch_before_adding_it(monkeypatch):
    """The MoE's torch path calls the branch's join before it adds the shared expert's output, and the result
    is the routed sum plus the shared expert (as before the branch existed)."""
    from glm5.config import ModelConfig
    from glm5.layers.moe import MoE, route
    from glm5.weights import dummy_weights
    from glm5_kernels.moe_ref import fused_moe_ref

    text = dict(vocab_size=70, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=32,
                v_head_dim=32, index_topk=8, index_head_dim=32, index_n_heads=4, index_kpool=4, linear_head_dim=16,
                linear_num_heads=4, hc_mult=2, layer_types=["linear_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse"], num_nextn_predict_layers=0)
    cfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    weights = dummy_weights(cfg, "cpu", torch.float32, include_mtp=False)
    layer = next(i for i, kind in enumerate(cfg.text.mlp_kinds) if kind == "moe")
    moe = MoE(weights, f"layers.{layer}.mlp", cfg.text)
    assert moe.shared is not None
    events: list[str] = []
    join = Branch.join
    monkeypatch.setattr(Branch, "join", lambda self: (events.append("join"), join(self))[1])
    shared_call = type(moe.shared).__call__
    monkeypatch.setattr(type(moe.shared), "__call__", lambda self, x: (events.append("shared"), shared_call(self, x))[1])
    x = torch.randn(5, cfg.text.hidden_size, generator=torch.Generator().manual_seed(0))
    out = moe(x)
    assert events == ["shared", "join"]
    monkeypatch.setattr(type(moe.shared), "__call__", shared_call)
    r = route(x, moe.gate_w, moe.bias, cfg.text)
    want = fused_moe_ref(x, moe.w_gate, moe.w_up, moe.w_down, r.weights, r.experts, cfg.text.swiglu_limit) + moe.shared(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
