"""The kpool-compressed DSA "lightning" indexer: which cached tokens each MLA query attends to.

Every ``kpool`` consecutive tokens (anchored at position 0) form a pool; once complete, its tokens'
index keys are merged into one pooled key by a per-channel softmax over ``gate score + ape``.
A query at position ``i`` scores the complete pools whose last token is ≤ i, keeps the top
``index_topk / kpool`` of them, expands them back to tokens and always adds the raw tokens of its
own incomplete pool (the "tail"). While ``floor((i+1)/kpool) ≤ index_topk/kpool`` this is every
token ``≤ i`` (dense causal), so scoring is skipped.

Cache use (see :mod:`glm5.cache.hybrid_cache`): complete pools are written once to ``pool_keys``;
the raw (key, gate score) rows of the pool in progress wait in the request's ``tail`` slot, so
chunk boundaries and single-token decode steps complete pools exactly like a full prefill.
This is the exact mode (keys in the model dtype, fp32 scores); it selects what transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.distributed import ParallelContext
from glm5.layers.backends import index_backend
from glm5.layers.batch import DecodeMeta, SeqChunk
from glm5.layers.linear import Linear
from glm5_kernels.indexer_ref import index_scores_ref
from glm5_kernels.kpool_ref import kpool_compress_write_ref
from glm5_kernels.norms_ref import layer_norm


@dataclass
class TailRecord:
    """The tail before a recording chunk plus its raw rows: rebuilds the tail for ``v`` accepted rows."""

    indexer: "KPoolIndexer"
    old_tail: torch.Tensor   # [context_len % kpool, 2d]
    raw: torch.Tensor        # [n, 2d]
    context_len: int

    def restore(self, tail: torch.Tensor, valid_rows: int) -> None:
        kp = self.indexer.kpool
        span = torch.cat([self.old_tail, self.raw[:valid_rows]], dim=0)
        n_complete = (self.context_len + valid_rows) // kp - self.context_len // kp
        rest = span[n_complete * kp:]
        tail[: rest.shape[0]] = rest.to(tail.dtype)


class KPoolIndexer:
    """Under tensor parallelism a rank scores with ``index_n_heads / TP`` heads (its rows of ``wq_b`` and
    ``weights_proj``). The score is a sum over heads, so the ranks' partial scores are all-reduced *before* the
    top-k: every rank then selects the same pools as one device would. The pooled key (``wk``, norm, compress
    gate) is shared by all heads, so the key path and the pool / tail caches are replicated."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, cfg: TextConfig,
                 par: ParallelContext | None = None, own_key_proj: bool = True):
        """``own_key_proj=False``: the caller computes ``wk`` and the compress gate of ``x`` in its own fused
        input projection (:meth:`key_projections`) and passes them to :meth:`keys`."""
        self.par = par or ParallelContext.single()
        self.cfg = cfg
        self.wq_b = Linear.load(weights, f"{prefix}.wq_b")
        self.wk = Linear.load(weights, f"{prefix}.wk") if own_key_proj else None
        self.k_norm_w = weights[f"{prefix}.k_norm.weight"]
        self.k_norm_b = weights[f"{prefix}.k_norm.bias"]
        self.w_heads = Linear.load(weights, f"{prefix}.weights_proj")
        self.gate = Linear(weights[f"{prefix}.index_kpool_compress_gate"]) if own_key_proj else None
        self.ape = weights[f"{prefix}.index_kpool_compress_ape"].float()
        self.kpool = cfg.index_kpool
        self.n_heads, self.head_dim = cfg.index_n_heads // self.par.tp_size, cfg.index_head_dim
        self.head_w_scale = cfg.index_n_heads ** -0.5  # the model's head count, not the rank's
        self.n_select = cfg.index_topk // cfg.index_kpool

    @staticmethod
    def key_projections(weights: dict[str, torch.Tensor], prefix: str) -> list[Linear]:
        """``wk`` and the pool compress gate, the two linears of ``x`` behind :meth:`keys`."""
        return [Linear.load(weights, f"{prefix}.wk"), Linear(weights[f"{prefix}.index_kpool_compress_gate"])]

    def keys(self, x: torch.Tensor, projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Per-token raw index state ``[T, 2*d] = key | gate score``; ``projected`` = (``wk(x)``, ``gate(x)``)
        when the caller computed them (``own_key_proj=False``)."""
        k_raw, gate = projected if projected is not None else (self.wk(x), self.gate(x))
        k = layer_norm(k_raw, self.k_norm_w, self.k_norm_b, 1e-6)
        return torch.cat([k, gate], dim=-1)

    def write(self, raw: torch.Tensor, seq: SeqChunk, cache: HybridCache, layer: int,
              records: dict | None = None) -> None:
        """Complete the pools this chunk finishes and keep the unfinished remainder in the tail.

        Pools completed by rows that a speculative verification later rejects are harmless: a pool
        is read only by queries at or after its last token, and that position is written again
        (same slot) before any such query runs. The tail is not: a rejected row in the next pool
        overwrites tail rows of the current one, so recording chunks keep the old tail
        (:class:`TailRecord`) for :meth:`TailRecord.restore`."""
        kp = self.kpool
        tail = cache.tail[layer][seq.state_slot]
        if seq.record_states and records is not None:
            records[(layer, seq.state_slot)] = TailRecord(self, tail[: seq.context_len % kp].clone(), raw,
                                                          seq.context_len)
        first_pool, end_pool = seq.context_len // kp, seq.total_len // kp
        span = torch.cat([tail[: seq.context_len % kp], raw], dim=0)  # starts at position first_pool*kp
        n_complete = end_pool - first_pool
        if n_complete > 0:
            members = span[: n_complete * kp].view(n_complete, kp, -1)
            slots = cache.pool_slots(seq.block_table, torch.arange(first_pool, end_pool, device=raw.device))
            scales = cache.pool_scales[layer] if cache.index_fp8 else None
            if index_backend(raw.device, raw.dtype) == "triton":
                from glm5_kernels.kpool import kpool_compress_write
                kpool_compress_write(members.contiguous(), self.ape, slots, cache.pool_keys[layer], scales)
            else:
                kpool_compress_write_ref(members, self.ape, slots, cache.pool_keys[layer], scales)
        rest = span[n_complete * kp:]
        tail[: rest.shape[0]] = rest.to(tail.dtype)

    def visible(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqChunk, cache: HybridCache,
                layer: int, shared_pools: dict | None = None) -> torch.Tensor:
        """Boolean ``[n, total_len]``: which cached tokens each of this request's queries attends to.

        ``shared_pools`` (MTP draft steps with ``index_share_for_mtp_iteration``): the first draft
        step stores its chosen pools there, later steps reuse them instead of scoring again (their
        own tail is still appended). Sizes come from the host-side lengths (the last query sees
        ``total_len // kpool`` complete pools), so nothing here waits for the GPU."""
        kp, device = self.kpool, x.device
        pos = torch.arange(seq.context_len, seq.total_len, device=device)
        n_complete = torch.div(pos + 1, kp, rounding_mode="floor")  # complete pools visible per query
        key_pos = torch.arange(seq.total_len, device=device)
        causal = key_pos[None, :] <= pos[:, None]
        n_pools = seq.total_len // kp                               # == n_complete.max()
        if n_pools <= self.n_select:
            return causal  # every visible pool is selected: dense causal attention
        candidate = torch.arange(n_pools, device=device)[None, :] < n_complete[:, None]
        key = (layer, seq.state_slot)
        if shared_pools is not None and key in shared_pools:
            first = shared_pools[key][-1]
            chosen = torch.zeros_like(candidate)
            chosen[:, : first.shape[0]] = first
            chosen &= candidate
        else:
            index_scores = self._scores(x, q_resid, seq, cache, layer, n_complete, n_pools)
            index_scores = index_scores.masked_fill(~candidate, torch.finfo(index_scores.dtype).min)
            # Ties are real (a pool whose every head dot product is negative scores exactly 0 after the
            # ReLU): break them by pool id (stable sort) so that a request's selection does not depend on
            # how many rows share its step — torch.topk's tie order does.
            top = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, : min(self.n_select, n_pools)]
            chosen = torch.zeros_like(candidate).scatter_(1, top, True) & candidate  # [n, P]
            if shared_pools is not None:
                shared_pools[key] = chosen
        token_chosen = torch.zeros(pos.shape[0], seq.total_len, dtype=torch.bool, device=device)
        pooled_tokens = chosen.repeat_interleave(kp, dim=1)
        token_chosen[:, : pooled_tokens.shape[1]] = pooled_tokens
        tail = (key_pos[None, :] >= (n_complete * kp)[:, None]) & causal
        return token_chosen | tail

    def _scores(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqChunk, cache: HybridCache, layer: int,
                n_complete: torch.Tensor, n_pools: int) -> torch.Tensor:
        """Index scores ``[n, n_pools]`` fp32 of one request's queries over its first ``n_pools`` pools."""
        device = x.device
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        w = self.w_heads(x).float() * self.head_w_scale
        scales = cache.pool_scales[layer] if cache.index_fp8 else None
        if index_backend(device, cache.dtype) == "triton":
            # the kernel reads the pooled keys in place: no [n, heads, pools] fp32 intermediate
            from glm5_kernels.indexer import indexer_scores
            rows = torch.zeros(q.shape[0], dtype=torch.int32, device=device)
            return self.par.tp_all_reduce(indexer_scores(
                q, w, cache.pool_keys[layer], scales, seq.block_table.to(torch.int32)[None], rows, n_complete,
                cache.pools_per_block, self.head_dim ** -0.5, n_pools))
        slots = cache.pool_slots(seq.block_table, torch.arange(n_pools, device=device))
        return self.par.tp_all_reduce(index_scores_ref(q, w, cache.pool_keys[layer][slots],
                                                       None if scales is None else scales[slots], self.head_dim ** -0.5))

    def commit_tail(self, layer: int, buffers, slots: torch.Tensor, ctx: torch.Tensor, n_valid: torch.Tensor, t: int,
                    cache: HybridCache) -> None:
        """After batched verification: each request's tail as of its first ``n_valid`` rows (positions
        ``ctx .. ctx + n_valid - 1``), rebuilt from the tail before the step and the rows' raw keys. Tail row
        ``j`` holds position ``P + j`` with ``P = (ctx + n_valid) // kpool * kpool``: from the old tail when that
        is before ``ctx``, else from the rows; rows past the accepted length are never read."""
        kp, n = self.kpool, slots.shape[0]
        old = buffers.tail_before[layer][:n]
        raw = buffers.index_raw[layer][: n * t].view(n, t, -1)
        first = torch.div(ctx + n_valid, kp, rounding_mode="floor") * kp
        rel = first.view(n, 1) + torch.arange(kp, device=slots.device) - ctx.view(n, 1)     # [n, kpool]
        from_rows = raw.gather(1, rel.clamp(0, t - 1).unsqueeze(-1).expand(-1, -1, raw.shape[-1]))
        cache.tail[layer].index_copy_(0, slots, torch.where((rel < 0).unsqueeze(-1), old, from_rows).to(old.dtype))

    def dense(self, seq: SeqChunk) -> bool:
        """Every query of ``seq`` attends to every token up to itself (no query sees more complete pools
        than are selected); host arithmetic."""
        return seq.total_len // self.kpool <= self.n_select

    def prefill_select(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqChunk, positions: torch.Tensor,
                       cache: HybridCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`visible` selects, as per-query latent-row lists for the sparse prefill kernel: ``idx
        [n, index_topk + kpool - 1]`` int32 (valid rows first, in position order, ``-1`` after) and ``counts
        [n]`` int32. Same scores and the same choice (top pools by (score, pool id), expanded, plus the
        query's own incomplete pool) as the decode path (:func:`glm5_kernels.indexer.select_token_slots`),
        with one block-table row for the whole chunk. Call after :meth:`write` (the chunk's completed pools
        must be in the cache). Dense chunks (:meth:`dense`) skip the scoring. No host sync."""
        kp, bs, n = self.kpool, cache.block_size, x.shape[0]
        triton_path = index_backend(x.device, cache.dtype) == "triton"
        if triton_path:
            from glm5_kernels.indexer import indexer_scores, select_token_slots
        else:
            from glm5_kernels.indexer_ref import indexer_scores_ref as indexer_scores
            from glm5_kernels.indexer_ref import select_token_slots_ref as select_token_slots
        n_complete = torch.div(positions + 1, kp, rounding_mode="floor")
        max_pools = seq.total_len // kp
        bt = seq.block_table.to(torch.int32).unsqueeze(0)
        rows = torch.zeros(n, dtype=torch.int32, device=x.device)
        if self.dense(seq):
            # every row takes all its pools: the selection does not read the scores
            scores = torch.zeros(n, max(max_pools, 1), dtype=torch.float32, device=x.device)
        else:
            q = self.wq_b(q_resid).view(n, self.n_heads, self.head_dim)
            w = self.w_heads(x).float() * self.head_w_scale
            pool_scales = cache.pool_scales[layer] if cache.index_fp8 else None
            # a sum over heads: with the heads split across ranks, reduce the partial sums before the top-k
            scores = self.par.tp_all_reduce(indexer_scores(q, w, cache.pool_keys[layer], pool_scales, bt, rows,
                                                           n_complete, cache.pools_per_block, self.head_dim ** -0.5,
                                                           max_pools))
        args = (scores, n_complete, positions, bt, rows, self.n_select, kp, bs)
        if triton_path:
            counts = torch.empty(n, dtype=torch.int32, device=x.device)
            return select_token_slots(*args, counts_out=counts), counts
        from glm5_kernels.indexer_ref import count_selected
        return select_token_slots(*args), count_selected(positions, self.n_select, kp).to(torch.int32)

    # ------------------------------------------------------------------ batched decode
    def decode_select(self, x: torch.Tensor, q_resid: torch.Tensor, raw: torch.Tensor, positions: torch.Tensor,
                      meta: DecodeMeta,
                      cache: HybridCache, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batched decode counterpart of :meth:`write` + :meth:`visible` (one row per request): appends
        every row's raw key to its tail (completing the pool when the row is its last token), scores the
        visible pools and returns the latent rows each query attends to, ``[N, index_topk + kpool - 1]``
        int32 with the valid entries first and ``-1`` after, plus (Triton path) each row's count of valid
        entries, ``[N]`` int32. Dense rows (few enough complete pools) select every pool, so they get all
        their tokens, as :meth:`visible` does. ``raw`` is :meth:`keys` of ``x``.

        ``meta.index_scores[layer]`` (MTP draft steps with index sharing): reuse these scores (a previous
        step's, one row per request) instead of scoring; pools completed since then score ``-inf`` there, so
        the selection is the earlier step's pools plus this row's own tail, as :meth:`visible` shares them."""
        triton_path = index_backend(x.device, x.dtype) == "triton"
        if triton_path:
            from glm5_kernels.indexer import indexer_scores, select_token_slots
            from glm5_kernels.kpool import kpool_decode_append
        else:
            from glm5_kernels.indexer_ref import indexer_scores_ref as indexer_scores
            from glm5_kernels.indexer_ref import select_token_slots_ref as select_token_slots
            from glm5_kernels.kpool_ref import kpool_decode_append_ref as kpool_decode_append
        kp, bs = self.kpool, cache.block_size
        pool_keys = cache.pool_keys[layer]
        scales = cache.pool_scales[layer] if cache.index_fp8 else None
        n = x.shape[0]
        if meta.verify is not None:  # verification rows: keep the tail as it was and the rows' keys for the commit
            t = meta.rows_per_seq
            slots = meta.state_slots.view(n // t, t)[:, 0]
            meta.verify.tail_before[layer][: n // t].copy_(cache.tail[layer].index_select(0, slots))
            meta.verify.index_raw[layer][:n].copy_(raw)
        kpool_decode_append(raw, positions, meta.state_slots, meta.block_tables, cache.tail[layer], self.ape,
                            pool_keys, scales, kp, bs)
        n_complete = torch.div(positions + 1, kp, rounding_mode="floor")
        row_seq = torch.arange(n, device=x.device, dtype=torch.int32)
        scores = meta.index_scores.get(layer) if meta.index_scores is not None else None
        if scores is None:
            q = self.wq_b(q_resid).view(n, self.n_heads, self.head_dim)
            w = self.w_heads(x).float() * self.head_w_scale
            max_pools = meta.block_tables.shape[1] * cache.pools_per_block
            scores = self.par.tp_all_reduce(indexer_scores(q, w, pool_keys, scales, meta.block_tables, row_seq,
                                                           n_complete, cache.pools_per_block, self.head_dim ** -0.5,
                                                           max_pools))
            if meta.scores_out is not None:
                meta.scores_out[layer] = scores
        args = (scores, n_complete, positions, meta.block_tables, row_seq, self.n_select, kp, bs)
        if not triton_path:
            return select_token_slots(*args), None
        counts = torch.empty(n, dtype=torch.int32, device=x.device)
        return select_token_slots(*args, counts_out=counts), counts
