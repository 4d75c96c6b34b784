"""The GLM-5.3-Flash text model over a packed batch: embeddings → mHC decoder layers → stream mean →
final norm → logits. Layer blocks are chosen from the config (KDA or MLA attention, dense or MoE FFN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import ModelConfig
from glm5.distributed import ParallelContext
from glm5.layers.batch import ForwardBatch
from glm5.layers.elementwise import rms_norm
from glm5.layers.kda import KDALayer
from glm5.layers.linear import Linear
from glm5.layers.mhc import HyperConnection
from glm5.layers.mla import MLALayer
from glm5.layers.mlp import DenseMLP
from glm5.layers.moe import MoE
from glm5.layers.overlap import StreamOverlap
from glm5.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from glm5.layers.vision import VisionTower


class DecoderLayer:
    def __init__(self, weights: dict[str, torch.Tensor], layer: int, cfg: ModelConfig, par: ParallelContext,
                 overlap: StreamOverlap | None = None):
        t = cfg.text
        p = f"layers.{layer}"
        self.attn = KDALayer(weights, layer, t, par, overlap) if t.layer_kinds[layer] == "kda" \
            else MLALayer(weights, layer, t, par, overlap)
        self.mlp = DenseMLP(weights, f"{p}.mlp", t.swiglu_limit, par) if t.mlp_kinds[layer] == "dense" \
            else MoE(weights, f"{p}.mlp", t, par, overlap)
        self.attn_hc = HyperConnection(weights, f"{p}.hc_attn", t)
        self.ffn_hc = HyperConnection(weights, f"{p}.hc_ffn", t)
        self.in_norm = weights[f"{p}.input_layernorm.weight"]
        self.post_norm = weights[f"{p}.post_attention_layernorm.weight"]
        self.eps = t.rms_norm_eps

    def __call__(self, streams: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        x, post, comb = self.attn_hc.pre(streams, self.in_norm, self.eps)
        streams = HyperConnection.post(self.attn(x, batch, cache), streams, post, comb)
        x, post, comb = self.ffn_hc.pre(streams, self.post_norm, self.eps)
        return HyperConnection.post(self.mlp(x), streams, post, comb)


@dataclass
class ModelOutput:
    logits: torch.Tensor   # fp32 [L, vocab] for batch.logits_indices
    hidden: torch.Tensor   # final normed hidden [T, H] (the MTP layer's input)


class Glm5ForCausalLM:
    """``par``: this rank's place in a tensor/expert-parallel layout; ``weights`` are then the rank's shards
    (:mod:`glm5.distributed.sharding`). The embedding and LM head are vocab-parallel, mHC and norms replicated.
    ``overlap``: the side stream its layers fork independent branches onto (:mod:`glm5.layers.overlap`); the
    MTP layer shares it."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], par: ParallelContext | None = None):
        self.cfg = cfg
        self.par = par = par or ParallelContext.single()
        self.overlap = StreamOverlap()
        t = cfg.text
        self.embed = VocabParallelEmbedding(weights["embed_tokens.weight"], par)
        self.layers = [DecoderLayer(weights, i, cfg, par, self.overlap) for i in range(t.num_hidden_layers)]
        self.norm = weights["norm.weight"]
        self.lm_head = ParallelLMHead(Linear(weights["embed_tokens.weight"]) if t.tie_word_embeddings
                                      else Linear.load(weights, "lm_head"), par, t.vocab_size)
        self.vision = VisionTower(weights, cfg.vision) if cfg.vision is not None and "visual.patch_embed.proj.weight" in weights else None
        self.weights = weights

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    @torch.no_grad()
    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed(batch.input_ids)
        if batch.mm_embeds is not None and batch.mm_rows is not None and batch.mm_rows.numel():
            h[batch.mm_rows] = batch.mm_embeds.to(h.dtype)
        return h

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: HybridCache) -> ModelOutput:
        h = self.embed_tokens(batch)
        # every stream starts as the embedding; a concatenation copies it at full bandwidth, where the broadcast
        # copy of expand().contiguous() took 353 µs for an 8K chunk's 268 MB on the H200
        streams = torch.cat([h] * self.cfg.text.hc_mult, dim=-1).view(h.shape[0], self.cfg.text.hc_mult, h.shape[1])
        for layer in self.layers:
            streams = layer(streams, batch, cache)
        hidden = rms_norm(streams.mean(dim=1), self.norm, self.cfg.text.rms_norm_eps)
        logits = self.lm_head(hidden[batch.logits_indices]).float()
        return ModelOutput(logits=logits, hidden=hidden)
