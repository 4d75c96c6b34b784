"""The network's one linear type: ``y = x Wᵀ (+ b)``.

Every projection of the text model (MLA, KDA, indexer, dense MLP, shared experts, MTP, LM head) is a
:class:`Linear` instead of a raw weight tensor handed to ``F.linear``. How a weight is stored (model dtype, or
block-scaled fp8 with its scales) and which shard of it a device holds (column- or row-parallel, and the
collective that follows) change *how a linear is stored and applied*, not the block that uses it; keeping that
in one type means the blocks do not learn about dtypes or ranks (the shape of vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear`` with quant methods, and of nano-vllm's ``layers/linear.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """A weight ``[out_features, in_features]`` and an optional bias ``[out_features]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in]; got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match the weight's {weight.shape[0]} outputs")
        self.weight = weight
        self.bias = bias

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], prefix: str) -> "Linear":
        """``{prefix}.weight`` (and ``{prefix}.bias`` when the checkpoint has one)."""
        return cls(weights[f"{prefix}.weight"], weights.get(f"{prefix}.bias"))

    @classmethod
    def concat(cls, parts: list["Linear"]) -> "Linear":
        """One linear whose outputs are ``parts``' outputs side by side (one GEMM instead of several)."""
        biases = [p.bias for p in parts]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise ValueError("concatenated linears must all have a bias or none")
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(torch.cat([p.weight for p in parts]), bias)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
