"""Torch references of the KDA recurrences over a state-slot pool (:mod:`glm5_kernels.kda_verify`): the batched
decode step and the speculative-verification pair, also the engine's torch path.

A speculative step runs ``T = k + 1`` rows per request through every KDA layer. Rolling a rejected suffix
back does not need a state per row: the state in the request's slot is left as it was before the step
(:func:`kda_verify_recurrence_ref` reads it and writes nothing), and once the accepted length ``v`` is known
:func:`kda_commit_recurrence_ref` runs the first ``v`` rows again from that same state and writes the result.
The extra cost is one more read of the state and ``v`` cheap row updates; the alternative (a state per row,
as vLLM keeps) writes ``T`` states of ``heads × d × d`` fp32 per layer and request and keeps them until the
step ends.

Inputs are the conv outputs before normalisation, as the layer has them: ``q, k, v [N, T, H, d]`` (model
dtype), the gate projection ``f [N, T, H·d]`` before :func:`kda_gate` and the β logits ``b [N, T, H]``.
Per row the math is the decode step's: l2-normalised q (times ``scale``) and k, ``g = kda_gate(f)``,
``β = sigmoid(b)``, ``S ← diag(exp g) S``, ``S ← S + k (β (v − Sᵀk))ᵀ``, ``o = Sᵀq``.
No Triton import: the CPU engine runs these.
"""

from __future__ import annotations

import torch

from glm5_kernels.norms_ref import l2_normalize


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
             head_dim: int) -> torch.Tensor:
    """Forget gate in log space, ``[..., H, d]`` fp32, every entry < 0:
    ``lower_bound · sigmoid(exp(A_log) · (f + dt_bias))``, or ``−exp(A_log) · softplus(f + dt_bias)`` without
    a bound. ``f``: ``[..., H·d]``."""
    g = (f.float() + dt_bias.float().reshape(-1)).view(*f.shape[:-1], -1, head_dim)
    rate = torch.exp(a_log.float()).view(-1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


def kda_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence → (output, new state). Leading dims broadcast, so the same step serves
    one request (q [H, d], state [H, dk, dv]) and a decode batch (q [N, H, d], state [N, H, dk, dv])."""
    state = state * g.exp().unsqueeze(-1)
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def _row_inputs(q, k, v, f, b, t, a_log, dt_bias, lower_bound, scale):
    d = q.shape[-1]
    qt = l2_normalize(q[:, t].float()) * scale
    kt = l2_normalize(k[:, t].float())
    g = kda_gate(f[:, t], a_log, dt_bias, lower_bound, d)
    return qt, kt, v[:, t].float(), g, torch.sigmoid(b[:, t]).float()


def kda_verify_recurrence_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                              b: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                              a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                              scale: float) -> torch.Tensor:
    """Outputs ``[N, T, H, d]`` fp32 of every row, starting from ``state_pool[slots]``; the pool is not
    written (module docstring)."""
    state = state_pool.index_select(0, slots)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for t in range(q.shape[1]):
        o, state = kda_step(state, *_row_inputs(q, k, v, f, b, t, a_log, dt_bias, lower_bound, scale))
        out[:, t] = o
    return out


def kda_decode_recurrence_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                              b: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                              a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                              scale: float) -> torch.Tensor:
    """One decode token per request: ``q, k, v [N, H, d]``, ``f [N, H·d]``, ``b [N, H]``; ``state_pool[slots]``
    ← the state after the token (in place), returns the output ``[N, H, d]`` in ``q``'s dtype."""
    state = state_pool.index_select(0, slots)
    o, state = kda_step(state, *_row_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), f.unsqueeze(1),
                                            b.unsqueeze(1), 0, a_log, dt_bias, lower_bound, scale))
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return o.to(q.dtype)


def kda_commit_recurrence_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                              b: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                              n_valid: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                              lower_bound: float | None, scale: float) -> None:
    """``state_pool[slots[n]]`` ← the state after request ``n``'s first ``n_valid[n]`` rows (``0 ≤ n_valid ≤
    T``), from the state the pool holds. Device tensors only (no host sync): rows past ``n_valid`` are
    computed and discarded."""
    state = state_pool.index_select(0, slots)
    for t in range(q.shape[1]):
        _, new = kda_step(state, *_row_inputs(q, k, v, f, b, t, a_log, dt_bias, lower_bound, scale))
        keep = (n_valid.to(slots.device) > t).view(-1, 1, 1, 1)
        state = torch.where(keep, new, state)
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))


__all__ = ["kda_commit_recurrence_ref", "kda_decode_recurrence_ref", "kda_gate", "kda_step",
           "kda_verify_recurrence_ref"]
