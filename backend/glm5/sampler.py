"""Batched token sampler: penalties, min-tokens masking, temperature, top-k/top-p/min-p, logprobs.

One call handles R requests ("rows") with their own :class:`~glm5.sampling_params.SamplingParams`.
Per row the logits go through, in this order (each step is skipped when it is a no-op):

0. **allowed_token_ids** (every other token gets ``-inf``), **bad_words** (:func:`apply_bad_words`)
   and **logit_bias** (added to the listed tokens' logits), as vLLM's logits processors apply them
   before the penalties (:func:`apply_logit_bias`);
1. **penalties** (vLLM definitions): repetition penalty ``r`` on every token seen in the prompt or
   the output so far (``logit / r`` where the logit is > 0, ``logit * r`` otherwise), then
   ``logit -= frequency_penalty * count`` and ``logit -= presence_penalty * (count > 0)`` with
   ``count`` the token's occurrences in the *output* only;
2. **min_tokens**: while fewer than ``min_tokens`` tokens have been generated, the row's EOS ids
   (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf`` (:func:`apply_min_tokens`);
3. greedy rows (``temperature`` ~ 0) stop here and take ``argmax`` (lowest id on ties,
   deterministic on CPU and CUDA);
4. **temperature** division, **top-k** (``top_k`` 0/-1 = off; on ties the lower token id wins so
   exactly ``k`` tokens survive), **top-p** (the smallest prefix of the descending-probability order
   whose mass reaches ``top_p``; the most likely token always survives), **min-p** (drop tokens with
   probability < ``min_p * max_prob``). This is the HF order; vLLM v1 applies min-p before
   top-k/top-p, which differs only when both min-p and top-p are set;
5. **sampling** by the exponential race: ``argmax(p_i / q_i)`` with ``q_i ~ Exp(1)`` i.i.d. per
   token, which picks token ``i`` with probability exactly ``p_i``.

Reproducibility: a seeded row draws its ``q`` only from its *own* ``torch.Generator`` (made once per
request by :func:`make_generator` and passed in every step) and always exactly ``V`` values per
sampled step, independent of the batch it is in. So the same request with the same seed yields
the same tokens whether it runs alone or batched, at any row position, and across processes and
restarts (on the same device type: CPU and CUDA generators produce different streams). Unseeded
rows share the sampler's engine generator. A CPU generator with CUDA logits works but draws ``V``
floats per row per step on the host (about 5 ms for GLM-5.3-Flash's 154,880 tokens on one core of
the CPU machine, ``bench/host_cost.py``) and copies them over; the engine therefore creates each
request's generator on its own device (``make_generator(seed, device)``).

Logprobs: by default (``logprobs_mode="raw"``) they are the log-softmax of the logits *as passed
in*, i.e. before penalties, temperature and filtering, as vLLM v1 returns by default.
``logprobs_mode="processed"`` returns the log-softmax of the final processed logits instead
(for greedy rows: after penalties/min-tokens only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from glm5.layers.batch import host_to_device
from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LogprobsMode = Literal["raw", "processed"]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (one per seeded request).

    The generator must live as long as the request: its state advances by ``V`` draws each
    sampled step, which is what makes step ``n`` of a seeded request reproducible.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" → "cuda:N": equal to the logits' device
        device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class TokenLogprobs:
    """Logprob information for one sampled token of one row.

    ``rank`` is the 1-based rank of the sampled token in the distribution the logprobs come
    from (1 = most likely); ``top`` holds the ``n`` most likely ``(token_id, logprob)`` pairs in
    descending order (empty for ``logprobs=0``).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    @staticmethod
    def as_dict(lp: "TokenLogprobs | None") -> dict | None:
        """The form a request output carries (``None`` stays ``None``: the row asked for no logprobs)."""
        if lp is None:
            return None
        return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


@dataclass
class SamplerOutput:
    """Result of :meth:`Sampler.sample`.

    ``token_ids``: int64 ``[R]`` on the logits' device. ``logprobs[i]`` is ``None`` for rows whose
    ``params.logprobs`` is ``None``.
    """

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]


