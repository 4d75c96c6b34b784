"""Which slice of every canonical weight one rank holds: the single table that the sharded loader, the sharded
dummy weights and the memory plan all read (so what is loaded, what the layers expect and what the docs count
cannot drift apart).

Per canonical tensor (names of :mod:`glm5.weights.names`):

* **column-parallel** (split on the output rows, dim 0): the per-head projections — KDA ``q/k/v_proj``, their
  convs, ``f_b_proj``, ``g_b_proj``, ``b_proj``, ``A_log``, ``dt_bias``; MLA ``q_b_proj``, ``kv_b_proj`` (rows are
  head-major, 256 K then 256 V rows per head); indexer ``wq_b`` and ``weights_proj``; dense-MLP and shared-expert
  ``gate/up_proj``.
* **row-parallel** (split on the input columns, dim 1; an all-reduce follows): attention ``o_proj``, MLP and
  shared-expert ``down_proj``.
* **vocab-parallel** (dim 0, padded to a multiple of TP with zero rows): ``embed_tokens``, ``lm_head``.
* **routed experts** ``[E, I, H]`` / ``[E, H, I]``: with expert parallelism whole experts (dim 0, the rank's
  physical experts: a list of logical ids, see :mod:`glm5.distributed.eplb`); without it the intermediate dim
  (dim 1 of gate/up, dim 2 of down), like a dense MLP.
* **replicated**: everything else — low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` / ``f_a_proj`` / ``g_a_proj``
  (their outputs feed every head), the indexer key path (``wk``, ``k_norm``, compress gate, ape: one key shared by
  all index heads), norms, mHC, the router, the MTP ``eh_proj``.
* **driver only**: the vision tower (rank 0 encodes images; the embeddings travel with the step).

fp8 block-scaled checkpoints: the loader reads a shard's fp8 slice together with the scale rows/columns of the
128×128 blocks it touches, so a dequantizing load gives every element its own block's scale whatever the split.
Keeping the weight in fp8 (block-scaled GEMMs) needs more: the shard must start and end on the block grid of
the dimension it splits, or its first and last blocks would be partial (:func:`check_fp8_alignment` says so by
name). The real model's fp8 splits at TP ≤ 16 all fall on the grid (q_b 16384, kv_b 32768, o_proj 16384,
dense 12288, shared/routed experts 2048 rows or columns: all multiples of 128 × 16 except 12288 / 16 = 768 = 6 ×
128, also on the grid); expert-parallel shards split whole experts and never cut a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glm5.config import ModelConfig
from glm5.distributed.parallel_state import ParallelConfig, ParallelConfigError, Ranks

_COLUMN = re.compile(
    r"\.self_attn\.(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj|q_b_proj|kv_b_proj)\.weight$"
    r"|\.self_attn\.(q|k|v)_conv1d\.weight$|\.self_attn\.(A_log|dt_bias)$"
    r"|\.self_attn\.indexer\.(wq_b|weights_proj)\.weight$"
    r"|\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$")
_ROW = re.compile(r"\.self_attn\.o_proj\.weight$|\.mlp\.(shared_experts\.)?down_proj\.weight$")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardIndex:
    """What a rank holds of one canonical tensor of shape ``full``.

    ``dim is None``: all of it. Else rows ``[start, stop)`` of ``dim`` (``stop`` may pass the end: zero padding,
    vocab-parallel tensors), or, when ``indices`` is set, those rows of ``dim`` in that order (experts under EP).
    """

    dim: int | None = None
    start: int = 0
    stop: int = 0
    indices: tuple[int, ...] | None = None

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def local_shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        s = list(full)
        s[self.dim] = len(self.indices) if self.indices is not None else self.stop - self.start
        return tuple(s)

    def valid_stop(self, full: tuple[int, ...]) -> int:
        """End of the real (unpadded) rows of a range shard."""
        assert self.dim is not None
        return min(self.stop, full[self.dim])


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class WeightSharding:
    """The :class:`ShardIndex` of every canonical tensor for one rank (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, ranks: Ranks,
                 physical_to_logical: list[int] | None = None):
        pc.check_model(cfg.text)
        self.cfg, self.pc, self.ranks = cfg, pc, ranks
        t = cfg.text
        self.vocab_per_rank = padded_vocab(t.vocab_size, ranks.tp_size) // ranks.tp_size
        if pc.expert_parallel:
            from glm5.distributed.eplb import initial_placement
            p2l = physical_to_logical or initial_placement(t.n_routed_experts, pc.num_redundant_experts)
            per = len(p2l) // ranks.ep_size
            self.local_experts: tuple[int, ...] | None = tuple(p2l[ranks.ep_rank * per:(ranks.ep_rank + 1) * per])
        else:
            self.local_experts = None

    def driver_only(self, name: str) -> bool:
        return name.startswith("visual.")

    def held(self, name: str) -> bool:
        """False for tensors this rank does not hold at all (the vision tower off the driver)."""
        return not self.driver_only(name) or self.ranks.is_driver

    def index(self, name: str, full: tuple[int, ...]) -> ShardIndex:
        tp, r = self.ranks.tp_size, self.ranks.tp_rank
        if self.driver_only(name):
            return ShardIndex()
        if name in _VOCAB:
            per = self.vocab_per_rank
            return ShardIndex(0, r * per, (r + 1) * per)
        m = _EXPERT.match(name)
        if m:
            if self.local_experts is not None:
                return ShardIndex(0, indices=self.local_experts)
            dim = 2 if m.group(2) == "down_proj" else 1
            return _even(full, dim, tp, r, name)
        if tp == 1:
            return ShardIndex()
        if _COLUMN.search(name):
            return _even(full, 0, tp, r, name)
        if _ROW.search(name):
            return _even(full, 1, tp, r, name)
        return ShardIndex()

    def local_shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        return self.index(name, full).local_shape(full)


def _even(full: tuple[int, ...], dim: int, n: int, r: int, name: str) -> ShardIndex:
    size = full[dim]
    if size % n:
        raise ParallelConfigError(f"{name}: dim {dim} of size {size} does not split over {n} ranks; choose a "
                                  f"tensor_parallel_size that divides {size}")
    per = size // n
    return ShardIndex(dim, r * per, (r + 1) * per)


def check_fp8_alignment(name: str, index: ShardIndex, full: tuple[int, ...], block: tuple[int, int]) -> None:
    """An fp8 weight ``[..., out, in]`` keeps its 128×128 block scales only if a range shard starts and ends on
    the block grid of the split dimension (an expert list shard splits the leading expert dim: always fine)."""
    if index.dim is None or index.indices is not None:
        return
    grid = block[0] if index.dim == len(full) - 2 else block[1] if index.dim == len(full) - 1 else 1
    stop = index.valid_stop(full)
    if index.start % grid or (stop % grid and stop != full[index.dim]):
        raise ParallelConfigError(
            f"{name}: the shard [{index.start}, {stop}) of dim {index.dim} (size {full[index.dim]}) does not fall on "
            f"the fp8 block grid of {grid}, so its block scales cannot be sliced; use a tensor_parallel_size whose "
            f"shards are multiples of {grid} (or a bf16 checkpoint)")
