"""KDA (Kimi Delta Attention) layer over packed requests with per-request conv and recurrent state.

Per head the state ``S`` (d_k × d_v, fp32) evolves as ``S ← diag(exp g_t) S``,
``S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ``, ``o_t = Sᵀ q_t`` with l2-normalised q, k (q scaled by d^-0.5),
a per-channel forget gate ``g = lb·sigmoid(exp(A_log)·(f + dt_bias))`` (softplus form when the
bound is None) and a sigmoid β. Prefill chunks use the chunked WY form (within a chunk the
delta-rule updates are a triangular solve), single tokens the recurrence; both start from and
update the request's state slot, so a prompt can be split into chunks anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.distributed import ParallelContext
from glm5.layers.backends import kda_backend
from glm5.layers.batch import ForwardBatch
from glm5.layers.linear import Linear
from glm5.layers.parallel import RowParallelLinear
from glm5_kernels.norms_ref import gated_rms_norm, l2_normalize

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


def kda_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence → (output, new state). Leading dims broadcast, so the same step serves
    one request (q [H, d], state [H, dk, dv]) and a decode batch (q [N, H, d], state [N, H, dk, dv])."""
    state = state * g.exp().unsqueeze(-1)
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q,k,v,g: [n, H, d] fp32 (q pre-scaled); beta [n, H]; state [H, dk, dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t], state = kda_step(state, q[t], k[t], v[t], g[t], beta[t])
    return out, state


