"""Clamped SwiGLU feed-forward (dense layers, shared experts, routed experts, vision MLP).

GLM-5.3-Flash clamps the gate from above and the up projection on both sides with
``swiglu_limit`` everywhere a SwiGLU appears; forgetting the clamp is invisible on small
activations and wrong on large ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.distributed import ParallelContext
from glm5.layers.elementwise import clamped_swiglu
from glm5.layers.linear import Linear, MultiOutputLinear
from glm5.layers.parallel import RowParallelLinear


def swiglu_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, limit: float,
               gate_b: torch.Tensor | None = None, up_b: torch.Tensor | None = None,
               down_b: torch.Tensor | None = None) -> torch.Tensor:
    """The vision tower's SwiGLU (raw weight tensors with biases)."""
    h = clamped_swiglu(F.linear(x, gate_w, gate_b), F.linear(x, up_w, up_b), limit)
    return F.linear(h, down_w, down_b)


class DenseMLP:
    """SwiGLU of the first ``first_k_dense_replace`` layers and of the shared experts
    (``{prefix}.{gate,up,down}_proj``).

    Under tensor parallelism gate/up are column-parallel (the rank's slice of the intermediate dim) and down is
    row-parallel; ``reduce=False`` returns the rank's partial sum (the MoE adds it to the routed partial and
    reduces once)."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, limit: float,
                 par: ParallelContext | None = None, reduce: bool = True):
        par = par or ParallelContext.single()
        # gate and up: one GEMM (two column views of its output)
        self.gate_up = MultiOutputLinear([Linear.load(weights, f"{prefix}.{n}_proj") for n in ("gate", "up")])
        self.down = RowParallelLinear.load(weights, f"{prefix}.down_proj", par, reduce)
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(clamped_swiglu(gate, up, self.limit))
