"""Top-k / top-p / min-p sampling through FlashInfer's fused kernels, for rows without a per-request seed.

Mirrors steps 4-5 of :mod:`glm5.sampler` (temperature, top-k, top-p, min-p in that order, then a draw)
for *sampled, unseeded* rows; the caller keeps steps 1-3 (penalties, ``min_tokens`` masking, greedy
argmax) and the seeded rows on the torch path, because FlashInfer's Philox stream depends on the
row's batch slot (its docs: per-row seeds "do not make sampling invariant to batch position"), which
would break the sampler's guarantee that a seeded request gives the same tokens alone or batched.

Semantics match the torch sampler's distribution:

* ``top_k`` <= 0 is off (passed to FlashInfer as the vocabulary size); ties at the k-th logit may keep
  a few more tokens in FlashInfer (threshold mask) where torch keeps exactly k (stable sort) - only
  exact float ties differ.
* ``top_p`` >= 1 is off. FlashInfer keeps token ``i`` when the mass of strictly more likely tokens is
  below ``p`` (``sampling.cuh``, pivot test ``aggregate_gt_pivot < top_p``), i.e. the smallest prefix
  of the descending order reaching ``p``, most likely token always kept - the torch definition.
* ``min_p`` > 0 (any row): top-k mask -> softmax -> top-p renorm -> FlashInfer min-p draw; min-p's
  threshold is relative to the row maximum, so applying it to the renormalised distribution is the
  same as torch's ``apply_min_p`` on the filtered logits.

Randomness comes from ``generator`` (the sampler's shared engine generator on the logits' device),
so unseeded rows keep advancing that generator like the torch path does. The whole call is
sync-free (host lists only become small device tensors).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def _row_tensors(rows: int, vocab: int, temperatures: Sequence[float], top_ks: Sequence[int],
                 top_ps: Sequence[float], min_ps: Sequence[float] | None, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    for name, seq in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps), ("min_ps", min_ps)):
        if seq is not None and len(seq) != rows:
            raise ValueError(f"{name} has {len(seq)} entries but logits have {rows} rows; pass one per row")
    for i, t in enumerate(temperatures):
        if not t > 0.0:
            raise ValueError(f"row {i}: temperature {t} <= 0 is greedy; greedy rows take argmax in the torch "
                             "sampler, pass only sampled rows here")
    for i, p in enumerate(top_ps):
        if not 0.0 < p:
            raise ValueError(f"row {i}: top_p {p} must be in (0, 1] (1 = off)")
    temp = torch.tensor(list(temperatures), dtype=torch.float32).to(device, non_blocking=True)
    k = [int(x) if 0 < int(x) < vocab else vocab for x in top_ks]
    top_k = torch.tensor(k, dtype=torch.int32).to(device, non_blocking=True) if min(k) < vocab else None
    p = [min(float(x), 1.0) for x in top_ps]
    top_p = torch.tensor(p, dtype=torch.float32).to(device, non_blocking=True) if min(p) < 1.0 else None
    min_p = None
    if min_ps is not None and max(min_ps) > 0.0:
        min_p = torch.tensor([float(x) for x in min_ps], dtype=torch.float32).to(device, non_blocking=True)
    return temp, top_k, top_p, min_p


def flashinfer_sample(logits: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int],
                      top_ps: Sequence[float], min_ps: Sequence[float] | None = None, *,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row with FlashInfer; returns int64 ids ``[R]`` on the logits' device.

    Args:
        logits: ``[R, V]`` CUDA logits of sampled, unseeded rows *after* penalties and ``min_tokens``
            masking and *before* temperature (as :meth:`glm5.sampler.Sampler.process_logits` would
            see them at step 4). Not modified.
        temperatures: per-row temperature, each > 0 (greedy rows do not belong here).
        top_ks: per-row top-k, <= 0 = off. top_ps: per-row top-p in (0, 1], 1 = off.
        min_ps: per-row min-p in [0, 1], 0 = off (``None`` = all off).
        generator: CUDA generator the draws come from (the sampler's shared one); ``None`` = torch's default.
    """
    if logits.dim() != 2 or logits.device.type != "cuda":
        raise ValueError(f"logits must be a [rows, vocab] CUDA tensor, got shape {tuple(logits.shape)} on "
                         f"{logits.device}; use the torch sampler on CPU")
    import flashinfer.sampling as fs  # here, not at module level: the module must import without flashinfer
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    temp, top_k, top_p, min_p = _row_tensors(rows, vocab, temperatures, top_ks, top_ps, min_ps, logits.device)
    x = logits.float() / temp.unsqueeze(1)
    if min_p is not None:
        if top_k is not None:
            x = fs.top_k_mask_logits(x, top_k)
        probs = torch.softmax(x, dim=-1)
        if top_p is not None:
            probs = fs.top_p_renorm_probs(probs, top_p)
        ids = fs.min_p_sampling_from_probs(probs, min_p, generator=generator)
    elif top_k is not None and top_p is not None:
        ids = fs.top_k_top_p_sampling_from_logits(x, top_k, top_p, filter_apply_order="top_k_first",
                                                  generator=generator)
    elif top_k is not None:
        ids = fs.top_k_sampling_from_probs(torch.softmax(x, dim=-1), top_k, generator=generator)
    elif top_p is not None:
        ids = fs.top_p_sampling_from_probs(torch.softmax(x, dim=-1), top_p, generator=generator)
    else:
        ids = fs.sampling_from_logits(x, generator=generator)
    return ids.to(torch.int64)


__all__ = ["flashinfer_sample"]
