"""MTP speculative decoding: acceptance counters and the per-request reference of verification.

Per step and request: the target runs ``[last token, d1..dk]`` (k+1 rows); greedy requests accept
the longest prefix of drafts equal to the target's argmax and add the target's next token;
sampling requests use standard rejection sampling — accept ``d`` with ``min(1, p(d)/q(d))``,
otherwise resample from ``norm(max(p − q, 0))``; if all drafts pass, sample a bonus token from the
last row — so the output distribution is exactly the target's.

:func:`rejection_sample` and :func:`greedy_verify` are that rule for one request, drawing from a
``torch.Generator``: the reference the batched, on-device version (:mod:`glm5.engine.spec_sampling`,
counter-based random streams) is checked against. The engine runs pure-decode steps through
:mod:`glm5.engine.spec_batched` (verify, accept, commit, draft on the batched path and in CUDA
graphs) and steps that mix verification with prefill through the per-request path, where each
verification chunk keeps its rows' inputs (``glm5.layers.kda.KDARecord``) and the commit reruns the
accepted rows from the unchanged state — no per-row state copies (docs/speculative.md compares the
schemes by bytes). :func:`target_distributions` gives the processed target probabilities of a
request's verification rows.

Drafts come from the MTP layer: after each target step it "catches up" on the rows the target
just accepted (row p sees token p+1 and the target hidden at p, and writes the MTP layer's own
caches), whose last row yields d1; k−1 more one-row steps recycle the post-norm hidden. Those
extra rows sit at positions the target has not accepted yet, so the MTP tail is snapshotted
before them and restored after; their latent rows are overwritten by the next catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5.sampler import Sampler
from glm5.sampling_params import SamplingParams


@dataclass
class SpecStats:
    """Acceptance counters (per request and engine-wide)."""

    num_speculative_tokens: int
    proposed: list[int] = field(default_factory=list)   # per draft position
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    emitted: int = 0                                     # tokens produced by verification steps
    # times the MTP layer stopped following a request (engine-wide); a request preempted after its drop follows
    # again from its recompute, so a second drop counts it twice
    mtp_dropped: int = 0

    def __post_init__(self) -> None:
        self.proposed = [0] * self.num_speculative_tokens
        self.accepted = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.steps += 1
        self.emitted += num_accepted + 1
        for j in range(num_drafts):
            self.proposed[j] += 1
            self.accepted[j] += int(j < num_accepted)

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (1 = no draft accepted)."""
        return self.emitted / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens, "steps": self.steps,
                "acceptance_rate_per_position": [round(x, 4) for x in self.acceptance_rate],
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "proposed": list(self.proposed), "accepted": list(self.accepted), "mtp_dropped": self.mtp_dropped}


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One sample from ``probs`` [V] by the exponential race (V draws from ``generator``)."""
    q = torch.empty(probs.shape[-1], dtype=torch.float32, device=generator.device).exponential_(generator=generator)
    return int(torch.argmax(probs.float() / q.to(probs.device).clamp_min(torch.finfo(torch.float32).tiny)))


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, device=generator.device))


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                     generator: torch.Generator) -> list[int]:
    """Tokens to emit: accepted drafts then one corrected/bonus token.

    target_probs [k+1, V] (row j = the target's distribution for the token after draft j−1),
    draft_probs [k, V] (the distributions the drafts were sampled from)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        if q[d] > 0 and _uniform(generator) < min(1.0, float(p[d] / q[d])):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        out.append(draw(residual / total if total > 0 else p, generator))
        return out
    out.append(draw(target_probs[len(drafts)], generator))
    return out


def greedy_verify(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    best = torch.argmax(target_logits, dim=-1).tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        if best[j] != d:
            out.append(best[j])
            return out
        out.append(d)
    out.append(best[len(drafts)])
    return out


def row_params(params: SamplingParams, outputs: list[int], drafts: list[int], n_rows: int
               ) -> tuple[list[SamplingParams], list[list[int]]]:
    """Per-row params and output histories for verification rows (row j has seen drafts[:j])."""
    return [params] * n_rows, [outputs + drafts[:j] for j in range(n_rows)]


def target_distributions(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, outputs: list[int],
                         prompt: list[int], drafts: list[int], eos: list[int],
                         bad_words: list[list[int]] | None = None) -> torch.Tensor:
    """Processed (bad words, penalties, temperature, top-k/p, min-p) target probabilities for k+1 rows (row
    ``j`` has seen ``drafts[:j]``)."""
    plist, hist = row_params(params, outputs, drafts, logits.shape[0])
    x = sampler.process_logits(logits, plist, output_token_ids=hist, prompt_token_ids=[prompt] * len(plist),
                               eos_token_ids=[eos] * len(plist), bad_words_token_ids=[bad_words] * len(plist))
    return torch.softmax(x.float(), dim=-1)
