"""fp8 mode of the pooled index-key cache (opt-in; exact mode is the default).

As in the upstream serving design (model-spec §4.2): each pooled key is rotated by a normalised
Hadamard transform (blocks of 128 channels, or the whole key when it is shorter), then stored as
e4m3 with one power-of-two scale per key; the indexer query is rotated the same way and quantised
per head vector, its scale folded into the head weights. The rotation is orthogonal, so exact dot
products are unchanged; it spreads outliers so that one scale per key loses less. Selection can
differ from exact mode near ties: ``tests/test_indexer_fp8.py`` measures the top-k overlap.
"""

from __future__ import annotations

import functools
import math

import torch

E4M3_MAX = 448.0
MIN_ABSMAX = 1e-4


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} must be a power of two; index_head_dim must be one (128 on the real model)")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@functools.lru_cache(maxsize=16)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    """The matrix on ``device``, made once: a host-to-device copy per call could not be graph-captured."""
    return _hadamard(n).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthogonal rotation of the last dim, in blocks of min(128, d) channels; fp32 result."""
    d = x.shape[-1]
    block = min(128, d)
    h = _hadamard_on(block, x.device)
    return (x.float().reshape(*x.shape[:-1], d // block, block) @ h).reshape(x.shape)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last dim) e4m3 with a power-of-two scale: returns (values, scale [..., 1] fp32)."""
    absmax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(MIN_ABSMAX)
    scale = torch.exp2(torch.ceil(torch.log2(absmax / E4M3_MAX)))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def encode_keys(pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled keys [P, d] (model dtype) → (e4m3 [P, d], scale [P, 1]) of the rotated, bf16-rounded keys."""
    return quantize_e4m3(hadamard_rotate(pooled.to(torch.bfloat16)).to(torch.bfloat16))


def fp8_index_scores(q: torch.Tensor, head_w: torch.Tensor, keys8: torch.Tensor, key_scale: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Index scores ``[n, P]`` in fp8 mode: ``Σ_h w_h·qs_h·ks·relu(q8_h·k8) · softmax_scale``.

    q [n, heads, d] (not rotated), head_w [n, heads] (already × heads^-0.5), keys8/key_scale from
    :func:`encode_keys`. The positive scales commute with the ReLU, so they are applied after it."""
    q8, qs = quantize_e4m3(hadamard_rotate(q).to(torch.bfloat16))
    dots = torch.relu(torch.matmul(q8.float(), keys8.float().t()))          # [n, h, P]
    w = head_w.float() * qs.squeeze(-1) * softmax_scale                      # [n, h]
    return torch.matmul(w.unsqueeze(-2), dots).squeeze(-2) * key_scale.view(1, -1)
