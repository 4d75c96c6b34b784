"""The MTP (next-n prediction) layer that drafts tokens for speculative decoding (model-spec §8).

Row ``p`` combines the embedding of token ``p+1`` with the target's final hidden state at ``p``::

    e  = embed(x[p+1])            (zeroed when p == 0)
    u  = eh_proj([enorm(e) ; hnorm(h[p])])
    u += MLA_L(input_layernorm(u))          own latent / pooled-key / tail caches at position p
    u += MoE_L(post_attention_layernorm(u))
    h' = shared_head.norm(u);  logits = lm_head(h')

A plain pre-norm block: no mHC. Sharded like the decoder's MLA and MoE layers; ``embed`` / ``lm_head`` are the
main model's (vocab-parallel) ones; ``eh_proj`` is replicated. Later draft steps feed ``h'`` back as the hidden (post-norm
recycling) and, with ``index_share_for_mtp_iteration``, reuse the first step's pool selection.

Reduced draft vocabulary (EAGLE-3's idea): with ``draft_vocab`` (token ids, most frequent first) the
draft logits come from an LM head over those rows only — a copy of them, so a draft step reads
``len(draft_vocab) / vocab`` of the head — and every other token gets ``-inf``. Only the drafts change
(their acceptance may drop); verification uses the full head, so outputs stay exact.
"""

from __future__ import annotations

from typing import Callable

import torch

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import ModelConfig
from glm5.distributed import ParallelContext
from glm5.layers.batch import ForwardBatch
from glm5.layers.linear import Linear
from glm5.layers.mla import MLALayer
from glm5.layers.mlp import DenseMLP
from glm5.layers.moe import MoE
from glm5.layers.overlap import StreamOverlap
from glm5_kernels.norms_ref import rms_norm


class MissingMTPWeights(ValueError):
    pass


class MTPLayer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                 embed: Callable[[torch.Tensor], torch.Tensor], lm_head: Callable[[torch.Tensor], torch.Tensor],
                 par: ParallelContext | None = None, draft_vocab: torch.Tensor | None = None,
                 overlap: StreamOverlap | None = None):
        t = cfg.text
        p = f"layers.{layer}"
        if f"{p}.eh_proj.weight" not in weights:
            raise MissingMTPWeights(
                f"speculative decoding needs the MTP layer weights ({p}.eh_proj.weight, ...), which this checkpoint "
                "lacks; use a checkpoint with num_nextn_predict_layers >= 1 and its layers.N.* tensors, or set "
                "num_speculative_tokens=0")
        self.layer, self.cfg = layer, cfg
        self.eps = t.rms_norm_eps
        self.embed, self.lm_head = embed, lm_head
        self.vocab_size = lm_head.out_features
        self.draft_ids: torch.Tensor | None = None
        if draft_vocab is not None:
            ids = draft_vocab.to(device=lm_head.weight.device, dtype=torch.int64)
            if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab must be 1-D token ids in [0, {self.vocab_size}); got shape "
                                 f"{tuple(ids.shape)}")
            self.draft_ids = ids
            self.draft_head = Linear(lm_head.weight.index_select(0, ids).contiguous())
        self.enorm = weights[f"{p}.enorm.weight"]
        self.hnorm = weights[f"{p}.hnorm.weight"]
        self.eh_proj = Linear.load(weights, f"{p}.eh_proj")
        self.in_norm = weights[f"{p}.input_layernorm.weight"]
        self.post_norm = weights[f"{p}.post_attention_layernorm.weight"]
        self.head_norm = weights[f"{p}.shared_head.norm.weight"]
        self.attn = MLALayer(weights, layer, t, par, overlap)
        self.mlp = DenseMLP(weights, f"{p}.mlp", t.swiglu_limit, par) if t.mtp_mlp_kind() == "dense" \
            else MoE(weights, f"{p}.mlp", t, par, overlap)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch.input_ids`` = the *next* tokens (x[p+1]) at ``batch.positions`` = p; ``hidden`` = h[p].
        Returns (fp32 logits at ``batch.logits_indices``, recycled hidden h' [T, H])."""
        e = self.embed(batch.input_ids)
        e = e.masked_fill((batch.positions == 0)[:, None], 0.0)
        u = self.eh_proj(torch.cat([rms_norm(e, self.enorm, self.eps), rms_norm(hidden.to(e.dtype), self.hnorm, self.eps)],
                                   dim=-1))
        u = u + self.attn(rms_norm(u, self.in_norm, self.eps), batch, cache)
        u = u + self.mlp(rms_norm(u, self.post_norm, self.eps))
        h = rms_norm(u, self.head_norm, self.eps)
        rows = h[batch.logits_indices]
        if self.draft_ids is None:
            return self.lm_head(rows).float(), h
        logits = torch.full((rows.shape[0], self.vocab_size), float("-inf"), device=h.device, dtype=torch.float32)
        logits[:, self.draft_ids] = self.draft_head(rows).float()
        return logits, h
