"""Backend selection (CPU): auto picks the torch paths off CUDA, explicit GPU choices fail fast."""

from __future__ import annotations

import pytest
import torch

from glm5.layers import backends


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("GLM5_KDA_BACKEND", raising=False)
    monkeypatch.delenv("GLM5_ATTN_BACKEND", raising=False)
    backends._overrides.clear()
    yield
    backends._overrides.clear()


def test_auto_is_torch_on_cpu():
    assert backends.kda_backend(torch.device("cpu")) == "torch"
    assert backends.attn_backend(torch.device("cpu")) == "torch"


@pytest.mark.parametrize("kind,value", [("kda", "fla"), ("attn", "sdpa")])
def test_explicit_gpu_backend_fails_fast_on_cpu(monkeypatch, kind, value):
    monkeypatch.setenv(f"GLM5_{kind.upper()}_BACKEND", value)
    fn = backends.kda_backend if kind == "kda" else backends.attn_backend
    with pytest.raises(backends.BackendUnavailable, match=value):
        fn(torch.device("cpu"))


def test_override_beats_env_and_bad_names_are_rejected(monkeypatch):
    monkeypatch.setenv("GLM5_KDA_BACKEND", "fla")
    backends.set_backends(kda="torch")
    assert backends.kda_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="kda_backend='triton'"):
        backends.set_backends(kda="triton")
    monkeypatch.setenv("GLM5_ATTN_BACKEND", "flash")
    with pytest.raises(ValueError, match="GLM5_ATTN_BACKEND"):
        backends.attn_backend(torch.device("cpu"))


def test_backends_set_restores_what_was_there(monkeypatch):
    """``backends_set`` overrides inside its block only: the environment decides again afterwards, an earlier
    override comes back, and a bad choice raises without leaving anything behind."""
    monkeypatch.setenv("GLM5_KDA_BACKEND", "fla")
    cpu = torch.device("cpu")
    with backends.backends_set(kda="torch"):
        assert backends.kda_backend(cpu) == "torch"
    with pytest.raises(backends.BackendUnavailable, match="fla"):   # the environment's choice again
        backends.kda_backend(cpu)
    backends.set_backends(attn="torch")
    with backends.backends_set(attn="sdpa", kda="torch"):
        assert backends._requested("attn", backends.ATTN_CHOICES) == "sdpa"
    assert backends._overrides == {"attn": "torch"}
    with pytest.raises(ValueError, match="kda_backend='triton'"):
        with backends.backends_set(kda="triton"):
            pass
    assert backends._overrides == {"attn": "torch"}


def test_triton_kernel_backends_follow_dtype():
    """The index / MoE / mHC kernels take bf16 and fp32: auto keeps fp16 on the torch path (no CUDA call is
    made for a device that only has to be named), an explicit triton choice fails fast naming the dtype."""
    from glm5.layers import backends
    cuda = torch.device("cuda")
    try:
        for fn in (backends.index_backend, backends.moe_backend, backends.mhc_backend):
            assert fn(cuda, torch.bfloat16) == "triton"
            assert fn(cuda, torch.float32) == "triton"
            assert fn(cuda, torch.float16) == "torch"
        backends.set_backends(index="triton")
        with pytest.raises(backends.BackendUnavailable, match="float16"):
            backends.index_backend(cuda, torch.float16)
    finally:
        backends.reset_backends()


def test_new_kernel_backends_auto_by_dtype_and_fail_fast(monkeypatch):
    """attn / router / fuse: auto sends bf16 on CUDA to the kernels and keeps fp32 on the reference path (the
    fp32 oracle mode); explicit triton on the CPU fails fast unless the interpreter runs the kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert backends.attn_backend(cuda, torch.bfloat16, 512) == "triton"
    assert backends.attn_backend(cuda, torch.float32, 512) == "sdpa"
    assert backends.attn_backend(cuda, torch.bfloat16, 96) == "sdpa"      # the kernel takes powers of two >= 32
    assert backends.attn_backend(cuda, torch.bfloat16, 16) == "sdpa"
    assert backends.decode_attn_backend(cuda, torch.bfloat16, 16) == "torch"
    assert backends.decode_attn_backend(cuda, torch.bfloat16, 512) == "triton"
    for fn in (backends.router_backend, backends.fuse_backend):
        assert fn(cuda, torch.bfloat16) == "triton"
        assert fn(cuda, torch.float32) == "torch"
        assert fn(cpu, torch.bfloat16) == "torch"
    backends.set_backends(attn="triton", router="triton", fuse="triton")
    with pytest.raises(backends.BackendUnavailable, match="kv_lora_rank 96"):
        backends.attn_backend(cuda, torch.bfloat16, 96)
    backends.set_backends(decode_attn="triton")
    with pytest.raises(backends.BackendUnavailable, match="kv_lora_rank 16"):
        backends.decode_attn_backend(cuda, torch.bfloat16, 16)
    for fn in (backends.router_backend, backends.fuse_backend):
        with pytest.raises(backends.BackendUnavailable, match="not on a CUDA device"):
            fn(cpu, torch.float32)
        assert fn(cuda, torch.float32) == "triton"                        # explicit: fp32 kernels (IEEE) run
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.router_backend(cpu, torch.float32) == "triton"
    assert backends.attn_backend(cpu, torch.float32, 32) == "triton"
    backends.reset_backends()
    assert backends.fuse_backend(cpu, torch.bfloat16) == "torch"          # never auto on the CPU
    with pytest.raises(ValueError, match="GLM5_FUSE_BACKEND"):
        backends.set_backends(fuse="fla")