# ---------------------------------------------------------------------------- helpers
def _check_rows(name: str, seq: Sequence[object] | None, rows: int) -> None:
    if seq is not None and len(seq) != rows:
        raise ValueError(f"{name} has {len(seq)} entries but logits have {rows} rows; pass one entry per row")


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` float32 occurrence counts of each token id per list."""
    n = len(token_lists)
    max_len = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad with the extra bin ``vocab_size`` so one scatter_add handles ragged lists.
    # pinned from the start on CUDA, so that host_to_device copies it as it is (no second, pinned copy)
    padded = torch.full((n, max_len), vocab_size, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    for i, toks in enumerate(token_lists):
        if len(toks):
            t = torch.as_tensor(list(toks), dtype=torch.int64)
            if int(t.min()) < 0 or int(t.max()) >= vocab_size:
                raise ValueError(
                    f"token ids must lie in [0, {vocab_size}) for a vocabulary of {vocab_size} logits; "
                    f"list {i} has ids in [{int(t.min())}, {int(t.max())}]"
                )
            padded[i, : len(toks)] = t
    padded = host_to_device(padded, device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """Apply repetition/frequency/presence penalties in place (vLLM definitions, module docstring).

    Rows whose penalties are all neutral are untouched. ``prompt_token_ids`` is only needed when
    some row has ``repetition_penalty != 1`` (the prompt counts as "seen" for it).
    """
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    idx = host_to_device(rows, device)
    sub = logits.index_select(0, idx)
    out_counts = token_counts([output_token_ids[i] for i in rows], vocab, device)
    out_seen = out_counts > 0

    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        if prompt_token_ids is None:
            raise ValueError("prompt_token_ids is required when a row uses repetition_penalty != 1 (the prompt counts as seen)")
        seen = out_seen | (token_counts([prompt_token_ids[i] for i in rows], vocab, device) > 0)
        r = host_to_device(rep, device, sub.dtype).unsqueeze(1)
        penalized = torch.where(sub > 0, sub / r, sub * r)
        sub = torch.where(seen, penalized, sub)

    freq = host_to_device([params[i].frequency_penalty for i in rows], device, sub.dtype).unsqueeze(1)
    pres = host_to_device([params[i].presence_penalty for i in rows], device, sub.dtype).unsqueeze(1)
    sub = sub - freq * out_counts - pres * out_seen.to(sub.dtype)
    logits.index_copy_(0, idx, sub)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``allowed_token_ids`` masking, then ``logit_bias`` addition, in place (rows without either
    are untouched). Token ids are validated against the vocabulary at admission."""
    vocab = logits.shape[1]
    device = logits.device
    for i, p in enumerate(params):
        # the ids are checked on the host, so that no device value is read back (a sync per row)
        if p.allowed_token_ids is not None:
            top = max(p.allowed_token_ids)
            if top >= vocab:
                raise ValueError(f"row {i}: allowed_token_ids has id {top} outside the vocabulary [0, {vocab})")
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[host_to_device(list(p.allowed_token_ids), device, torch.int64)] = False
            logits[i].masked_fill_(mask, float("-inf"))
        if p.logit_bias:
            top = max(p.logit_bias)
            if top >= vocab:
                raise ValueError(f"row {i}: logit_bias has id {top} outside the vocabulary [0, {vocab})")
            ids = host_to_device(list(p.logit_bias), device, torch.int64)
            bias = host_to_device(list(p.logit_bias.values()), device, logits.dtype)
            logits[i].index_add_(0, ids, bias)
    return logits


def bad_word_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Token sequences of ``bad_words``: each word as written and with one leading space (vLLM's rule,
    since a word inside a sentence is usually tokenized with its space), duplicates dropped."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None],
                    output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Ban (``-inf``, in place) the last token of each bad-word sequence whose other tokens end the
    row's output so far."""
    for i, seqs in enumerate(bad_words_token_ids):
        if not seqs:   # (most rows: no copy of their output)
            continue
        out = output_token_ids[i]
        n = len(out)
        for ids in seqs:
            k = len(ids) - 1
            if k == 0 or (n >= k and list(out[n - k:]) == list(ids[:-1])):
                logits[i, ids[-1]] = float("-inf")
    return logits


def min_tokens_banned_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids that must not be sampled while ``min_tokens`` is not reached for a row."""
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(eos_token_ids)
    return sorted(set(banned))


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask (``-inf``, in place) EOS and stop token ids of rows with fewer than ``min_tokens`` outputs.

    ``num_output_tokens[i]`` is the number of tokens row ``i`` has generated *before* this step;
    ``eos_token_ids[i]`` its EOS ids (ignored when ``ignore_eos``; ``stop_token_ids`` are always
    masked). Rows that reached ``min_tokens`` are untouched.
    """
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, p in enumerate(params):
        if num_output_tokens[i] >= p.min_tokens:
            continue
        for t in min_tokens_banned_ids(p, eos_token_ids[i]):
            if not 0 <= t < vocab:
                raise ValueError(f"row {i}: EOS/stop token id {t} is outside the vocabulary [0, {vocab})")
            row_idx.append(i)
            tok_idx.append(t)
    if row_idx:
        logits[host_to_device(row_idx, logits.device), host_to_device(tok_idx, logits.device)] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Return ``logits`` with tokens outside top-k / top-p set to ``-inf``.

    ``top_k``: int64 ``[R]`` with values <= 0 meaning "off"; ``top_p``: float ``[R]`` with
    values >= 1 meaning "off". A stable descending sort makes ties resolve to the lower token id,
    so exactly ``k`` tokens survive top-k and the result is deterministic.
    """
    vocab = logits.shape[1]
    sorted_vals, sorted_idx = torch.sort(logits, dim=1, descending=True, stable=True)
    pos = torch.arange(vocab, device=logits.device).unsqueeze(0)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        sorted_vals = sorted_vals.masked_fill(pos >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_vals, dim=1)
        # Mass strictly before each position (exact prefix sums, no cum - p cancellation).
        before = torch.zeros_like(probs)
        before[:, 1:] = torch.cumsum(probs, dim=1)[:, :-1]
        p = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p)
        remove = before >= p.unsqueeze(1)
        remove[:, 0] = False
        sorted_vals = sorted_vals.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_vals)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` with tokens whose probability < ``min_p * max_prob`` set to ``-inf``."""
    probs = torch.softmax(logits, dim=1)
    thresh = min_p.unsqueeze(1) * probs.amax(dim=1, keepdim=True)
    return logits.masked_fill(probs < thresh, float("-inf"))


# ---------------------------------------------------------------------------- sampler
class Sampler:
    """Samples one token per row from a batch of logits (see the module docstring).

    ``seed`` seeds the shared engine generator used by rows without their own generator
    (unseeded requests); ``None`` seeds it nondeterministically.
    """

    def __init__(self, seed: int | None = None, logprobs_mode: LogprobsMode = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is invalid: use 'raw' or 'processed'")
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._seed = seed
        self._shared: dict[str, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The engine generator for unseeded rows on ``device`` (created on first use)."""
        key = str(device)
        gen = self._shared.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[key] = gen
        return gen

    # ------------------------------------------------------------------ processing
    def process_logits(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> torch.Tensor:
        """Return the fully processed fp32 logits ``[R, V]`` (steps 1-4 of the module docstring).

        Greedy rows get penalties and min-tokens masking only. The input is not modified. Also
        useful to a speculative-decoding verifier that needs the target distribution.
        """
        x = self._penalize(logits, params, output_token_ids=output_token_ids, prompt_token_ids=prompt_token_ids,
                           eos_token_ids=eos_token_ids, bad_words_token_ids=bad_words_token_ids)
        return self._temper_and_filter(x, params)

    def _penalize(self, logits: torch.Tensor, params: Sequence[SamplingParams], *,
                  output_token_ids: Sequence[Sequence[int]], prompt_token_ids: Sequence[Sequence[int]] | None,
                  eos_token_ids: Sequence[Sequence[int]] | None,
                  bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None) -> torch.Tensor:
        """Steps 0-2 on an fp32 copy: logit bias / allowed tokens, penalties, min-tokens masking."""
        rows = logits.shape[0]
        _check_rows("params", params, rows)
        _check_rows("output_token_ids", output_token_ids, rows)
        _check_rows("prompt_token_ids", prompt_token_ids, rows)
        _check_rows("eos_token_ids", eos_token_ids, rows)
        x = logits.to(torch.float32, copy=True)
        if bad_words_token_ids is not None and any(bad_words_token_ids):
            _check_rows("bad_words_token_ids", bad_words_token_ids, rows)
            apply_bad_words(x, bad_words_token_ids, output_token_ids)
        if any(p.logit_bias or p.allowed_token_ids is not None for p in params):
            apply_logit_bias(x, params)
        apply_penalties(x, params, output_token_ids, prompt_token_ids)
        if any(p.min_tokens > 0 for p in params):
            if eos_token_ids is None:
                eos_token_ids = [[] for _ in range(rows)]
                logger.debug("process_logits: no eos_token_ids given; min_tokens masks stop_token_ids only")
            apply_min_tokens(x, params, [len(o) for o in output_token_ids], eos_token_ids)
        return x

    def _temper_and_filter(self, x: torch.Tensor, params: Sequence[SamplingParams],
                           skip: set[int] | None = None) -> torch.Tensor:
        """Step 4 in place on the sampled rows of ``x`` (except ``skip``): temperature, top-k, top-p, min-p."""
        sampled = [i for i, p in enumerate(params) if not p.is_greedy and not (skip and i in skip)]
        if not sampled:
            return x
        device = x.device
        idx = host_to_device(sampled, device, torch.int64)
        sub = x.index_select(0, idx)
        temps = host_to_device([params[i].temperature for i in sampled], device, torch.float32)
        sub = sub / temps.unsqueeze(1)

        top_ks = [params[i].top_k for i in sampled]
        top_ps = [params[i].top_p for i in sampled]
        use_k = any(k > 0 for k in top_ks)
        use_p = any(p < 1.0 for p in top_ps)
        if use_k or use_p:
            sub = apply_top_k_top_p(
                sub,
                host_to_device(top_ks, device, torch.int64) if use_k else None,
                host_to_device(top_ps, device, torch.float32) if use_p else None,
            )
        min_ps = [params[i].min_p for i in sampled]
        if any(m > 0.0 for m in min_ps):
            sub = apply_min_p(sub, host_to_device(min_ps, device, torch.float32))
        x.index_copy_(0, idx, sub)
        return x

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[R, V]`` logits of the last position of each row (not modified).
            params: one :class:`SamplingParams` per row.
            output_token_ids: tokens each row generated so far (penalties, ``min_tokens``).
            prompt_token_ids: each row's prompt (needed only for ``repetition_penalty``).
            generators: per-row generator from :func:`make_generator`; required for rows with a
                ``seed`` that sample (``temperature > 0``); ``None`` entries use the shared one.
            eos_token_ids: each row's EOS ids (masked while ``min_tokens`` is not reached).
            bad_words_token_ids: each row's bad-word token sequences (:func:`bad_word_token_ids`).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        rows, vocab = logits.shape
        _check_rows("generators", generators, rows)
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy and (generators is None or generators[i] is None):
                raise ValueError(
                    f"row {i} has seed={p.seed} but no generator: create one with make_generator(seed) when the "
                    "request arrives and pass the same generator every step"
                )

        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp: torch.Tensor | None = None
        if want_lp and self.logprobs_mode == "raw":
            lp_idx = host_to_device(want_lp, logits.device, torch.int64)
            raw_lp = torch.log_softmax(logits.index_select(0, lp_idx).to(torch.float32), dim=1)

        pen = self._penalize(logits, params, output_token_ids=output_token_ids, prompt_token_ids=prompt_token_ids,
                             eos_token_ids=eos_token_ids, bad_words_token_ids=bad_words_token_ids)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        fused = self._flashinfer_rows(sampled, generators, logits.device)
        # FlashInfer filters its rows itself; torch still does it for those that want processed logprobs
        skip = {i for i in fused if params[i].logprobs is None or self.logprobs_mode == "raw"}
        x = self._temper_and_filter(pen.clone() if fused else pen, params, skip)
        out = torch.argmax(x, dim=1)  # greedy rows keep this; sampled rows are overwritten below
        if fused:
            # unseeded sampled rows: FlashInfer's fused top-k/top-p/min-p sampling from the penalised logits
            from glm5.flashinfer_sampling import flashinfer_sample
            fidx = host_to_device(fused, x.device, torch.int64)
            tok = flashinfer_sample(pen.index_select(0, fidx), [params[i].temperature for i in fused],
                                    [params[i].top_k for i in fused], [params[i].top_p for i in fused],
                                    [params[i].min_p for i in fused], generator=self.shared_generator(x.device))
            out.index_copy_(0, fidx, tok)
            sampled = [i for i in sampled if i not in set(fused)]
        if sampled:
            device = x.device
            idx = host_to_device(sampled, device, torch.int64)
            probs = torch.softmax(x.index_select(0, idx), dim=1)
            q = self._exponentials(sampled, generators, vocab, device)
            # q can be exactly 0 with tiny probability: clamp so p=0 tokens can never win.
            scores = probs / q.clamp_min(torch.finfo(torch.float32).tiny)
            out.index_copy_(0, idx, torch.argmax(scores, dim=1))

        logprobs: list[TokenLogprobs | None] = [None] * rows
        if want_lp:
            if raw_lp is None:
                lp_idx = host_to_device(want_lp, x.device, torch.int64)
                raw_lp = torch.log_softmax(x.index_select(0, lp_idx), dim=1)
            logprobs = self._gather_logprobs(raw_lp, want_lp, out, params, rows)
        return SamplerOutput(token_ids=out, logprobs=logprobs)

    __call__ = sample

    @staticmethod
    def _flashinfer_rows(sampled: list[int], generators: Sequence[torch.Generator | None] | None,
                         device: torch.device) -> list[int]:
        """Sampled rows without their own generator, when the sampling backend is FlashInfer (seeded rows
        keep the torch path: FlashInfer's random stream depends on the row's batch position)."""
        if not sampled or device.type != "cuda":
            return []
        from glm5.layers.backends import sampling_backend
        if sampling_backend(device) != "flashinfer":
            return []
        return [i for i in sampled if generators is None or generators[i] is None]

    def _exponentials(
        self,
        sampled: list[int],
        generators: Sequence[torch.Generator | None] | None,
        vocab: int,
        device: torch.device,
    ) -> torch.Tensor:
        """``[len(sampled), V]`` Exp(1) draws: exactly ``V`` per seeded row from its own generator."""
        q = torch.empty(len(sampled), vocab, dtype=torch.float32, device=device)
        shared_pos: list[int] = []
        for j, i in enumerate(sampled):
            gen = generators[i] if generators is not None else None
            if gen is None:
                shared_pos.append(j)
                continue
            if gen.device == q.device:  # the row in place: one launch per seeded row
                q[j].exponential_(generator=gen)
            else:
                q[j] = torch.empty(vocab, dtype=torch.float32, device=gen.device).exponential_(generator=gen).to(device)
        if shared_pos:
            gen = self.shared_generator(device)
            draw = torch.empty(len(shared_pos), vocab, dtype=torch.float32, device=device).exponential_(generator=gen)
            q[host_to_device(shared_pos, device, torch.int64)] = draw
        return q

    @staticmethod
    def _gather_logprobs(
        lp: torch.Tensor,
        want: list[int],
        tokens: torch.Tensor,
        params: Sequence[SamplingParams],
        rows: int,
    ) -> list[TokenLogprobs | None]:
        device = lp.device
        tok = tokens.index_select(0, host_to_device(want, device, torch.int64))
        chosen = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        rank = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
        n_max = max(params[i].logprobs or 0 for i in want)
        if n_max > 0:
            top_vals, top_ids = torch.topk(lp, min(n_max, lp.shape[1]), dim=1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        tok_l, chosen_l, rank_l = tok.tolist(), chosen.tolist(), rank.tolist()
        result: list[TokenLogprobs | None] = [None] * rows
        for j, i in enumerate(want):
            n = params[i].logprobs or 0
            top = list(zip(top_ids_l[j][:n], top_vals_l[j][:n])) if n > 0 else []
            result[i] = TokenLogprobs(token_id=tok_l[j], logprob=chosen_l[j], rank=rank_l[j], top=top)
        return result
