"""Speculative verification on the batched decode path: what the layers keep, and the commit.

A verification step runs ``T = k + 1`` rows per request (its last token, then its ``k`` drafts) through
the model in one pass (``DecodeMeta.rows_per_seq = T``). Which rows are right is only known after the
rejection sampler has looked at the logits, so the pass must not leave the cache in a state that is
wrong for the rejected rows:

* **KDA** (recurrent + conv state): the verify recurrence reads each request's state and writes nothing
  (:func:`glm5_kernels.kda_verify.kda_verify_recurrence`); the rows' pre-conv inputs and gate / β
  projections are copied here. The commit recomputes the conv over the accepted rows and runs those rows
  again from the unchanged state (:func:`glm5_kernels.kda_verify.kda_commit_recurrence`). Cost: one more
  read of the state (4 MiB per layer and request at the real shape, against a plain step's read + write)
  and ~64 KiB of inputs per row and layer, instead of a state copy per row (``34 × (k+1) × 4 MiB`` per
  request) that a keep-every-state rollback needs. Numbers: :func:`verify_buffer_bytes`, docs/speculative.md.
* **kpool tail** (the raw index keys of the pool in progress): a rejected row in the next pool overwrites
  rows of the current one, so the tail before the step and the rows' raw keys are kept and the commit
  rebuilds it for the accepted length. Pooled keys completed by rejected rows and latent rows at rejected
  positions need nothing: no query reads them before the right token's row writes them again.

The buffers are allocated once for the largest step (``max_requests × max_rows_per_seq`` rows), so a CUDA
graph of the verify pass writes into fixed addresses and the commit reads them right after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.config import TextConfig


@dataclass
class VerifyBuffers:
    """Per-layer buffers one verification step writes for its commit (rows in batch order)."""

    max_requests: int
    max_rows: int
    kda: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # layer -> pre-conv [R, 3D], f [R, D], b [R, H]
    tail_before: dict[int, torch.Tensor]                             # MLA layer -> [max_requests, kpool, 2d]
    index_raw: dict[int, torch.Tensor]                               # MLA layer -> [R, 2d]

    @classmethod
    def allocate(cls, cfg: TextConfig, max_requests: int, max_rows_per_seq: int, device: torch.device,
                 dtype: torch.dtype) -> "VerifyBuffers":
        rows = max_requests * max_rows_per_seq
        d = cfg.linear_num_heads * cfg.linear_head_dim
        def buf(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)
        kda = {i: (buf(rows, 3 * d), buf(rows, d), buf(rows, cfg.linear_num_heads)) for i in cfg.kda_layer_ids}
        w = 2 * cfg.index_head_dim
        tail = {i: buf(max_requests, cfg.index_kpool, w) for i in cfg.mla_layer_ids}
        raw = {i: buf(rows, w) for i in cfg.mla_layer_ids}
        return cls(max_requests, rows, kda, tail, raw)

    def nbytes(self) -> int:
        tensors = [t for group in self.kda.values() for t in group] + list(self.tail_before.values()) + \
            list(self.index_raw.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def check(self, requests: int, rows_per_seq: int) -> None:
        if requests > self.max_requests or requests * rows_per_seq > self.max_rows:
            raise ValueError(f"a verification step of {requests} requests x {rows_per_seq} rows exceeds the buffers "
                             f"({self.max_requests} requests, {self.max_rows} rows); raise the speculative batch cap")


def verify_buffer_bytes(cfg: TextConfig, requests: int, num_speculative_tokens: int, elem_bytes: int = 2) -> int:
    """Bytes of :class:`VerifyBuffers` for ``requests`` requests verifying ``num_speculative_tokens`` drafts each
    (what this rollback scheme costs in memory, to compare with :func:`per_row_state_bytes`)."""
    rows = requests * (num_speculative_tokens + 1)
    d = cfg.linear_num_heads * cfg.linear_head_dim
    per_row = len(cfg.kda_layer_ids) * (3 * d + d + cfg.linear_num_heads) + \
        len(cfg.mla_layer_ids) * 2 * cfg.index_head_dim
    tail = requests * len(cfg.mla_layer_ids) * cfg.index_kpool * 2 * cfg.index_head_dim
    return (rows * per_row + tail) * elem_bytes


def per_row_state_bytes(cfg: TextConfig, requests: int, num_speculative_tokens: int) -> int:
    """Bytes a rollback that keeps every verified row's fp32 KDA state would hold (the scheme this replaces,
    and vLLM's per-position state slots): ``kda_layers × (k+1) × heads × d × d × 4`` per request."""
    state = cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4
    return requests * (num_speculative_tokens + 1) * len(cfg.kda_layer_ids) * state


def kda_state_bytes(cfg: TextConfig, requests: int) -> int:
    """The fp32 recurrent state the running requests hold anyway (the budget reference)."""
    return requests * len(cfg.kda_layer_ids) * cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4


def request_rows(meta, positions: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(requests, state slot [n], first position [n])`` of a verification batch (rows grouped per request)."""
    t = meta.rows_per_seq
    n = meta.state_slots.shape[0] // t
    return n, meta.state_slots.view(n, t)[:, 0], positions.view(n, t)[:, 0]


@torch.no_grad()
def commit_verification(model, batch, n_valid: torch.Tensor, cache) -> None:
    """Bring every layer's cache to the state after each request's first ``n_valid[n]`` verification rows
    (1 + its accepted drafts; 0 leaves a padding request untouched). Device tensors only, no host sync."""
    meta = batch.decode
    if meta is None or meta.verify is None or meta.rows_per_seq < 2:
        raise ValueError("commit_verification needs the batch of a verification step (DecodeMeta.rows_per_seq > 1 "
                         "with VerifyBuffers)")
    n, slots, ctx = request_rows(meta, batch.positions)
    if n_valid.shape != (n,):
        raise ValueError(f"n_valid has shape {tuple(n_valid.shape)}; the step has {n} requests (padding included)")
    n_valid = n_valid.to(device=slots.device, dtype=torch.int64)
    for layer in model.layers:
        layer.attn.commit_verification(meta.verify, slots, ctx, n_valid, meta.rows_per_seq, cache)


__all__ = ["VerifyBuffers", "commit_verification", "kda_state_bytes", "per_row_state_bytes", "request_rows",
           "verify_buffer_bytes"]
