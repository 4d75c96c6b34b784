"""Prompt logprobs: the log-probability of every prompt token given the tokens before it.

A request with ``prompt_logprobs = k`` asks for, at each prompt position ``p >= 1``, the logprob
of ``prompt[p]`` under the model's distribution after ``prompt[:p]`` (its rank, and the top ``k``
alternatives), like vLLM's ``RequestOutput.prompt_logprobs``; position 0 has no context and gets
``None``. The logits of position ``p - 1`` give that distribution, so while a request is in
prefill the model runner asks for the logits of every prompt row it computes (not only the last,
which samples the first output token): :func:`prompt_rows` says which, and :func:`score` turns
those logits into records. Positions are scored in order and at most once — a request recomputed
after preemption does not repeat them. The records have the same keys as the sampled-token
logprob records (``token_id``, ``logprob``, ``rank``, ``top``) and are raw logprobs (before any
sampling parameter changes the logits), which is what vLLM returns.
"""

from __future__ import annotations

import torch

from glm5.engine.sequence import Sequence


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """True while some prompt position of ``seq`` still needs scoring."""
    return (seq.params.prompt_logprobs is not None
            and len(seq.prompt_logprobs) < seq.num_prompt_tokens)


def prompt_rows(seq: Sequence, lo: int, hi: int) -> tuple[int, int] | None:
    """The positions ``[p0, p1)`` of the chunk ``[lo, hi)`` whose logits score prompt tokens.

    The logits at position ``p`` score ``prompt[p + 1]``; ``seq.prompt_logprobs`` already holds
    entries for tokens ``0 .. len - 1`` (so positions up to ``len - 2`` are scored). Positions the
    chunk skips (a cache hit that did not run them) get ``None`` entries in :func:`score`.
    """
    if not wants_prompt_logprobs(seq):
        return None
    next_pos = max(len(seq.prompt_logprobs) - 1, 0)
    p0, p1 = max(lo, next_pos), min(hi, seq.num_prompt_tokens - 1)
    return (p0, p1) if p1 > p0 else None


def score(seq: Sequence, logits: torch.Tensor, p0: int) -> None:
    """Append records for the tokens scored by ``logits`` (rows for positions ``p0 ..``)."""
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)            # token 0 has no context
    while len(seq.prompt_logprobs) < p0 + 1:        # positions a cache hit skipped: nothing to score
        seq.prompt_logprobs.append(None)
    n = logits.shape[0]
    targets = torch.tensor(seq.prompt_token_ids[p0 + 1:p0 + 1 + n], dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None]).squeeze(1)
    rank = (lp > chosen[:, None]).sum(dim=1) + 1
    k = seq.params.prompt_logprobs or 0
    top_vals, top_ids = torch.topk(lp, min(k, lp.shape[1]), dim=1) if k else (None, None)
    for j, (tok, val, r) in enumerate(zip(targets.tolist(), chosen.tolist(), rank.tolist())):
        top = list(zip(top_ids[j].tolist(), top_vals[j].tolist())) if k else []
        seq.prompt_logprobs.append({"token_id": tok, "logprob": val, "rank": r, "top": [list(t) for t in top]})
