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
from typing import Callable

import torch
import torch.nn.functional as F

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.distributed import ParallelContext
from glm5.layers.backends import fuse_backend, kda_backend, kda_step_backend
from glm5.layers.batch import ForwardBatch
from glm5.layers.elementwise import gated_rms_norm
from glm5.layers.linear import Linear
from glm5.layers.overlap import StreamOverlap
from glm5.layers.parallel import RowParallelLinear
from glm5_kernels.kda_decode_ref import kda_conv_step_ref
from glm5_kernels.kda_verify_ref import kda_commit_recurrence_ref, kda_gate, kda_step, kda_verify_recurrence_ref
from glm5_kernels.norms_ref import l2_normalize

CHUNK_SIZE = 64
RECURRENT_MAX_TOKENS = 8  # decode and speculative verification rows use the plain recurrence


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q,k,v,g: [n, H, d] fp32 (q pre-scaled); beta [n, H]; state [H, dk, dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t], state = kda_step(state, q[t], k[t], v[t], g[t], beta[t])
    return out, state


@dataclass
class KDARecord:
    """What a recording (verification) chunk of the per-request path keeps to commit ``v`` accepted rows:
    conv state = ``conv_inputs[v : v + K - 1]``; the recurrent state, which the chunk left as it was before
    the step, advances by the first ``v`` rows of the normalised inputs (no per-row state copies)."""

    conv_inputs: torch.Tensor  # [K - 1 + n, 3D]: old conv state then this step's pre-conv inputs
    q: torch.Tensor            # [n, H, d] fp32, l2-normalised and scaled
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor         # [n, H]

    def restore(self, conv_state: torch.Tensor, rec_state: torch.Tensor, valid_rows: int) -> None:
        k1 = conv_state.shape[0]
        conv_state.copy_(self.conv_inputs[valid_rows:valid_rows + k1])
        if valid_rows > 0:
            _, state = kda_recurrent(self.q[:valid_rows], self.k[:valid_rows], self.v[:valid_rows],
                                     self.g[:valid_rows], self.beta[:valid_rows], rec_state)
            rec_state.copy_(state)


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
                 par: ParallelContext | None = None, overlap: StreamOverlap | None = None):
        par = par or ParallelContext.single()
        p = f"layers.{layer}.self_attn"
        self.layer = layer
        self.cfg = cfg
        self.overlap = overlap or StreamOverlap()
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
        self.a_log_flat = self.a_log.float().reshape(-1).contiguous()      # [H] for the in-kernel gates
        self.dt_bias_flat = self.dt_bias.float().reshape(-1).contiguous()  # [H * d]
        self.o_proj = RowParallelLinear.load(weights, f"{p}.o_proj", par)
        self._conv_inputs: dict[int, torch.Tensor] = {}  # recording chunks' conv inputs, per state slot

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        proj = self.in_proj(x)
        mixed, f_a, g_a, b = proj.split(self.splits, dim=-1)
        conv_state, rec_state = cache.conv[self.layer], cache.recurrent[self.layer]
        if batch.decode is not None:
            # the two low-rank gate projections run on the side stream at small batch (glm5.layers.overlap):
            # f beside the conv step, the output gate beside the recurrence
            with self.overlap.branch(x) as f_side:
                f = self.f_b(f_a)
            with self.overlap.branch(x) as gate_side:
                gate = self.g_b(g_a)
            if batch.decode.rows_per_seq > 1:
                f_side.join()
                core = self._core_verify(mixed, f, b, batch.decode, conv_state, rec_state)
            else:
                core = self._core_decode(mixed, f, b, batch.decode.state_slots, conv_state, rec_state,
                                         f_ready=f_side.join)
            gate_side.join()
            y = gated_rms_norm(core.to(x.dtype), gate.view(-1, self.heads, self.head_dim), self.o_norm,
                               self.cfg.rms_norm_eps)
            return self.o_proj(y.reshape(x.shape[0], self.dim))
        f = self.f_b(f_a)
        gate = self.g_b(g_a)
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
            return self._conv_step(mixed, batch.seq_tensors(mixed.device).state_slots, conv_state)
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

    def _conv_fla(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_conv` through fla's varlen Triton causal conv (SiLU fused, fp32 accumulation), as q, k, v
        ``[T, D]`` each, contiguous: cuDNN's depthwise conv1d took ~1 ms per layer for a 4K chunk. One conv
        launch per third of the channels, each writing its own tensor, because fla's KDA kernels read
        ``[T, H, d]`` rows densely: slicing one ``[T, 3D]`` output cost three strided copies per layer (165 µs
        each at 8192 rows on the H200, 3.0 ms of an 8K prefill). fla reads each request's history from an
        ``[N, D, K]`` initial state whose last ``K-1`` columns are the cached inputs, oldest first; the cached
        states are then updated exactly as :meth:`_conv` does. The row offsets, slots and fla's chunk list
        come from :meth:`ForwardBatch.seq_tensors` (built from host lengths: fla would otherwise derive the
        chunk list from the device offsets, a host sync per call)."""
        d = mixed.shape[1] // 3
        if len(batch.seqs) == mixed.shape[0] and all(s.num_tokens == 1 for s in batch.seqs):
            q, k, v = self._conv(mixed, batch, conv_state).split(d, dim=-1)
            return q.contiguous(), k.contiguous(), v.contiguous()
        from fla.modules.causal_conv1d import causal_conv1d

        kconv = self.conv_w.shape[-1]
        dev = mixed.device
        meta = batch.seq_tensors(dev)
        n = len(batch.seqs)
        history = conv_state.index_select(0, meta.state_slots).to(mixed.dtype)             # [N, K-1, 3D]
        init = torch.zeros(3, n, d, kconv, device=dev, dtype=mixed.dtype)                  # q, k, v thirds
        init[..., 1:] = history.view(n, kconv - 1, 3, d).permute(2, 0, 3, 1)
        weight = self.conv_w.to(mixed.dtype)
        outs = []
        for j in range(3):
            cols = slice(j * d, (j + 1) * d)
            y, _ = causal_conv1d(mixed[:, cols].unsqueeze(0), weight=weight[cols], initial_state=init[j],
                                 activation="silu", cu_seqlens=meta.cu_seqlens, chunk_indices=meta.conv_chunk_indices)
            outs.append(y[0])
        for i, s in enumerate(batch.seqs):
            if s.num_tokens >= kconv - 1:
                conv_state[s.state_slot].copy_(mixed[s.end - (kconv - 1): s.end])
            else:
                conv_state[s.state_slot].copy_(torch.cat([history[i], mixed[s.start: s.end]])[-(kconv - 1):])
        return outs[0], outs[1], outs[2]

    def _conv_step(self, mixed: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """One causal-conv step for a batch of single-token rows (row i ↔ state slot ``slots[i]``), updating
        the conv states; SiLU output ``[N, 3D]`` (:func:`glm5_kernels.kda_decode_ref.kda_conv_step_ref`)."""
        return kda_conv_step_ref(mixed, conv_state, slots, self.conv_w)

    def _qkv_decode(self, mixed: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv step of a decode batch → (q, k, v ``[N, H, d]``, β logits ``[N, H]``). The fused kernel
        (:func:`glm5_kernels.kda_decode.kda_conv_step`, one launch) writes q, k, v and β contiguous, as fla's
        recurrent kernel reads them; the torch path returns views of the reference step's output."""
        n = mixed.shape[0]
        if fuse_backend(mixed.device, mixed.dtype) == "triton":
            from glm5_kernels.kda_decode import kda_conv_step
            qkv, beta = kda_conv_step(mixed, conv_state, slots, self.conv_w, parts=3, extra=b)
            q, k, v = (t.view(n, self.heads, self.head_dim) for t in qkv.unbind(0))
            return q, k, v, beta
        conv = self._conv_step(mixed, slots, conv_state)  # [N, 3D]
        q, k, v = conv.view(n, 3, self.heads, self.head_dim).unbind(1)
        return q, k, v, b

    def _core_decode(self, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     conv_state: torch.Tensor, rec_state: torch.Tensor,
                     f_ready: Callable[[], None] | None = None) -> torch.Tensor:
        """Batched decode (one row per request, rows aligned with ``slots``): one conv step and one
        recurrence step for the whole batch, states gathered and written back by slot tensors — no
        host sync, CUDA-graph capturable. ``f`` is the gate projection before :func:`kda_gate`, ``b``
        the β logits; ``f_ready`` is called after the conv step, before ``f`` is read (the caller's join of
        the branch computing it). Our recurrence kernel (``kda_step`` backend, :func:`glm5_kernels.kda_verify.
        kda_decode_recurrence`) or fla's ``fused_recurrent_kda_fwd`` updates the slot pool in place and
        computes the l2 norms, the gate and the β sigmoid inside the kernel (same formulas and eps as
        :func:`kda_gate` / ``l2_normalize``: ~20 fewer launches per layer). Ours takes its value-block tile
        from a measured table: at the real shape it moves the states at 86-89 % of the copy bandwidth at
        batch 64-256 where fla's fixed 32-column tile reaches 60-73 % (docs/gpu.md). The torch step is the
        same recurrence vectorised over requests."""
        q, k, v, b = self._qkv_decode(mixed, b, slots, conv_state)
        if f_ready is not None:
            f_ready()
        n = mixed.shape[0]
        scale = self.head_dim ** -0.5
        if kda_step_backend(mixed.device, mixed.dtype, decode=True) == "triton":
            from glm5_kernels.kda_verify import kda_decode_recurrence
            return kda_decode_recurrence(q, k, v, f, b, rec_state, slots, self.a_log_flat, self.dt_bias_flat,
                                         self.cfg.linear_lower_bound, scale)
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

    # ------------------------------------------------------------------ speculative verification (batched)
    def _conv_rows(self, mixed: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal conv + SiLU of ``T`` consecutive rows per request (``mixed [n, T, 3D]``) from the requests'
        conv states, which are not written. Returns (SiLU output ``[n, T, 3D]``, the window
        ``[n, K-1+T, 3D]`` = conv state then the rows). The taps are summed in order, as :meth:`_conv_step`
        sums them for one row."""
        kconv, t = self.conv_w.shape[-1], mixed.shape[1]
        window = torch.cat([conv_state.index_select(0, slots).to(mixed.dtype), mixed], dim=1)
        w = self.conv_w.t().to(mixed.dtype)  # [K, 3D]
        acc = window[:, :t] * w[0]
        for j in range(1, kconv):
            acc = acc + window[:, j:j + t] * w[j]
        return F.silu(acc), window

    def _spec_recurrence(self, commit: bool):
        if kda_step_backend(self.conv_w.device, self.conv_w.dtype) == "triton":
            from glm5_kernels.kda_verify import kda_commit_recurrence, kda_verify_recurrence
            return kda_commit_recurrence if commit else kda_verify_recurrence
        return kda_commit_recurrence_ref if commit else kda_verify_recurrence_ref

    def _core_verify(self, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, meta, conv_state: torch.Tensor,
                     rec_state: torch.Tensor) -> torch.Tensor:
        """Verification rows (``meta.rows_per_seq`` per request, consecutive): one recurrence per request over
        its rows from its state, which stays unchanged, as does the conv state; the rows' inputs go to
        ``meta.verify`` for :meth:`commit_verification` (see glm5.layers.speculative). fp32 ``[rows, H, d]``."""
        t, rows = meta.rows_per_seq, mixed.shape[0]
        n = rows // t
        meta.verify.check(n, t)
        buf_mixed, buf_f, buf_b = (x[:rows] for x in meta.verify.kda[self.layer])
        buf_mixed.copy_(mixed)
        buf_f.copy_(f)
        buf_b.copy_(b)
        slots = meta.state_slots.view(n, t)[:, 0]
        conv, _ = self._conv_rows(buf_mixed.view(n, t, -1), slots, conv_state)
        q, k, v = conv.view(n, t, 3, self.heads, self.head_dim).unbind(2)
        out = self._spec_recurrence(commit=False)(
            q, k, v, buf_f.view(n, t, -1), buf_b.view(n, t, -1), rec_state, slots, self.a_log_flat,
            self.dt_bias_flat, self.cfg.linear_lower_bound, self.head_dim ** -0.5)
        return out.view(rows, self.heads, self.head_dim)

    def commit_verification(self, buffers, slots: torch.Tensor, ctx: torch.Tensor, n_valid: torch.Tensor, t: int,
                            cache: HybridCache) -> None:
        """Advance each request's conv and recurrent state by its first ``n_valid`` verification rows."""
        conv_state, rec_state = cache.conv[self.layer], cache.recurrent[self.layer]
        n = slots.shape[0]
        buf_mixed, buf_f, buf_b = (x[:n * t] for x in buffers.kda[self.layer])
        conv, window = self._conv_rows(buf_mixed.view(n, t, -1), slots, conv_state)
        q, k, v = conv.view(n, t, 3, self.heads, self.head_dim).unbind(2)
        self._spec_recurrence(commit=True)(
            q, k, v, buf_f.view(n, t, -1), buf_b.view(n, t, -1), rec_state, slots, n_valid, self.a_log_flat,
            self.dt_bias_flat, self.cfg.linear_lower_bound, self.head_dim ** -0.5)
        k1 = conv_state.shape[1]
        idx = n_valid.view(n, 1) + torch.arange(k1, device=slots.device)   # the last K-1 inputs after v rows
        idx = idx.unsqueeze(-1).expand(-1, -1, window.shape[-1])
        conv_state.index_copy_(0, slots, window.gather(1, idx).to(conv_state.dtype))

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
            if s.record_states:  # the state stays as before the step until the commit (KDARecord)
                out, _ = kda_recurrent(q, k, v, g[rows], beta[rows], rec_state[s.state_slot])
                batch.records[(self.layer, s.state_slot)] = KDARecord(self._conv_inputs.pop(s.state_slot), q, k, v,
                                                                      g[rows], beta[rows])
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
        is taken when the config bounds the gate in fla's supported range. No host sync: the offsets and
        slots are :meth:`ForwardBatch.seq_tensors` and ``chunk_kda`` builds its chunk list on the device
        (``use_graph``: a fixed-size list from the shapes, sentinel rows past the real chunks).
        """
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        n_tok, dev = mixed.shape[0], mixed.device
        meta = batch.seq_tensors(dev)
        cu, slot_t = meta.cu_seqlens, meta.state_slots
        q, k, v = (t.view(1, n_tok, self.heads, self.head_dim) for t in self._conv_fla(mixed, batch, conv_state))
        f4 = f.view(1, n_tok, self.heads, self.head_dim)
        b3 = b.contiguous().unsqueeze(0)
        lower = self.cfg.linear_lower_bound
        gate = dict(A_log=self.a_log_flat, dt_bias=self.dt_bias_flat, lower_bound=lower, scale=self.head_dim ** -0.5,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if meta.max_len <= RECURRENT_MAX_TOKENS:
            # every step of a request writes its (single) slot: [N, T_max] indices all equal to the slot
            idx = slot_t.to(torch.int32).unsqueeze(1).expand(-1, meta.max_len).contiguous()
            out, _ = fused_recurrent_kda_fwd(q, k, v, f4, b3, initial_state=rec_state, inplace_final_state=True,
                                             cu_seqlens=cu, ssm_state_indices=idx, out=torch.empty_like(v), **gate)
        else:
            safe = lower is not None and -5.0 <= lower < 0.0
            out, final = chunk_kda(q, k, v, f4.contiguous(), b3, initial_state=rec_state[slot_t].contiguous(),
                                   output_final_state=True, cu_seqlens=cu, safe_gate=safe, use_graph=True,
                                   max_num_seqs=len(batch.seqs), **gate)
            rec_state[slot_t] = final.to(rec_state.dtype)
        return out[0]
