"""The collective side of tensor parallelism: row-parallel linears and the vocab-parallel embedding / LM head.

A column-parallel projection needs nothing beyond :class:`~glm5.layers.linear.Linear`: the rank's weight *is* its
slice of the output rows (the sharded loader hands it over, :mod:`glm5.distributed.sharding`), and the heads it
produces stay on the rank. Only the places where ranks must agree again need a collective:

* :class:`RowParallelLinear` — the rank holds a slice of the input columns, so its product is a partial sum:
  all-reduce over the TP group, then the bias once (attention ``o_proj``, MLP ``down_proj``).
* :class:`VocabParallelEmbedding` — the rank holds a contiguous vocab slice: ids outside it look up zeros and the
  all-reduce adds the one rank that has each row (exact: every other term is 0).
* :class:`ParallelLMHead` — each rank scores its vocab slice; the slices are gathered (rank order) and the
  padding columns dropped, so the sampler sees the full logits.

With a single-device :class:`~glm5.distributed.ParallelContext` every collective is the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.distributed import ParallelContext
from glm5.layers.linear import Linear


class RowParallelLinear:
    """``y = all_reduce(x_local W_localᵀ) + b`` (``reduce=False``: the partial sum, for a caller that adds
    several partials before one reduce)."""

    def __init__(self, linear: Linear, par: ParallelContext, reduce: bool = True):
        self.bias = linear.bias
        linear.bias = None
        self.linear, self.par, self.reduce = linear, par, reduce

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], prefix: str, par: ParallelContext,
             reduce: bool = True) -> "RowParallelLinear":
        return cls(Linear.load(weights, prefix), par, reduce)

    def __getattr__(self, name: str):
        # storage questions (method, quantized, dequantized, in_features, ...) are the inner linear's
        return getattr(self.__dict__["linear"], name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.reduce:
            y = self.par.tp_all_reduce(y)
        if self.bias is not None and (self.reduce or self.par.tp_rank == 0):  # a partial carries it once
            y = y + self.bias
        return y


class VocabParallelEmbedding:
    """Rows ``[tp_rank * per, (tp_rank + 1) * per)`` of the (zero-padded) vocabulary."""

    def __init__(self, weight: torch.Tensor, par: ParallelContext):
        self.weight, self.par = weight, par
        self.start = par.tp_rank * weight.shape[0] if par.tp_size > 1 else 0

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside[:, None], 0.0)
        return self.par.tp_all_reduce(h)


class ParallelLMHead:
    """Logits over the full vocabulary from per-rank vocab slices (gathered on every TP rank)."""

    def __init__(self, linear: Linear, par: ParallelContext, vocab_size: int):
        self.linear, self.par, self.vocab_size = linear, par, vocab_size

    def __getattr__(self, name: str):
        return getattr(self.__dict__["linear"], name)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.linear(h)
        if self.par.tp_size == 1:  # also at world size 1 / EP alone: nothing to gather
            return logits
        return self.par.tp_all_gather(logits)[..., : self.vocab_size]
