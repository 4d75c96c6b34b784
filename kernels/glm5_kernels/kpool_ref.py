"""Torch references of the kpool index-key writers (:mod:`glm5_kernels.kpool`), also the engine's torch path.

A pool is ``kpool`` consecutive tokens; its key is the per-channel softmax(gate + ape)-weighted sum of the
members' index keys, stored once in ``pool_keys`` in the model dtype (exact mode) or Hadamard-rotated e4m3 with a
power-of-two scale (fp8 mode, :func:`glm5_kernels.fp8_index_ref.encode_keys`). No Triton import: the CPU engine
runs these.
"""

from __future__ import annotations

import functools

import torch

from glm5_kernels.fp8_index_ref import encode_keys, hadamard_rotate


@functools.lru_cache(maxsize=16)
def hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """``[d, d]`` fp32 block-diagonal matrix of :func:`hadamard_rotate` (``x @ H`` rotates ``x``), made once per
    device (a host-to-device copy per call could not be graph-captured)."""
    return hadamard_rotate(torch.eye(d, dtype=torch.float32)).to(device).contiguous()



def pool_members_ref(members: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """members ``[P, kpool, 2d]`` (key | gate) → pooled keys ``[P, d]`` in the members' dtype.

    Softmax over the members per channel in fp32,
    probabilities cast to the key dtype, ``(probs * k).sum`` in the key dtype."""
    d = members.shape[-1] // 2
    k, g = members.split(d, dim=-1)
    probs = torch.softmax(g.float() + ape, dim=1).to(k.dtype)
    return (probs * k).sum(dim=1)


def store_pooled_ref(pooled: torch.Tensor, rows: torch.Tensor, pool_keys: torch.Tensor,
                      pool_scales: torch.Tensor | None, keep: torch.Tensor | None = None) -> None:
    """Write pooled keys ``[P, d]`` at ``rows`` (exact or fp8); ``keep`` (bool ``[P]``) leaves rows unchanged."""
    if pool_scales is None:
        new, new_scale = pooled.to(pool_keys.dtype), None
    else:
        new, new_scale = encode_keys(pooled)
    if keep is not None:  # conditional write without a host sync (byte views: torch.where lacks fp8)
        old = pool_keys[rows].view(torch.uint8)
        new = torch.where(keep[:, None], old, new.view(torch.uint8)).view(pool_keys.dtype)
        if new_scale is not None:
            new_scale = torch.where(keep[:, None], pool_scales[rows], new_scale)
    pool_keys[rows] = new
    if new_scale is not None:
        pool_scales[rows] = new_scale


def kpool_compress_write_ref(members: torch.Tensor, ape: torch.Tensor, out_rows: torch.Tensor,
                             pool_keys: torch.Tensor, pool_scales: torch.Tensor | None) -> None:
    """Reference of :func:`kpool_compress_write`: pool ``members [P, kpool, 2d]`` into ``pool_keys[out_rows]``."""
    store_pooled_ref(pool_members_ref(members, ape), out_rows.long(), pool_keys, pool_scales)


def kpool_decode_append_ref(raw: torch.Tensor, positions: torch.Tensor, state_slots: torch.Tensor,
                            block_tables: torch.Tensor, tail: torch.Tensor, ape: torch.Tensor,
                            pool_keys: torch.Tensor, pool_scales: torch.Tensor | None, kpool: int,
                            block_size: int) -> None:
    """Reference of :func:`kpool_decode_append`: rows in order, each one :meth:`KPoolIndexer.write` of a
    single token — tail row ``pos % kpool`` ← raw, and when ``pos`` ends its pool, pool the slot's tail into
    pool ``pos // kpool``. Tensor indices only (no host sync), so it also serves as the torch decode path."""
    ppb = block_size // kpool
    positions, state_slots = positions.long(), state_slots.long()
    for i in range(raw.shape[0]):
        slot, pos = state_slots[i: i + 1], positions[i: i + 1]
        tail[slot, pos % kpool] = raw[i: i + 1].to(tail.dtype)
        first = torch.div(pos, kpool, rounding_mode="floor") * kpool
        row = block_tables[i].long()[first // block_size] * ppb + (first % block_size) // kpool
        pooled = pool_members_ref(tail[slot], ape)                           # [1, d]
        store_pooled_ref(pooled, row, pool_keys, pool_scales, keep=(pos + 1) % kpool != 0)


__all__ = ["hadamard_matrix", "kpool_compress_write_ref", "kpool_decode_append_ref", "pool_members_ref",
           "store_pooled_ref"]