def kda_recurrent_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kda_recurrent` that also returns the state after every token: ``[n, H, dk, dv]``."""
    out = torch.empty_like(v)
    states = []
    for t in range(q.shape[0]):
        o, state = kda_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        out[t] = o[0]
        states.append(state)
    return out, torch.stack(states)


@dataclass
class KDARecord:
    """What a recording (verification) chunk needs to roll a KDA layer back to ``v`` accepted rows:
    conv state = ``conv_inputs[v : v + K - 1]``, recurrent state = ``states[v - 1]``."""

    conv_inputs: torch.Tensor  # [K - 1 + n, 3D]: old conv state then this step's pre-conv inputs
    states: torch.Tensor       # [n, H, dk, dv]

    def restore(self, conv_state: torch.Tensor, rec_state: torch.Tensor, valid_rows: int) -> None:
        k1 = conv_state.shape[0]
        conv_state.copy_(self.conv_inputs[valid_rows:valid_rows + k1])
        rec_state.copy_(self.states[valid_rows - 1])


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
    """Under tensor parallelism a rank runs ``linear_num_heads / TP`` heads: their q/k/v/β/gate rows, convs,
    decay parameters and state slots are the rank's; the low-rank ``f_a`` / ``g_a`` inputs are replicated and
    ``o_proj`` is row-parallel (all-reduce)."""

    def __init__(self, weights: dict[str, torch.Tensor], layer: int, cfg: TextConfig,
                 par: ParallelContext | None = None):
        par = par or ParallelContext.single()
        p = f"layers.{layer}.self_attn"
        self.layer = layer
        self.cfg = cfg
        self.heads, self.head_dim = cfg.linear_num_heads // par.tp_size, cfg.linear_head_dim
        self.dim = self.heads * self.head_dim
        # fused input projection: q | k | v | f_a | g_a | b
        self.in_proj = Linear.concat([Linear.load(weights, f"{p}.{n}_proj") for n in ("q", "k", "v", "f_a", "g_a", "b")])
        rank_f, rank_g = weights[f"{p}.f_a_proj.weight"].shape[0], weights[f"{p}.g_a_proj.weight"].shape[0]
        self.splits = [3 * self.dim, rank_f, rank_g, self.heads]
        # depthwise causal conv weights [3D, K] in q|k|v order
        self.conv_w = torch.cat([weights[f"{p}.{n}_conv1d.weight"] for n in ("q", "k", "v")]).squeeze(1)
        self.f_b = Linear.load(weights, f"{p}.f_b_proj")
        self.g_b = Linear.load(weights, f"{p}.g_b_proj")
        self.a_log = weights[f"{p}.A_log"]
        self.dt_bias = weights[f"{p}.dt_bias"]
        self.o_norm = weights[f"{p}.o_norm.weight"]
        self.a_log_flat = self.a_log.float().reshape(-1).contiguous()      # [H] for fla's in-kernel gate
        self.dt_bias_flat = self.dt_bias.float().reshape(-1).contiguous()  # [H * d]
        self.o_proj = RowParallelLinear.load(weights, f"{p}.o_proj", par)
        self._conv_inputs: dict[int, torch.Tensor] = {}  # recording chunks' conv inputs, per state slot

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        proj = self.in_proj(x)
        mixed, f_a, g_a, b = proj.split(self.splits, dim=-1)
        f = self.f_b(f_a)
        gate = self.g_b(g_a)
        conv_state, rec_state = cache.conv[self.layer], cache.recurrent[self.layer]
        if batch.decode is not None:
            core = self._core_decode(mixed, f, b, batch.decode.state_slots, conv_state, rec_state)
            y = gated_rms_norm(core.to(x.dtype), gate.view(-1, self.heads, self.head_dim), self.o_norm,
                               self.cfg.rms_norm_eps)
            return self.o_proj(y.reshape(x.shape[0], self.dim))
        if kda_backend(x.device, x.dtype) == "fla" and not any(s.record_states for s in batch.seqs):
            core = self._core_fla(mixed, f, b, batch, conv_state, rec_state)
        else:
            # verification batches need every row's state for rollback; fla 0.6.0's in-place kernel
            # cannot write per-row states outside the slot pool, so these (small) batches take the
            # reference recurrence. Documented in backends.py; not a silent change of results.
            g = kda_gate(f, self.a_log, self.dt_bias, self.cfg.linear_lower_bound, self.head_dim)
            core = self._core_torch(mixed, g, torch.sigmoid(b).float(), batch, conv_state, rec_state)
        y = gated_rms_norm(core.to(x.dtype), gate.view(-1, self.heads, self.head_dim), self.o_norm,
                           self.cfg.rms_norm_eps)
        return self.o_proj(y.reshape(x.shape[0], self.dim))

    # ------------------------------------------------------------------ conv + core recurrence
    def _conv(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU over every request's rows, updating its conv state; [T, 3D].

        Recording (verification) chunks leave their conv inputs in ``batch.records`` for rollback.
        """
        kconv = self.conv_w.shape[-1]
        if (mixed.is_cuda and len(batch.seqs) == mixed.shape[0]
                and all(s.num_tokens == 1 and not s.record_states for s in batch.seqs)):
            # GPU decode: one vectorised step for the whole batch (rows are in request order); the CPU
            # keeps the per-request conv1d below so its rounding stays that of the reference
            slots = torch.tensor([s.state_slot for s in batch.seqs], device=mixed.device)
            return self._conv_step(mixed, slots, conv_state)
        out = torch.empty_like(mixed)
        for s in batch.seqs:
            rows = slice(s.start, s.end)
            seq_in = torch.cat([conv_state[s.state_slot].to(mixed.dtype), mixed[rows]], dim=0)  # [K-1+n, 3D]
            if s.record_states:
                self._conv_inputs[s.state_slot] = seq_in
            conv_state[s.state_slot].copy_(seq_in[-(kconv - 1):])
            out[rows] = F.silu(F.conv1d(seq_in.t().unsqueeze(0), self.conv_w.unsqueeze(1).to(seq_in.dtype),
                                        groups=seq_in.shape[1])[0].t())
        return out

    def _conv_fla(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor, cu: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """:meth:`_conv` through fla's varlen Triton causal conv (SiLU fused, fp32 accumulation): cuDNN's
        depthwise conv1d took ~1 ms per layer for a 4K chunk. fla reads each request's history from an
        ``[N, 3D, K]`` initial state whose last ``K-1`` columns are the cached inputs, oldest first;
        the cached states are then updated exactly as :meth:`_conv` does. ``cu``: the requests' cumulative
        row offsets, ``slots``: their state slots (device tensors the caller also hands to the KDA kernels)."""
        if len(batch.seqs) == mixed.shape[0] and all(s.num_tokens == 1 for s in batch.seqs):
            return self._conv(mixed, batch, conv_state)
        from fla.modules.causal_conv1d import causal_conv1d

        kconv = self.conv_w.shape[-1]
        dev = mixed.device
        history = conv_state.index_select(0, slots).to(mixed.dtype)                        # [N, K-1, 3D]
        init = torch.zeros(len(batch.seqs), mixed.shape[1], kconv, device=dev, dtype=mixed.dtype)
        init[:, :, 1:] = history.transpose(1, 2)
        out, _ = causal_conv1d(mixed.unsqueeze(0), weight=self.conv_w.to(mixed.dtype), initial_state=init,
                               activation="silu", cu_seqlens=cu)
        for i, s in enumerate(batch.seqs):
            if s.num_tokens >= kconv - 1:
                conv_state[s.state_slot].copy_(mixed[s.end - (kconv - 1): s.end])
            else:
                conv_state[s.state_slot].copy_(torch.cat([history[i], mixed[s.start: s.end]])[-(kconv - 1):])
        return out[0]

    def _conv_step(self, mixed: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """One causal-conv step for a batch of single-token rows (row i ↔ state slot ``slots[i]``), updating
        the conv states; SiLU output ``[N, 3D]``."""
        window = torch.cat([conv_state.index_select(0, slots).to(mixed.dtype), mixed.unsqueeze(1)], dim=1)  # [N, K, 3D]
        conv_state.index_copy_(0, slots, window[:, 1:].to(conv_state.dtype))
        return F.silu((window * self.conv_w.t().to(mixed.dtype).unsqueeze(0)).sum(dim=1))

    def _core_decode(self, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     conv_state: torch.Tensor, rec_state: torch.Tensor) -> torch.Tensor:
        """Batched decode (one row per request, rows aligned with ``slots``): one conv step and one
        recurrence step for the whole batch, states gathered and written back by slot tensors — no
        host sync, CUDA-graph capturable. ``f`` is the gate projection before :func:`kda_gate`, ``b``
        the β logits. fla's ``fused_recurrent_kda_fwd`` updates the slot pool in place and computes
        the l2 norms, the gate and the β sigmoid inside the kernel (same formulas and eps as
        :func:`kda_gate` / ``l2_normalize``: ~20 fewer launches per layer); the torch step is the same
        recurrence vectorised over requests."""
        conv = self._conv_step(mixed, slots, conv_state)  # [N, 3D]
        n = mixed.shape[0]
        q, k, v = conv.view(n, 3, self.heads, self.head_dim).unbind(1)
        scale = self.head_dim ** -0.5
        if kda_backend(mixed.device, mixed.dtype) == "fla":
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

            v = v.contiguous().unsqueeze(1)
            out, _ = fused_recurrent_kda_fwd(
                q.contiguous().unsqueeze(1), k.contiguous().unsqueeze(1), v,
                f.view(n, 1, self.heads, self.head_dim).contiguous(), b.contiguous().unsqueeze(1),
                A_log=self.a_log_flat, dt_bias=self.dt_bias_flat, initial_state=rec_state, scale=scale,
                inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=self.cfg.linear_lower_bound, out=torch.empty_like(v))
            return out[:, 0]  # model dtype: the output norm takes it as is
        g = kda_gate(f, self.a_log, self.dt_bias, self.cfg.linear_lower_bound, self.head_dim)
        beta = torch.sigmoid(b).float()
        q = l2_normalize(q.float()) * scale
        k = l2_normalize(k.float())
        out, state = kda_step(rec_state.index_select(0, slots), q, k, v.float(), g, beta)  # state [N, H, dk, dv]
        rec_state.index_copy_(0, slots, state)
        return out

    def _core_torch(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch,
                    conv_state: torch.Tensor, rec_state: torch.Tensor) -> torch.Tensor:
        """Reference path (CPU default): per request, recurrence for short runs, chunked WY form else."""
        conv = self._conv(mixed, batch, conv_state)
        core = torch.empty(mixed.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=mixed.device)
        for s in batch.seqs:
            rows = slice(s.start, s.end)
            q, k, v = conv[rows].float().view(s.num_tokens, 3, self.heads, self.head_dim).unbind(1)
            q = l2_normalize(q) * self.head_dim ** -0.5
            k = l2_normalize(k)
            if s.record_states:
                out, states = kda_recurrent_states(q, k, v, g[rows], beta[rows], rec_state[s.state_slot])
                batch.records[(self.layer, s.state_slot)] = KDARecord(self._conv_inputs.pop(s.state_slot), states)
                new_state = states[-1]
            else:
                fn = kda_recurrent if s.num_tokens <= RECURRENT_MAX_TOKENS else kda_chunked
                out, new_state = fn(q, k, v, g[rows], beta[rows], rec_state[s.state_slot])
            rec_state[s.state_slot].copy_(new_state)
            core[rows] = out
        return core

    def _core_fla(self, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
                  conv_state: torch.Tensor, rec_state: torch.Tensor) -> torch.Tensor:
        """fla-core path (CUDA): one varlen launch for the whole batch, in the model dtype.

        Decode / verification-sized batches (every request ≤ ``RECURRENT_MAX_TOKENS`` rows) run
        ``fused_recurrent_kda_fwd`` directly on the state-slot pool (gathered and updated in place
        through ``ssm_state_indices``); prefill batches run ``chunk_kda`` from the gathered slots
        and scatter the final states back. Both take the raw gate projection ``f`` and β logits ``b``
        and compute the q/k l2 norms, :func:`kda_gate` and the β sigmoid inside the kernels (same
        formulas and eps): at an 8K prefill the torch versions of those were ~20 fp32 passes over
        ``[T, H·d]`` per layer. ``safe_gate`` (fla's M=16 tensor-core path for gates bounded below)
        is taken when the config bounds the gate in fla's supported range.
        """
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        n_tok, dev = mixed.shape[0], mixed.device
        lens = [s.num_tokens for s in batch.seqs]
        cu = torch.tensor([0] + lens, device=dev).cumsum(0)
        slot_t = torch.tensor([s.state_slot for s in batch.seqs], device=dev)
        conv = self._conv_fla(mixed, batch, conv_state, cu, slot_t)
        q, k, v = (t.contiguous().unsqueeze(0) for t in conv.view(n_tok, 3, self.heads, self.head_dim).unbind(1))
        f4 = f.view(1, n_tok, self.heads, self.head_dim)
        b3 = b.contiguous().unsqueeze(0)
        lower = self.cfg.linear_lower_bound
        gate = dict(A_log=self.a_log_flat, dt_bias=self.dt_bias_flat, lower_bound=lower, scale=self.head_dim ** -0.5,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if max(lens) <= RECURRENT_MAX_TOKENS:
            # every step of a request writes its (single) slot: [N, T_max] indices all equal to the slot
            idx = slot_t.to(torch.int32).unsqueeze(1).expand(-1, max(lens)).contiguous()
            out, _ = fused_recurrent_kda_fwd(q, k, v, f4, b3, initial_state=rec_state, inplace_final_state=True,
                                             cu_seqlens=cu, ssm_state_indices=idx, out=torch.empty_like(v), **gate)
        else:
            safe = lower is not None and -5.0 <= lower < 0.0
            out, final = chunk_kda(q, k, v, f4.contiguous(), b3, initial_state=rec_state[slot_t].contiguous(),
                                   output_final_state=True, cu_seqlens=cu, safe_gate=safe, **gate)
            rec_state[slot_t] = final.to(rec_state.dtype)
        return out[0]
