"""The KDA recurrences of the batched path (glm5_kernels.kda_verify: the decode step, speculative verify and
commit) against their torch references: on the CPU through the Triton interpreter at a small shape, compiled
for sm90 at the real shape, and on the GPU at the real shape (``gpu`` marker; the decode step also against
fla's recurrent kernel). The references themselves are checked against the plain token-by-token recurrence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glm5_kernels.kda_verify_ref import (kda_commit_recurrence_ref, kda_decode_recurrence_ref, kda_gate,
                                         kda_step, kda_verify_recurrence_ref)
from glm5_kernels.norms_ref import l2_normalize

ROOT = Path(__file__).resolve().parent.parent


def _inputs(n=3, t=4, h=2, d=16, slots=6, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(n, t, 3, h, d, generator=g).unbind(2)
    f = torch.randn(n, t, h * d, generator=g)
    b = torch.randn(n, t, h, generator=g)
    a_log = torch.randn(h, generator=g) * 0.3
    dt = torch.randn(h * d, generator=g) * 0.3
    pool = torch.randn(slots, h, d, d, generator=g) * 0.1
    to = dict(device=device)
    return ([x.to(dtype=dtype, **to) for x in (q, k, v, f, b)], a_log.to(**to), dt.to(**to), pool.to(**to))


def _plain(q, k, v, f, b, state, a_log, dt, lb, rows):
    """One request's rows through the decode step, one at a time."""
    d = q.shape[-1]
    outs = []
    for t in range(rows):
        qt = l2_normalize(q[t].float()) * d ** -0.5
        kt = l2_normalize(k[t].float())
        o, state = kda_step(state, qt, kt, v[t].float(), kda_gate(f[t], a_log, dt, lb, d), torch.sigmoid(b[t]).float())
        outs.append(o)
    return torch.stack(outs) if outs else None, state


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_references_equal_the_plain_recurrence(lower_bound):
    (q, k, v, f, b), a_log, dt, pool = _inputs()
    slots = torch.tensor([5, 0, 2])
    before = pool.clone()
    out = kda_verify_recurrence_ref(q, k, v, f, b, pool, slots, a_log, dt, lower_bound, 16 ** -0.5)
    assert torch.equal(pool, before)  # verify never writes the state
    n_valid = torch.tensor([0, 4, 2])
    kda_commit_recurrence_ref(q, k, v, f, b, pool, slots, n_valid, a_log, dt, lower_bound, 16 ** -0.5)
    for i, s in enumerate(slots.tolist()):
        want_out, _ = _plain(q[i], k[i], v[i], f[i], b[i], before[s], a_log, dt, lower_bound, 4)
        assert torch.allclose(out[i], want_out, atol=1e-6)
        _, want_state = _plain(q[i], k[i], v[i], f[i], b[i], before[s], a_log, dt, lower_bound, int(n_valid[i]))
        assert torch.allclose(pool[s], want_state, atol=1e-6), (i, int(n_valid[i]))
    untouched = [j for j in range(pool.shape[0]) if j not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def _run_interpreted(code: str) -> None:
    """Run ``code`` in a subprocess with ``TRITON_INTERPRET=1`` (set before triton is imported); it prints ok."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_decode_reference_is_one_plain_step(lower_bound):
    (q, k, v, f, b), a_log, dt, pool = _inputs(t=1)
    q, k, v, f, b = (x[:, 0] for x in (q, k, v, f, b))
    slots = torch.tensor([5, 0, 2])
    before = pool.clone()
    out = kda_decode_recurrence_ref(q, k, v, f, b, pool, slots, a_log, dt, lower_bound, 16 ** -0.5)
    for i, s in enumerate(slots.tolist()):
        want_out, want_state = _plain(q[i:i + 1], k[i:i + 1], v[i:i + 1], f[i:i + 1], b[i:i + 1], before[s], a_log,
                                      dt, lower_bound, 1)
        assert torch.allclose(out[i], want_out[0], atol=1e-6)
        assert torch.allclose(pool[s], want_state, atol=1e-6)
    untouched = [j for j in range(pool.shape[0]) if j not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_kda_decode_kernel_interpreter_cpu():
    """The decode step through the Triton interpreter at every tile shape of the table and a K-wide block,
    int32 slots as the engine stages them, q/k/v as views of one [3, N, 3·H·d] conv output."""
    code = textwrap.dedent("""
        import torch, sys
        sys.path.insert(0, %r)
        from test_kernels_kda_verify import _inputs
        from glm5_kernels.kda_verify import DECODE_TILES, kda_decode_recurrence
        from glm5_kernels.kda_verify_ref import kda_decode_recurrence_ref
        (q, k, v, f, b), a_log, dt, pool = _inputs(n=3, t=1, h=2, d=64)
        conv = torch.stack([q[:, 0], k[:, 0], v[:, 0]]).reshape(3, 3, -1)
        q, k, v = (x.view(3, 2, 64) for x in conv.unbind(0))
        f, b = f[:, 0], b[:, 0].contiguous()
        slots = torch.tensor([4, 0, 2], dtype=torch.int32)
        tiles = sorted({(bv, w) for _, bv, w in DECODE_TILES} | {(32, 1), (8, 4)})
        for lb in (-5.0, None):
            for tile in tiles:
                p1, p2 = pool.clone(), pool.clone()
                ref = kda_decode_recurrence_ref(q, k, v, f, b, p1, slots.long(), a_log, dt, lb, 0.17)
                got = kda_decode_recurrence(q, k, v, f, b, p2, slots, a_log, dt, lb, 0.17, tile=tile)
                assert got.dtype == q.dtype and got.shape == q.shape
                assert (got - ref).abs().max().item() < 1e-5, (tile, (got - ref).abs().max())
                assert (p1 - p2).abs().max().item() < 1e-5, (tile, (p1 - p2).abs().max())
                assert torch.equal(p2[1], pool[1]) and not torch.equal(p2[0], pool[0])
        print("ok")
    """ % str(ROOT / "tests"))
    _run_interpreted(code)


def test_decode_tile_table_covers_every_batch():
    from glm5_kernels.kda_verify import DECODE_TILES, decode_tile
    assert [r for r, _, _ in DECODE_TILES] == sorted(r for r, _, _ in DECODE_TILES)
    assert decode_tile(1, 128) == (32, 2) and decode_tile(8, 128) == (32, 2)
    assert decode_tile(9, 128) == (64, 4) and decode_tile(4096, 128) == (64, 4)
    assert decode_tile(64, 16) == (16, 1)   # a value block never wider than the head


def test_kda_verify_kernels_interpreter_cpu():
    """Both launches through the Triton interpreter (fp32, small shape, bounded and softplus gates); a
    subprocess so that TRITON_INTERPRET is set before triton is imported."""
    import triton  # noqa: F401
    code = textwrap.dedent("""
        import torch, sys
        sys.path.insert(0, %r)
        from test_kernels_kda_verify import _inputs
        from glm5_kernels.kda_verify import kda_commit_recurrence, kda_verify_recurrence
        from glm5_kernels.kda_verify_ref import kda_commit_recurrence_ref, kda_verify_recurrence_ref
        (q, k, v, f, b), a_log, dt, pool = _inputs(n=3, t=4, h=2, d=32)
        # q, k, v as the layer hands them: strided views of one conv output
        conv = torch.stack([q, k, v], dim=2).reshape(3, 4, -1)
        q, k, v = conv.view(3, 4, 3, 2, 32).unbind(2)
        slots, nv = torch.tensor([4, 0, 2]), torch.tensor([0, 4, 2])
        for lb in (-5.0, None):
            ref = kda_verify_recurrence_ref(q, k, v, f, b, pool, slots, a_log, dt, lb, 0.17)
            got = kda_verify_recurrence(q, k, v, f, b, pool, slots, a_log, dt, lb, 0.17)
            assert (got - ref).abs().max().item() < 1e-5, (got - ref).abs().max()
            p1, p2 = pool.clone(), pool.clone()
            kda_commit_recurrence_ref(q, k, v, f, b, p1, slots, nv, a_log, dt, lb, 0.17)
            kda_commit_recurrence(q, k, v, f, b, p2, slots, nv, a_log, dt, lb, 0.17)
            assert (p1 - p2).abs().max().item() < 1e-5, (p1 - p2).abs().max()
            assert torch.equal(p2[4], pool[4]) and not torch.equal(p2[0], pool[0])
        print("ok")
    """ % str(ROOT / "tests"))
    _run_interpreted(code)


@pytest.mark.parametrize("mode,bounded,dtype,bv", [("verify", True, "bf16", 32), ("commit", True, "bf16", 32),
                                                   ("verify", False, "fp32", 32), ("commit", True, "fp32", 32),
                                                   ("decode", True, "bf16", 64), ("decode", False, "bf16", 32),
                                                   ("decode", True, "fp32", 64)])
def test_kda_recurrence_kernel_compiles_for_sm90(mode, bounded, dtype, bv):
    pytest.importorskip("triton")
    from test_kernels_compile import _compile

    from glm5_kernels.kda_verify import _kda_spec_kernel
    ptrs = {name: dtype for name in ("q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr")}
    ptrs.update(a_log_ptr="fp32", dt_ptr="fp32", state_ptr="fp32", slot_ptr="i32" if mode == "decode" else "i64",
                nvalid_ptr="i32", o_ptr=dtype if mode == "decode" else "fp32")
    _compile(_kda_spec_kernel, ptrs, dict(H=64, D=128, BV=bv, BOUNDED=bounded, WRITE_OUT=mode != "commit",
                                          ROWS_FROM_N_VALID=mode == "commit", STORE_STATE=mode != "verify"),
             floats=("lower_bound", "scale"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kda_verify_kernels_match_reference_on_gpu(dtype):
    """Real shape (64 heads x 128), 32 requests x 4 rows, strided q/k/v views as the layer passes them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from glm5_kernels.kda_verify import kda_commit_recurrence, kda_verify_recurrence
    n, t, h, d = 32, 4, 64, 128
    (q, k, v, f, b), a_log, dt, pool = _inputs(n=n, t=t, h=h, d=d, slots=40, seed=3, dtype=dtype, device="cuda")
    conv = torch.stack([q, k, v], dim=2).reshape(n, t, -1)
    q, k, v = conv.view(n, t, 3, h, d).unbind(2)
    slots = torch.randperm(40, device="cuda")[:n]
    nv = torch.randint(0, t + 1, (n,), device="cuda")
    ref = kda_verify_recurrence_ref(q, k, v, f, b, pool, slots, a_log, dt, -5.0, d ** -0.5)
    got = kda_verify_recurrence(q, k, v, f, b, pool, slots, a_log, dt, -5.0, d ** -0.5)
    # fp32: the same fp32 recurrence in another summation order; bf16: the kernel keeps fp32 intermediates where
    # the reference rounds to the inputs' dtype (measured on the H200: 1.6e-3), inside bf16's 1e-3..1e-2 range
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    assert ((got - ref).norm() / ref.norm()).item() < bound
    p1, p2 = pool.clone(), pool.clone()
    kda_commit_recurrence_ref(q, k, v, f, b, p1, slots, nv, a_log, dt, -5.0, d ** -0.5)
    kda_commit_recurrence(q, k, v, f, b, p2, slots, nv, a_log, dt, -5.0, d ** -0.5)
    assert ((p1 - p2).norm() / p1.norm()).item() < bound


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64, 256])
def test_kda_decode_kernel_matches_reference_and_fla_on_gpu(n):
    """Real shape (64 heads x 128), bf16 activations as the decode path has them: the output against the torch
    step and fla's ``fused_recurrent_kda_fwd`` (which the decode path ran before), the pool in place, slots
    that skip pool entries (which stay untouched)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from glm5_kernels.kda_verify import kda_decode_recurrence
    h, d = 64, 128
    (q, k, v, f, b), a_log, dt, pool = _inputs(n=n, t=1, h=h, d=d, slots=n + 5, seed=5, dtype=torch.bfloat16,
                                               device="cuda")
    conv = torch.stack([q[:, 0], k[:, 0], v[:, 0]]).reshape(3, n, -1)
    q, k, v = (x.view(n, h, d) for x in conv.unbind(0))
    f, b = f[:, 0], b[:, 0].contiguous()
    slots = torch.randperm(n + 5, device="cuda")[:n].to(torch.int32)
    a_log, dt = a_log.float(), dt.float()
    p_ref, p_fla, p_got = pool.clone(), pool.clone(), pool.clone()
    ref = kda_decode_recurrence_ref(q, k, v, f, b, p_ref, slots.long(), a_log, dt, -5.0, d ** -0.5)
    got = kda_decode_recurrence(q, k, v, f, b, p_got, slots, a_log, dt, -5.0, d ** -0.5)
    fla, _ = fused_recurrent_kda_fwd(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), f.view(n, 1, h, d),
                                     b.unsqueeze(1), A_log=a_log, dt_bias=dt, initial_state=p_fla, scale=d ** -0.5,
                                     inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
                                     out=torch.empty_like(v.unsqueeze(1)))
    # fla computes what the kernel computes (fp32 from the bf16 inputs, the same formulas): the states agree to
    # fp32 summation order. The torch step takes β = sigmoid(b) in bf16 (the kernels in fp32), so against it the
    # states agree to bf16 rounding, as the verify kernel's bound below; the bf16 outputs to 2^-8 relative.
    assert ((p_got - p_fla).norm() / p_fla.norm()).item() < 1e-5
    assert ((p_got - p_ref).norm() / p_ref.norm()).item() < 5e-3
    for other in (ref, fla[:, 0]):
        assert ((got.float() - other.float()).norm() / other.float().norm()).item() < 8e-3
    untouched = torch.ones(n + 5, dtype=torch.bool, device="cuda")
    untouched[slots.long()] = False
    assert torch.equal(p_got[untouched], pool[untouched])
