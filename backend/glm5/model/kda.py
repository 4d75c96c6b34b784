"""KDA (Kimi Delta Attention) layer over packed requests with per-request conv and recurrent state.

Per head the state ``S`` (d_k × d_v, fp32) evolves as ``S ← diag(exp g_t) S``,
``S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ``, ``o_t = Sᵀ q_t`` with l2-normalised q, k (q scaled by d^-0.5),
a per-channel forget gate ``g = lb·sigmoid(exp(A_log)·(f + dt_bias))`` (softplus form when the
bound is None) and a sigmoid β. Prefill chunks use the chunked WY form (within a chunk the
delta-rule updates are a triangular solve), single tokens the recurrence; both start from and
update the request's state slot, so a prompt can be split into chunks anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.model.batch import ForwardBatch
from glm5.model.norms import gated_rms_norm, l2_normalize

CHUNK_SIZE = 64
RECURRENT_MAX_TOKENS = 8  # decode and speculative verification rows use the plain recurrence


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
             head_dim: int) -> torch.Tensor:
    """Forget gate in log space, [T, H, d] fp32, every entry < 0."""
    g = (f.float() + dt_bias.float()).view(f.shape[0], -1, head_dim)
    rate = torch.exp(a_log.float()).view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q,k,v,g: [n, H, d] fp32 (q pre-scaled); beta [n, H]; state [H, dk, dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp().unsqueeze(-1)
        kv_mem = (state * k[t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (state * q[t].unsqueeze(-1)).sum(dim=-2)
    return out, state


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form of :func:`kda_recurrent`; same arguments, same results up to rounding."""
    n, h, dk = k.shape
    pad = (-n) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    nc = (n + pad) // chunk
    # [H, nc, C, d]
    q, k, v, g = (x.view(nc, chunk, h, -1).permute(2, 0, 1, 3) for x in (q, k, v, g))
    beta = beta.view(nc, chunk, h).permute(2, 0, 1)
    g = g.cumsum(dim=-2)
    strict_upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)
    # decay[i, j, c] = exp(G_i,c - G_j,c) for j <= i, 0 above the diagonal
    diff = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_upper[..., None], float("-inf"))
    decay = diff.exp()
    k_beta = k * beta.unsqueeze(-1)
    m = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(~torch.tril(
        torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=-1), 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + m, eye.expand_as(m), upper=False, unitriangular=True)
    u = t_inv @ (v * beta.unsqueeze(-1))
    w = t_inv @ (k_beta * g.exp())
    qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # [H, nc, C, C], lower incl. diagonal
    out = torch.empty_like(v)
    for c in range(nc):
        g_c = g[:, c]
        v_new = u[:, c] - w[:, c] @ state
        out[:, c] = (q[:, c] * g_c.exp()) @ state + qk[:, c] @ v_new
        g_last = g_c[:, -1:]
        state = state * g_last.transpose(-1, -2).exp() + (k[:, c] * (g_last - g_c).exp()).transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(nc * chunk, h, -1)[:n]
    return out, state


class KDALayer:
    def __init__(self, weights: dict[str, torch.Tensor], layer: int, cfg: TextConfig):
        p = f"layers.{layer}.self_attn"
        self.layer = layer
        self.cfg = cfg
        self.heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        self.dim = self.heads * self.head_dim
        # fused input projection: q | k | v | f_a | g_a | b
        self.w_in = torch.cat([weights[f"{p}.q_proj.weight"], weights[f"{p}.k_proj.weight"],
                               weights[f"{p}.v_proj.weight"], weights[f"{p}.f_a_proj.weight"],
                               weights[f"{p}.g_a_proj.weight"], weights[f"{p}.b_proj.weight"]])
        self.splits = [3 * self.dim, self.head_dim, self.head_dim, self.heads]
        # depthwise causal conv weights [3D, K] in q|k|v order
        self.conv_w = torch.cat([weights[f"{p}.{n}_conv1d.weight"] for n in ("q", "k", "v")]).squeeze(1)
        self.f_b = weights[f"{p}.f_b_proj.weight"]
        self.g_b = weights[f"{p}.g_b_proj.weight"]
        self.a_log = weights[f"{p}.A_log"]
        self.dt_bias = weights[f"{p}.dt_bias"]
        self.o_norm = weights[f"{p}.o_norm.weight"]
        self.o_proj = weights[f"{p}.o_proj.weight"]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        proj = F.linear(x, self.w_in)
        mixed, f_a, g_a, b = proj.split(self.splits, dim=-1)
        g = kda_gate(F.linear(f_a, self.f_b), self.a_log, self.dt_bias, self.cfg.linear_lower_bound, self.head_dim)
        beta = torch.sigmoid(b).float()
        gate = F.linear(g_a, self.g_b)
        conv_state, rec_state = cache.conv[self.layer], cache.recurrent[self.layer]
        core = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        kconv = self.conv_w.shape[-1]
        for s in batch.seqs:
            rows = slice(s.start, s.end)
            seq_in = torch.cat([conv_state[s.state_slot].to(mixed.dtype), mixed[rows]], dim=0)  # [K-1+n, 3D]
            conv_state[s.state_slot].copy_(seq_in[-(kconv - 1):])
            conv = F.conv1d(seq_in.t().unsqueeze(0), self.conv_w.unsqueeze(1).to(seq_in.dtype),
                            groups=seq_in.shape[1])[0].t()  # [n, 3D]
            q, k, v = F.silu(conv).float().view(s.num_tokens, 3, self.heads, self.head_dim).unbind(1)
            q = l2_normalize(q) * self.head_dim ** -0.5
            k = l2_normalize(k)
            fn = kda_recurrent if s.num_tokens <= RECURRENT_MAX_TOKENS else kda_chunked
            out, new_state = fn(q, k, v, g[rows], beta[rows], rec_state[s.state_slot])
            rec_state[s.state_slot].copy_(new_state)
            core[rows] = out
        y = gated_rms_norm(core.to(x.dtype), gate.view(-1, self.heads, self.head_dim), self.o_norm,
                           self.cfg.rms_norm_eps)
        return F.linear(y.reshape(x.shape[0], self.dim), self.o_proj)
