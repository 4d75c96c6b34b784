"""Sparse NoPE MLA prefill over the latent cache (absorbed weights): each query attends only to its own
selected latent rows. Torch reference: :func:`glm5_kernels.sparse_mla_ref.sparse_mla_prefill_ref`.

Per query row ``n`` (a prefill token) and head ``h``, the absorbed query ``q̃ = W_UKᵀ q`` (``[R]``,
R = kv_lora_rank = 512) attends to the latent rows ``c[idx[n, j]]``, ``j < counts[n]``, that the kpool
indexer selected for that query (its top pools expanded to tokens plus its own incomplete pool, or every
token ``≤ pos`` below the selection threshold: :func:`glm5_kernels.indexer.select_token_slots`); the output
is the normalised ``Σ_j p_j c_j`` (``[R]``), which the caller maps back with ``W_UV``.

Why absorbed and per-row index lists (numbers for 64 heads, d_qk = d_v = 256, R = 512, 2051 selected rows):

* A key costs 4·R = 2048 FLOP per (query, head) pair absorbed vs 4·256 = 1024 expanded, but the expanded
  form first builds per-head K/V for every key of the context (``kv_b``: 2·512·32768 = 33.5 MFLOP per key
  per chunk) and can only skip work in whole tiles. The indexer's choices differ from query to query: over a
  64-query tile the union of 512-of-P pools covers nearly every pool unless neighbouring queries choose
  alike, so a tile-skipping expanded kernel computes close to every causal pair.
* Gathering per query is affordable only for the latent: one 1 KiB latent row serves all 64 heads (an MQA
  with K = V = the latent), where the expanded K/V of one key is 64 KiB.

8K prompt in two 4K chunks, one MLA layer: masked dense attention computes 50.3 M pairs (3.3 TFLOP) plus
0.41 TFLOP of ``kv_b`` expansion; the selection has 14.7 M pairs: 1.93 TFLOP absorbed plus 0.27 TFLOP for
``W_UK``/``W_UV``. 32K prompt in 4K chunks: 604 M pairs (39.6 TFLOP) + 4.9 TFLOP expansion dense, 65 M
pairs (8.5 TFLOP) + 1.1 TFLOP absorbed. docs/gpu.md has the table.

The kernel is the decode path's (:func:`glm5_kernels.sparse_mla_decode.launch_attention`) with one split per
query: a program holds all 64 heads of one query (the gathered latent tile is read once and feeds 64-row
tensor-core tiles), loads the query once, loops over the query's valid prefix only (``counts``) with an online
softmax in fp32 and writes the normalised output in the output tensor's dtype. Sync-free: every shape comes
from the arguments.
"""

from __future__ import annotations

import torch

from glm5_kernels.sparse_mla_decode import AttnConfig, check_inputs, default_config, launch_attention


def sparse_mla_prefill(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor,
                       scale: float, out: torch.Tensor | None = None,
                       config: AttnConfig | None = None) -> torch.Tensor:
    """Attention of every query row over its own selected latent rows → ``[N, H, R]``.

    ``q_lat [N, H, R]`` (any row/head strides, unit last stride) and ``latent [S, R]`` share a dtype (bf16,
    fp16 or fp32; fp32 uses IEEE products); R a power of two. ``idx [N, W]`` int32 latent rows with each row's
    valid entries first and ``counts [N]`` int32 (≥ 1) how many (what :func:`select_token_slots` writes with
    ``counts_out``); ``-1`` entries before a count are skipped. ``out`` (optional): an ``[N, H, R]`` view to
    write, e.g. a head-major buffer for the following ``W_UV`` batched GEMM; else a new tensor in q's dtype.
    """
    n, h, r = q_lat.shape
    check_inputs(q_lat, latent)
    if idx.dim() != 2 or idx.shape[0] != n or counts.shape != (n,):
        raise ValueError(f"idx {tuple(idx.shape)} and counts {tuple(counts.shape)} must be [{n}, W] and [{n}]")
    if out is None:
        out = torch.empty(n, h, r, device=q_lat.device, dtype=q_lat.dtype)
    elif out.shape != (n, h, r) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{n}, {h}, {r}] with a unit last stride, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if n == 0:
        return out
    cfg = config or default_config(q_lat.dtype, q_lat.device)
    idx = idx if idx.dtype == torch.int32 and idx.stride(-1) == 1 else idx.to(torch.int32).contiguous()
    counts = counts if counts.dtype == torch.int32 and counts.is_contiguous() else counts.to(torch.int32).contiguous()
    launch_attention(q_lat, latent, idx, counts, scale, 1, cfg, out)
    return out


def prefill_flops(pairs: int, h: int, r: int) -> int:
    """FLOPs of the absorbed attention over ``pairs`` (query, selected key) pairs: QK and PV, 2·R each."""
    return 4 * pairs * h * r


def selected_pairs(context_len: int, num_tokens: int, n_select: int, kpool: int) -> int:
    """(query, key) pairs the indexer selects for queries at positions ``context_len .. +num_tokens-1``:
    ``min(pos+1 // kpool, n_select)·kpool + (pos+1) % kpool`` each (host arithmetic)."""
    total = 0
    for p in range(context_len, context_len + num_tokens):
        total += min((p + 1) // kpool, n_select) * kpool + (p + 1) % kpool
    return total


__all__ = ["sparse_mla_prefill", "prefill_flops", "selected_pairs"]
