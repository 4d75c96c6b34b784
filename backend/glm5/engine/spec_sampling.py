"""Acceptance of a speculative step for the whole batch at once, on the logits' device (no host sync).

Greedy requests accept the longest prefix of drafts equal to the target's argmax and emit the target's token
after it (:func:`accept_greedy`). Sampling requests use standard rejection sampling (:func:`accept_sampled`,
the batched form of :func:`glm5.engine.spec_decode.rejection_sample`): draft ``d`` at row ``j`` is accepted
with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection the token comes from
``norm(max(p_j − q_j, 0))``; when every draft passes, a bonus token comes from the next row's ``p``. The
emitted tokens are distributed exactly as the target's.

Randomness is counter-based instead of drawn from a generator: a uniform is a hash of (request seed, token
position, purpose, vocabulary index) (:func:`uniforms`), so a request's numbers do not depend on which other
requests share its step, on its row in the batch, or on the device the batch runs on, and one launch covers
every request. The purposes are separate streams (the acceptance test, the correction / bonus draw, the
draft draw), so a draft and the test of that draft never reuse a number. A position's numbers are only ever
used for the token at that position; a draft drawn for a position that is rejected is redrawn in a later
step with the same numbers, which is exact because nothing emitted depended on the discarded draw.
"""

from __future__ import annotations

import torch

SALT_ACCEPT = 0x1B873593   # u for "accept draft at this position"
SALT_TOKEN = 0x2E1B2138    # exponential race for the correction / bonus token
SALT_DRAFT = 0x5BD1E995    # exponential race for the draft token

_M32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): every output bit depends on every input bit."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """Per-(request, position) keys: ``seeds [N]`` int64 (any 64-bit value), ``positions [N, ...]``."""
    s = seeds.to(torch.int64)
    key = mix32(mix32(s & _M32) ^ mix32((s >> 32) & _M32 ^ salt))
    key = key.view(-1, *([1] * (positions.dim() - 1)))
    return mix32(key ^ mix32(positions.to(torch.int64) * 2 + 1))


def _to_unit(h: torch.Tensor) -> torch.Tensor:
    """uint32 hash → uniform in (0, 1), fp32: 23 bits plus a half step, exactly representable, so never 0 or 1
    (with 24 bits the largest value rounds to 1.0 and its exponential to 0)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int | None = None) -> torch.Tensor:
    """Uniforms in (0, 1): ``[N, ...]`` (one per position), or ``[N, ..., width]`` (one per position and
    vocabulary index) when ``width`` is given."""
    key = stream_keys(seeds, positions, salt)
    if width is None:
        return _to_unit(mix32(key))
    cols = mix32(torch.arange(width, device=key.device, dtype=torch.int64) * 0x9E3779B1 + 0x632BE5AB)
    return _to_unit(mix32(key.unsqueeze(-1) ^ cols))


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One token per row by the exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` from the counter
    stream: picks token ``i`` with probability ``p_i``. ``probs [N, ..., V]``, ``positions [N, ...]``."""
    e = -torch.log(uniforms(seeds, positions, salt, probs.shape[-1]))
    return torch.argmax(probs.float() / e.clamp_min(_TINY), dim=-1)


def accept_greedy(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_tokens [N, T]`` (the target's choice at every verification row), ``drafts [N, T-1]``,
    ``num_drafts [N]`` (a request's real drafts; the rest are padding and never accepted) →
    (emitted tokens ``[N, T]``: the first ``accepted + 1`` are valid, accepted drafts ``[N]``)."""
    t = target_tokens.shape[1]
    j = torch.arange(t - 1, device=drafts.device)
    ok = (drafts == target_tokens[:, :-1]) & (j[None, :] < num_drafts[:, None])
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    return target_tokens, accepted


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                   num_drafts: torch.Tensor, seeds: torch.Tensor, first_position: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for a batch: ``target_probs [N, T, V]`` (row ``j`` = the distribution of the token
    after draft ``j``), ``draft_probs [N, T-1, V]`` (what each draft was drawn from), ``drafts [N, T-1]``,
    ``num_drafts [N]``, ``seeds [N]``, ``first_position [N]`` (position of row 0's token; the token that row
    ``j`` decides sits at ``first_position + j + 1``). Returns (emitted ``[N, T]``, first ``accepted + 1``
    valid; accepted ``[N]``)."""
    n, t, v = target_probs.shape
    dev = target_probs.device
    j = torch.arange(t - 1, device=dev)
    pos = first_position.to(torch.int64).view(n, 1) + 1 + torch.arange(t, device=dev)   # [N, T] decided positions
    p_d = target_probs[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = uniforms(seeds, pos[:, :-1], SALT_ACCEPT)
    ok = (q_d > 0) & (u * q_d < p_d) & (j[None, :] < num_drafts.view(n, 1))   # u < p/q without a division
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    rows = torch.arange(n, device=dev)
    p_row = target_probs[rows, accepted]                                          # [N, V]
    rejected = accepted < num_drafts
    q_row = draft_probs[rows, accepted.clamp(max=t - 2)] * rejected.view(n, 1).to(draft_probs.dtype)
    residual = (p_row - q_row).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp_min(_TINY), p_row)
    last = race(dist, seeds, pos[rows, accepted], SALT_TOKEN)
    emitted = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    emitted[rows, accepted] = last
    return emitted, accepted


__all__ = ["SALT_ACCEPT", "SALT_DRAFT", "SALT_TOKEN", "accept_greedy", "accept_sampled", "mix32", "race",
           "stream_keys", "uniforms"]
