"""NoPE multi-head latent attention restricted by the kpool indexer.

Only the ``kv_lora_rank``-wide normalised latent ``c_kv`` is cached per token. Two forms of the same
attention: expanded (per-head K/V from the latent with ``kv_b_proj``, ``[K_h; V_h] = W_kvb[h] c``) and
absorbed (``q̃_h = W_UKᵀ q_h`` scores the latent directly and ``W_UV`` maps the attention-weighted latent
back, which touches ``kv_lora_rank`` numbers per key instead of ``heads·(d_k+d_v)``). Decode and short runs
(speculative verification) use the absorbed form, on CUDA over each query's gathered selected rows. Prefill
chunks: on the Triton backend (CUDA bf16) each query attends to its own selected latent rows with the
absorbed sparse kernel (:mod:`glm5_kernels.sparse_mla_prefill`, which has the FLOP/byte argument); the SDPA
(CUDA fp32) and torch (CPU reference) backends expand K/V and mask the scores with the indexer's selection.
Chunks that are dense causal from position 0 run SDPA's causal flash kernel on CUDA. No host sync on the CUDA
paths; no rope anywhere (qk_rope_head_dim = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.distributed import ParallelContext
from glm5.layers.backends import attn_backend, decode_attn_backend
from glm5.layers.batch import ForwardBatch, SeqChunk
from glm5.layers.elementwise import rms_norm
from glm5.layers.indexer import KPoolIndexer
from glm5.layers.linear import Linear, MultiOutputLinear, split_heads
from glm5.layers.overlap import StreamOverlap
from glm5.layers.parallel import RowParallelLinear

ABSORB_MAX_TOKENS = 8


class MLALayer:
    """Under tensor parallelism a rank runs ``num_attention_heads / TP`` heads (its rows of ``q_b_proj`` and
    ``kv_b_proj``); the latent ``c_kv`` feeds every head, so ``q_a`` / ``kv_a`` and the latent cache are
    replicated, and ``o_proj`` is row-parallel (all-reduce)."""

    def __init__(self, weights: dict[str, torch.Tensor], layer: int, cfg: TextConfig,
                 par: ParallelContext | None = None, overlap: StreamOverlap | None = None):
        par = par or ParallelContext.single()
        p = f"layers.{layer}.self_attn"
        self.layer, self.cfg = layer, cfg
        self.overlap = overlap or StreamOverlap()
        self.heads = cfg.num_attention_heads // par.tp_size
        self.d_qk, self.d_v, self.rank = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        # everything that reads the block input x in one GEMM (two in fp8: the bf16 compress gate is separate):
        # q_a, kv_a, the indexer's wk and its pool compress gate
        self.x_proj = MultiOutputLinear([Linear.load(weights, f"{p}.q_a_proj"),
                                         Linear.load(weights, f"{p}.kv_a_proj_with_mqa"),
                                         *KPoolIndexer.key_projections(weights, f"{p}.indexer")])
        self.q_lora_rank = self.x_proj.out_features[0]
        self.q_a_norm = weights[f"{p}.q_a_layernorm.weight"]
        self.q_b = Linear.load(weights, f"{p}.q_b_proj")
        self.kv_a_norm = weights[f"{p}.kv_a_layernorm.weight"]
        self.kv_b = Linear.load(weights, f"{p}.kv_b_proj")
        self.o_proj = RowParallelLinear.load(weights, f"{p}.o_proj", par)
        # absorbed views of kv_b (this rank's heads): W_UKᵀ [h, r, d_qk] (q → latent query), W_UV [h, d_v, r]
        # (latent → output); fp8 storage stays fp8 when the head dims are whole 128-row scale blocks
        # (linear.split_heads)
        self.w_uk_t, self.w_uv = split_heads(self.kv_b, self.heads, (self.d_qk, self.d_v), self.q_a_norm.dtype)
        self.scale = self.d_qk ** -0.5
        self.indexer = KPoolIndexer(weights, f"{p}.indexer", cfg, par, own_key_proj=False)
        self._kernel_width = self.rank >= 16 and self.rank & (self.rank - 1) == 0  # what the sparse kernel takes

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        q_a, kv_a, k_raw, index_gate = self.x_proj(x)
        q_resid = rms_norm(q_a, self.q_a_norm, eps)
        if batch.decode is not None:
            return self._decode(x, q_resid, kv_a, k_raw, index_gate, batch, cache)
        q = self.q_b(q_resid).view(-1, self.heads, self.d_qk)
        latent = rms_norm(kv_a, self.kv_a_norm, eps)
        raw_index = self.indexer.keys(x, (k_raw, index_gate))
        lat_cache = cache.latent[self.layer]
        backend = attn_backend(x.device, x.dtype, self.rank)
        # one request's chunk (a long prefill) keeps its attention output as it comes: no copy into a batch buffer
        whole = len(batch.seqs) == 1 and batch.seqs[0].num_tokens == x.shape[0]
        out = None if whole else torch.empty(x.shape[0], self.heads, self.d_v, dtype=x.dtype, device=x.device)
        for s in batch.seqs:
            rows = slice(s.start, s.end)
            lat_cache[cache.token_slots(s.block_table, batch.positions[rows])] = latent[rows].to(lat_cache.dtype)
            self.indexer.write(raw_index[rows], s, cache, self.layer, batch.records)
            if backend == "torch":
                o = self._attend_reference(x[rows], q_resid[rows], q[rows], s, cache, batch.shared_pools)
            elif batch.shared_pools is None and (
                    (backend == "triton" and not self._causal_from_start(s))
                    or (s.num_tokens <= ABSORB_MAX_TOKENS and self._kernel_width)):
                # short runs (verification rows, per-request decode) gather their selected rows on both CUDA
                # paths, as the batched decode does, instead of masking every cached token
                o = self._sparse(x[rows], q_resid[rows], q[rows], s, batch.positions[rows], cache)
            else:
                o = self._attend_masked(x[rows], q_resid[rows], q[rows], s, cache, batch.shared_pools)
            if out is None:
                out = o.to(x.dtype)
            else:
                out[rows] = o
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _causal_from_start(self, s: SeqChunk) -> bool:
        """A chunk from position 0 whose queries all attend densely: SDPA's causal flash kernel (expanded K/V,
        half the FLOPs per pair of the absorbed form) is the cheapest way to compute it."""
        return s.context_len == 0 and s.num_tokens > ABSORB_MAX_TOKENS and self.indexer.dense(s)

    def _attend_reference(self, x: torch.Tensor, q_resid: torch.Tensor, q: torch.Tensor, s: SeqChunk,
                          cache: HybridCache, shared_pools: dict | None) -> torch.Tensor:
        """The CPU reference: the selection mask over the keys some query of the chunk uses (the ``nonzero``
        compaction keeps the fp32 sums exactly those of transformers), absorbed for short runs."""
        lat_cache = cache.latent[self.layer]
        visible = self.indexer.visible(x, q_resid, s, cache, self.layer, shared_pools)  # [n, L]
        keys_used = visible.any(0).nonzero().squeeze(1)
        ctx = lat_cache[cache.token_slots(s.block_table, keys_used)].to(x.dtype)  # [L', r]
        mask = visible[:, keys_used]
        if s.num_tokens <= ABSORB_MAX_TOKENS:
            return self._absorbed(q, ctx, mask)
        return self._expanded(q, ctx, mask)

    def _attend_masked(self, x: torch.Tensor, q_resid: torch.Tensor, q: torch.Tensor, s: SeqChunk,
                       cache: HybridCache, shared_pools: dict | None) -> torch.Tensor:
        """CUDA masked path (SDPA prefill chunks; also the Triton backend's dense-from-0 chunks and MTP draft
        steps that share pools): the selection mask over every cached token of the request, sizes from the
        host — no host sync. Dense chunks from position 0 run the causal flash kernel."""
        lat_cache = cache.latent[self.layer]
        keys = torch.arange(s.total_len, device=x.device)
        ctx = lat_cache[cache.token_slots(s.block_table, keys)].to(x.dtype)  # [L, r]
        if self._causal_from_start(s):
            return self._expanded_sdpa(q, ctx, None)
        visible = self.indexer.visible(x, q_resid, s, cache, self.layer, shared_pools)  # [n, L]
        if s.num_tokens <= ABSORB_MAX_TOKENS:
            return self._absorbed(q, ctx, visible)
        return self._expanded_sdpa(q, ctx, visible)

    def _sparse(self, x: torch.Tensor, q_resid: torch.Tensor, q: torch.Tensor, s: SeqChunk,
                positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Per-query latent-row lists from the indexer, then the sparse absorbed attention
        (:mod:`glm5_kernels.sparse_mla_prefill`; IEEE products in fp32) — only the selected (query, key) pairs,
        no host sync.
        ``q̃ = W_UKᵀ q`` and ``W_UV õ`` are the absorbed per-head linears (bf16 or fp8, ``split_heads``)."""
        from glm5_kernels.sparse_mla_prefill import sparse_mla_prefill
        idx, counts = self.indexer.prefill_select(x, q_resid, s, positions, cache, self.layer)
        q_lat = self.w_uk_t(q)                                                        # [n, h, r]
        o_lat = torch.empty_like(q_lat)
        sparse_mla_prefill(q_lat, cache.latent[self.layer], idx, counts, self.scale, out=o_lat)
        return self.w_uv(o_lat)                                                       # [n, h, d_v]

    def _decode(self, x: torch.Tensor, q_resid: torch.Tensor, kv_a: torch.Tensor, k_raw: torch.Tensor,
                index_gate: torch.Tensor | None, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """Batched decode (one query row per request): every request's selection and attention in
        a few batch-wide launches — no per-request loop, no host sync, so a CUDA graph can capture it.
        Same function as the per-request path: latent write, tail append / pool completion, index
        scores, top pools by (score, pool id), expansion + tail, absorbed attention over the selection.
        The query path (``q_b`` and ``W_UK``, weight streams) runs on the side stream beside the latent write
        and the indexer's selection (latency-bound launches) at small batch (glm5.layers.overlap)."""
        meta = batch.decode
        with self.overlap.branch(x) as side:
            q_lat = self.w_uk_t(self.q_b(q_resid).view(-1, self.heads, self.d_qk))
        latent = rms_norm(kv_a, self.kv_a_norm, self.cfg.rms_norm_eps)
        raw_index = self.indexer.keys(x, (k_raw, index_gate))
        lat_cache = cache.latent[self.layer]
        lat_cache.index_copy_(0, meta.slot_mapping, latent.to(lat_cache.dtype))
        idx, counts = self.indexer.decode_select(x, q_resid, raw_index, batch.positions, meta, cache, self.layer)
        side.join()
        backend = decode_attn_backend(x.device, x.dtype, self.rank)
        if backend == "triton":
            from glm5_kernels.sparse_mla_decode import sparse_mla_decode
            o_lat = sparse_mla_decode(q_lat, lat_cache, idx, self.scale, counts=counts, out_dtype=x.dtype)
        elif backend == "flashinfer":
            if meta.flashinfer is None:
                raise RuntimeError("decode_attn_backend is flashinfer but the step was not planned: the model "
                                   "runner must set DecodeMeta.flashinfer (FlashInferSparseMLA.plan) before the forward")
            o_lat = meta.flashinfer.run(q_lat, lat_cache, idx)
        else:
            from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref
            o_lat = sparse_mla_decode_ref(q_lat, lat_cache, idx, self.scale)
        out = self.w_uv(o_lat.to(x.dtype))
        return self.o_proj(out.reshape(x.shape[0], -1))

    def commit_verification(self, buffers, slots: torch.Tensor, ctx: torch.Tensor, n_valid: torch.Tensor, t: int,
                            cache: HybridCache) -> None:
        """After batched verification (glm5.layers.speculative): only the kpool tail needs repair; latent rows
        and pooled keys written by rejected rows are rewritten before any query reads them."""
        self.indexer.commit_tail(self.layer, buffers, slots, ctx, n_valid, t, cache)

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scores = scores.masked_fill(~mask.unsqueeze(0), torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)

    def _expanded(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kv = self.kv_b(ctx).view(-1, self.heads, self.d_qk + self.d_v)
        k, v = kv.split([self.d_qk, self.d_v], dim=-1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * self.scale
        probs = self._softmax(scores, mask, q.dtype)
        return torch.einsum("hnl,lhd->nhd", probs, v)

    def _expanded_sdpa(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Same function as :meth:`_expanded` through PyTorch's fused attention (CUDA prefill).

        ``mask=None``: the chunk's selection is the full causal triangle from position 0, so the flash kernel
        runs (``is_causal``); otherwise the boolean selection mask goes to the memory-efficient kernel, so the
        ``[heads, n, L]`` score matrix is never materialised.
        """
        kv = self.kv_b(ctx).view(-1, self.heads, self.d_qk + self.d_v)
        k, v = (t.transpose(0, 1).unsqueeze(0) for t in kv.split([self.d_qk, self.d_v], dim=-1))
        qh = q.transpose(0, 1).unsqueeze(0)
        if mask is None:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask[None, None], scale=self.scale)
        return o[0].transpose(0, 1)

    def _absorbed(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q_lat = self.w_uk_t(q).transpose(0, 1)  # [h, n, r]
        scores = torch.matmul(q_lat, ctx.t()) * self.scale  # [h, n, L]
        probs = self._softmax(scores, mask, q.dtype)
        o_lat = torch.matmul(probs, ctx)  # [h, n, r]
        return self.w_uv(o_lat.transpose(0, 1))
