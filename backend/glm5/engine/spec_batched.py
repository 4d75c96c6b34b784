"""Speculative decoding on the batched, sync-free decode path (and in CUDA graphs).

A step whose every request decodes one token (plus its drafts) runs as:

1. **verify** — the target over ``T = k + 1`` rows per request, ``k`` the most drafts any request has (a
   request with fewer has padding drafts it never accepts); graph bucket ``(batch, k)``;
2. **accept** on the device for the whole batch (:mod:`glm5.engine.spec_sampling`): greedy prefix match or
   rejection sampling with counter-based randomness; requests without drafts (e.g. logprobs) take the
   ordinary sampler on their first row;
3. **commit** the accepted prefix (:mod:`glm5.layers.speculative`: no per-row state copies);
4. one host sync for the emitted tokens; the engine appends them (stop strings, max_tokens);
5. **propose** — the MTP layer catches up on the accepted rows and drafts the next step's tokens
   (``k_next − 1`` more one-row steps, the first step's index choice reused). The drafts stay on the device
   (:class:`~glm5.layers.batch.HostCopy` copies them to the host behind an event): the next verification
   reads them there, so the host schedules and stages it while the GPU still runs the draft passes, and
   waits for the host copy only where it reads them (acceptance, queued behind the verification).

When the next step drafts nothing (the adaptive policy chose ``k = 0``) the MTP layer does not run: the
target's hidden rows wait in the request's backlog (:class:`MTPBacklog`) and the next drafting step catches
up on all of them, up to ``DRAIN_ROWS`` rows per request per graph replay (while the weights dominate, a
replay of several rows costs about what one row does), so a step without speculation costs what a plain
decode step costs. A backlog of ``MAX_BACKLOG`` rows is caught up without drafting, if speculation could pay
at the running batch size (``keep_mtp``, the policy's ``keeps_mtp``: some ``k > 0`` beats ``k = 0`` at the
optimistic acceptance, full acceptance before any draft was verified, and the exploration credit that pays
the probes pays for the drain); where not, draining would be pure cost, so the backlog is dropped instead and
the request drafts no more (``Sequence.mtp_off``: its MTP cache has a gap; new requests start with the layer
following them). Carrying a backlog costs host work as well (a copy of the step's hidden rows and a reference
per request every step; ``bench/host_cost.py`` times it against a plain step), so where it would only be dropped
when full (``hold_mtp``, the policy's ``holds_mtp``: no drain would be paid by the time it is full and no
speculative step ran lately) the MTP layer stops following the requests at once. A mixed (prefill) step
prepends a backlog in the per-request proposal.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeRows, DecodeStager, graph_buckets
from glm5.engine.scheduler import SchedulerOutput
from glm5.engine.sequence import Sequence
from glm5.engine.spec_forwards import SpecForwards, SpecGraphs
from glm5.engine.spec_sampling import SALT_DRAFT, accept_greedy, accept_sampled, race
from glm5.layers.batch import HostCopy, host_to_device
from glm5.layers.speculative import VerifyBuffers
from glm5.sampler import Sampler, TokenLogprobs

logger = logging.getLogger(__name__)

MAX_BACKLOG = 64   # target hidden rows a request may hold back from the MTP layer
DRAIN_ROWS = 32    # backlog rows per request of one drain pass (a captured graph per batch bucket)


@dataclass
class MTPBacklog:
    """Target hidden rows at positions ``first_position ..`` that the MTP layer has not processed yet.

    The rows are kept as ``(source, first row, row count)`` pieces of step outputs: a k = 0 step adds one
    reference per request (no view, no copy, no tensor call), and :func:`take_backlogs` gathers the rows of many
    backlogs with one ``index_select``. The row count is kept as rows arrive: every k = 0 step asks each request
    for it. Why so frugal: a k = 0 step of the speculative engine should cost what a plain decode step costs,
    and a view or a sum per request per step is host time a plain step does not spend."""

    def __init__(self, first_position: int, rows: list[torch.Tensor] | tuple = ()):
        self.first_position = first_position
        self.pieces: list[tuple[torch.Tensor, int, int]] = []
        self.count = 0
        for r in rows:
            self.append(r)

    def __len__(self) -> int:
        return self.count

    def append(self, src: torch.Tensor, start: int = 0, n: int | None = None) -> None:
        """Rows ``start .. start + n`` of ``src`` (all of them by default); ``src`` must not be overwritten
        while the backlog holds it (step outputs are fresh tensors; graph outputs need a copy)."""
        n = src.shape[0] - start if n is None else n
        self.pieces.append((src, start, n))
        self.count += n

    def take(self, more: torch.Tensor | None = None) -> torch.Tensor:
        return take_backlogs([self], [more])[0]


def take_backlogs(backlogs: list[MTPBacklog], more: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Each backlog's rows in arrival order (then its ``more`` rows, if any) as one tensor: the distinct source
    tensors are concatenated once and every row is picked by one ``index_select``."""
    offsets: dict[int, int] = {}   # id(source) -> its first row in the concatenation
    sources: list[torch.Tensor] = []
    idx: list[int] = []
    total = 0
    for b in backlogs:
        for src, start, n in b.pieces:
            if id(src) not in offsets:
                offsets[id(src)] = total
                sources.append(src)
                total += src.shape[0]
            off = offsets[id(src)] + start
            idx.extend(range(off, off + n))
    more = more or [None] * len(backlogs)
    if not sources:
        if any(m is None for m in more):
            raise ValueError("take_backlogs: the backlogs hold no rows and no extra rows were given")
        return list(more)
    flat = sources[0] if len(sources) == 1 else torch.cat(sources)
    rows = flat.index_select(0, host_to_device(idx, flat.device)).split([b.count for b in backlogs])
    return [r if m is None else torch.cat([r, m]) for r, m in zip(rows, more)]


def release_backlogs(seqs: list[Sequence], more: list[torch.Tensor | None] | None = None
                     ) -> list[tuple[int, torch.Tensor]]:
    """``(first position, rows)`` of each request's backlog (then its ``more`` rows), the backlogs cleared."""
    taken = take_backlogs([seq.mtp_backlog for seq in seqs], more)
    out = [(seq.mtp_backlog.first_position, rows) for seq, rows in zip(seqs, taken)]
    for seq in seqs:
        seq.mtp_backlog = None
    return out


def drop_backlogs(seqs: list[Sequence], stats=None) -> None:
    """Stop the MTP layer following ``seqs``: their backlogs go unprocessed, so their MTP caches have a gap
    and they draft no more (``Sequence.mtp_off``). Where speculation cannot pay, this is cheaper than a drain.
    ``stats``: a :class:`~glm5.engine.spec_decode.SpecStats` that counts them."""
    for seq in seqs:
        seq.mtp_backlog = None
        seq.mtp_off = True
    if stats is not None:
        stats.mtp_dropped += len(seqs)
    if seqs:
        logger.debug("MTP layer stops following %d requests (speculation cannot pay at this batch size)", len(seqs))


@dataclass
class VerifyResult:
    """What a batched step produced, per scheduled chunk (in order)."""

    tokens: list[list[int]]               # emitted tokens (accepted drafts, then the target's token)
    logprobs: list[list[dict | None]]     # plain rows only
    drafts: list[int]                     # drafts verified
    accepted: list[int]                   # drafts accepted
    first_positions: list[int]            # position of each request's first row (its last accepted token)
    hidden: torch.Tensor                  # [n * rows_per_seq, H] target hidden rows (a copy)
    rows_per_seq: int


def neutral_params(params):
    """The params without penalties / min_tokens: what a draft is sampled with (any draft distribution keeps
    rejection sampling exact; the target side applies the penalties)."""
    return dataclasses.replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                               min_tokens=0)


class BatchedSpeculation:
    """Runs speculative steps of pure-decode batches (module docstring) for an engine's model runner."""

    def __init__(self, runner, sampler: Sampler, k_max: int, max_requests: int, stats=None):
        """``stats``: the engine's :class:`~glm5.engine.spec_decode.SpecStats` (it counts dropped backlogs)."""
        self.runner, self.sampler, self.k_max = runner, sampler, k_max
        self.model, self.mtp, self.cache = runner.model, runner.mtp, runner.cache
        text = runner.cfg.text
        dev, dtype = runner.device, runner.dtype
        self.max_requests = max_requests
        self.stats = stats
        # rows per pass: k+1 per request to verify or catch up, DRAIN_ROWS per request to drain a backlog
        self.stager = DecodeStager(self.cache, max_requests * max(DRAIN_ROWS, k_max + 1), runner.stager.max_blocks, dev)
        self.buffers = VerifyBuffers.allocate(text, max_requests, k_max + 1, dev, dtype)
        self.planner = DecodeAttentionPlanner(text, self.stager.max_batch, dtype, dev)
        self.fwd: SpecForwards = SpecForwards(self.model, self.mtp, self.cache, self.stager, self.buffers,
                                              self.planner, share_index=text.index_share_for_mtp_iteration)
        self.buckets = graph_buckets(max_requests)
        logger.info("batched speculation: up to %d requests x %d drafts, verify buffers %.1f MiB", max_requests, k_max,
                    self.buffers.nbytes() / 2**20)

    def capture_cuda_graphs(self, max_batch: int, pool=None) -> None:
        graphs = SpecGraphs(self.model, self.mtp, self.cache, self.stager, self.buffers, self.planner,
                            share_index=self.fwd.share_index, buckets=graph_buckets(min(max_batch, self.max_requests)),
                            k_max=self.k_max, drain_rows=DRAIN_ROWS, pool=pool)
        graphs.capture()
        self.fwd = graphs

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return n

    # ------------------------------------------------------------------ which steps
    def accepts(self, sched: SchedulerOutput) -> bool:
        """True when every chunk is one request's next token plus its drafts (no prefill, no placeholder).

        One pass over the chunks with the scheduler's properties written out (``decode_only``: one token plus
        the drafts; ``samples``: the chunk reaches the request's last known token): it runs every step."""
        chunks = sched.chunks
        if not chunks or len(chunks) > self.max_requests:
            return False
        k_max = self.k_max
        for c in chunks:
            s, nd = c.seq, c.num_drafts
            lo = s.num_computed_tokens
            if c.num_tokens != 1 + nd or nd > k_max or lo + 1 != s.num_tokens:
                return False
            if s.mm is not None and (s.mm.positions is None or bool((s.mm.positions == lo).any())):
                return False
        return True

    # ------------------------------------------------------------------ verify + accept + commit
    def verify(self, sched: SchedulerOutput) -> VerifyResult:
        chunks = sched.chunks
        n = len(chunks)
        k = max(c.num_drafts for c in chunks)
        if k == 0:
            return self._plain(sched)
        t = k + 1
        rows = DecodeRows([], [], [], [])
        firsts = []
        on_device = self._device_drafts(chunks, k)
        for c in chunks:
            s, lo = c.seq, c.seq.num_computed_tokens
            drafts = [0] * k if on_device is not None else s.draft_tokens[: c.num_drafts] + [0] * (k - c.num_drafts)
            rows.tokens.extend(s.tokens(lo, lo + 1) + drafts)
            rows.positions.extend(range(lo, lo + t))
            rows.state_slots.extend([s.state_slot] * t)
            rows.block_tables.extend([s.block_table] * t)
            firsts.append(lo)
        nb = self._bucket(n)
        batch, out = self.fwd.verify(rows, t, nb, drafts=on_device)
        logits = out.logits[: n * t].view(n, t, -1)
        hidden = out.hidden[: n * t].clone()
        emitted, accepted, lps = self._accept(chunks, logits, k)
        n_valid = torch.zeros(nb, dtype=torch.int64, device=accepted.device)
        n_valid[:n] = accepted + 1
        self.fwd.commit(batch, n_valid)
        host = torch.cat([emitted.flatten(), accepted]).tolist()  # the step's one sync
        acc = host[n * t:]
        tokens = [host[i * t: i * t + acc[i] + 1] for i in range(n)]
        return VerifyResult(tokens=tokens, logprobs=lps, drafts=[c.num_drafts for c in chunks], accepted=acc,
                            first_positions=firsts, hidden=hidden, rows_per_seq=t)

    @staticmethod
    def _device_drafts(chunks, k: int) -> torch.Tensor | None:
        """``[n, k]`` drafts of the chunks' requests still on the device, when all of them come from one
        proposal that the host has not read (the usual decode round): the verification then starts without
        waiting for the draft passes. Columns past a request's ``num_drafts`` hold values it never accepts.
        None otherwise: the caller writes the host's drafts into the rows."""
        pending = [c.seq.pending_drafts for c in chunks]
        if pending[0] is None:
            return None
        copy = pending[0][0]
        if any(p is None or p[0] is not copy for p in pending):
            return None
        dev = copy.device_tensor
        idx = [p[1] for p in pending]
        if idx != list(range(dev.shape[0])):
            dev = dev.index_select(0, host_to_device(idx, dev.device))
        return dev[:, :k]

    def _plain(self, sched: SchedulerOutput) -> VerifyResult:
        """No request has drafts: the ordinary batched decode step (decode graphs) and sampler."""
        # forward_decode, not the runner's _execute_decode: that one also lists each request's rows for the
        # per-request MTP proposal, which this path does not read (a list of n objects per step at k = 0)
        _, out = self.runner.forward_decode(self.runner._decode_rows(sched))
        seqs = [c.seq for c in sched.chunks]
        n = len(seqs)
        result = self._sample_plain(out.logits[:n], seqs)
        # the graph's output rows are overwritten by the next replay: a copy for the backlogs (the engine takes
        # this path only while the MTP layer follows one of the requests at least)
        hidden = out.hidden[:n].clone()
        tokens = result.token_ids.tolist()
        lps = [[TokenLogprobs.as_dict(result.logprobs[i])] for i in range(n)]
        return VerifyResult(tokens=[[x] for x in tokens], logprobs=lps, drafts=[0] * n, accepted=[0] * n,
                            first_positions=[s.num_computed_tokens for s in seqs], hidden=hidden, rows_per_seq=1)

    def _sample_plain(self, logits: torch.Tensor, seqs: list[Sequence]):
        return self.sampler.sample(logits, [s.params for s in seqs], generators=[s.generator for s in seqs],
                                   output_token_ids=[s.output_token_ids for s in seqs],
                                   prompt_token_ids=[s.prompt_token_ids for s in seqs],
                                   eos_token_ids=[s.eos_token_ids for s in seqs],
                                   bad_words_token_ids=[s.bad_words_token_ids for s in seqs])

    def _accept(self, chunks, logits: torch.Tensor, k: int):
        """Emitted tokens ``[n, k+1]`` and accepted drafts ``[n]`` on the device, plus plain rows' logprobs."""
        n, t, vocab = logits.shape
        dev = logits.device
        emitted = torch.zeros(n, t, dtype=torch.int64, device=dev)
        accepted = torch.zeros(n, dtype=torch.int64, device=dev)
        lps: list[list[dict | None]] = [[] for _ in range(n)]
        plain = [i for i, c in enumerate(chunks) if c.num_drafts == 0]
        if plain:  # no drafts (logprobs wanted, or no room): the ordinary sampler on the first row
            idx = host_to_device(plain, dev)
            result = self._sample_plain(logits[idx, 0], [chunks[i].seq for i in plain])
            emitted[idx, 0] = result.token_ids
            for j, i in enumerate(plain):
                lps[i] = [TokenLogprobs.as_dict(result.logprobs[j])]
        spec = [i for i, c in enumerate(chunks) if c.num_drafts > 0]
        if not spec:
            return emitted, accepted, lps
        seqs = [chunks[i].seq for i in spec]
        nd = [chunks[i].num_drafts for i in spec]
        drafts = [s.draft_tokens[:d] + [0] * (k - d) for s, d in zip(seqs, nd)]
        params, hist, prompts, eos, bad = [], [], [], [], []
        for s, d in zip(seqs, drafts):
            for j in range(t):   # row j has seen drafts[:j]: penalties and bad words count them as output
                params.append(s.params)
                hist.append(s.output_token_ids + d[:j])
                prompts.append(s.prompt_token_ids)
                eos.append(s.eos_token_ids)
                bad.append(s.bad_words_token_ids)
        sidx = host_to_device(spec, dev)
        x = self.sampler.process_logits(logits[sidx].reshape(-1, vocab), params, output_token_ids=hist,
                                        prompt_token_ids=prompts, eos_token_ids=eos,
                                        bad_words_token_ids=bad).view(len(spec), t, vocab)
        drafts_t = host_to_device(drafts, dev)
        nd_t = host_to_device(nd, dev)
        greedy = [j for j, s in enumerate(seqs) if s.params.is_greedy]
        sampled = [j for j, s in enumerate(seqs) if not s.params.is_greedy]
        out_e = torch.zeros(len(spec), t, dtype=torch.int64, device=dev)
        out_a = torch.zeros(len(spec), dtype=torch.int64, device=dev)
        if greedy:
            g = host_to_device(greedy, dev)
            e, a = accept_greedy(torch.argmax(x[g], dim=-1), drafts_t[g], nd_t[g])
            out_e[g], out_a[g] = e, a
        if sampled:
            sj = host_to_device(sampled, dev)
            q = torch.zeros(len(sampled), k, vocab, dtype=torch.float32, device=dev)
            for r, j in enumerate(sampled):
                probs = seqs[j].draft_probs
                q[r, : probs.shape[0]] = probs[:k]
            seeds = host_to_device([seqs[j].noise_seed for j in sampled], dev)
            first = host_to_device([seqs[j].num_computed_tokens for j in sampled], dev)
            e, a = accept_sampled(torch.softmax(x[sj], dim=-1), q, drafts_t[sj], nd_t[sj], seeds, first)
            out_e[sj], out_a[sj] = e, a
        emitted[sidx], accepted[sidx] = out_e, out_a
        return emitted, accepted, lps

    # ------------------------------------------------------------------ MTP: catch-up and drafts
    def propose(self, live: list[tuple[int, Sequence, int]], res: VerifyResult, ensure_blocks,
                keep_mtp: bool = True, hold_mtp: bool = True) -> bool:
        """``live``: ``(chunk index, request, drafts wanted next step)`` of every request still running.
        Catches the MTP layer up on each one's accepted rows (and backlog) and sets ``draft_tokens`` /
        ``draft_probs``; when nobody drafts, the rows go to the backlogs instead. ``keep_mtp``: whether a full
        backlog is drained (speculation could pay at this batch size) or dropped; ``hold_mtp`` False: when
        nobody drafts, the MTP layer stops following every request at once (module docstring). Requests it no
        longer follows (``mtp_off``) are skipped. True when the MTP layer ran (a drafting
        step, or a full backlog drained)."""
        t = res.rows_per_seq
        if not any(want for *_, want in live):
            if not hold_mtp:   # a backlog that would be dropped when full is not carried: dropped now
                drop_backlogs([seq for _, seq, _ in live if not seq.mtp_off], self.stats)
                return False
            # nobody drafts: each request's emitted rows join its backlog as a reference into this step's hidden
            # rows (O(1) host work per request); a backlog that reached MAX_BACKLOG rows is caught up without
            # drafting, or dropped
            full = []
            for i, seq, _ in live:
                if seq.mtp_off:
                    continue
                b = seq.mtp_backlog
                if b is None:
                    b = seq.mtp_backlog = MTPBacklog(res.first_positions[i])
                b.append(res.hidden, i * t, res.accepted[i] + 1)   # (accepted <= t - 1: the rows it emitted)
                if b.count >= MAX_BACKLOG:
                    full.append(seq)
            if not full:
                return False
            if not keep_mtp:
                drop_backlogs(full, self.stats)
                return False
            self._catch_up([(seq, first, rows_h, 0) for seq, (first, rows_h) in zip(full, release_backlogs(full))],
                           drafting=False)
            return True
        per_request = res.hidden.split(t)  # one view per request in one call, cut below only where drafts failed
        entries = []   # (seq, first position, hidden rows, drafts wanted)
        for i, seq, want in live:
            if not seq.mtp_off:
                entries.append((seq, res.first_positions[i], per_request[i][: res.accepted[i] + 1], want))
        held = [j for j, (seq, *_) in enumerate(entries) if seq.mtp_backlog is not None]
        if held:
            released = release_backlogs([entries[j][0] for j in held], [entries[j][2] for j in held])
            for j, (first, rows_h) in zip(held, released):
                seq, _, _, want = entries[j]
                entries[j] = (seq, first, rows_h, want)
        logits, hid, scores = self._catch_up(entries, drafting=True)
        self._draft(entries, logits, hid, scores, ensure_blocks)
        return True

    def _catch_up(self, entries, drafting: bool):
        """MTP rows for every entry's pending positions; returns (drafting) the last row's logits, recycled
        hidden and (index sharing) scores per entry. Rows before the last ``k_max + 1`` of an entry (a backlog)
        go first, in drain passes of up to ``DRAIN_ROWS`` rows per request without logits (graph replays: a
        backlog of ``MAX_BACKLOG`` rows costs two, not one eager pass over every row; each pass reads the MTP
        layer's weights, its routed experts included, once)."""
        t = DRAIN_ROWS
        keep = self.k_max + 1 if drafting else 0
        heads = [(seq, first, rows_h[: max(0, rows_h.shape[0] - keep)]) for seq, first, rows_h, _ in entries]
        done = 0
        while any(h.shape[0] > done for _, _, h in heads):
            part = [(seq, first + done, h[done: done + t]) for seq, first, h in heads if h.shape[0] > done]
            rows, hidden, _ = self._mtp_rows(part)
            self.fwd.mtp_drain(rows, hidden, self._bucket(len(part)), t)
            done += t
        if not drafting:
            return None
        tails = [(seq, first + h.shape[0], rows_h[h.shape[0]:])
                 for (seq, first, rows_h, _), (_, _, h) in zip(entries, heads)]
        n = len(tails)
        longest = max(h.shape[0] for _, _, h in tails)
        nb = self._bucket(n)
        rows, hidden, last = self._mtp_rows(tails)
        logits, h, scores = self.fwd.mtp_pass(rows, hidden, last + [0] * (nb - n), nb * longest)
        idx = host_to_device(last, h.device)
        return logits[:n], h[idx].clone(), None if scores is None else scores[idx].clone()

    @staticmethod
    def _mtp_rows(part) -> tuple[DecodeRows, torch.Tensor, list[int]]:
        """Staging rows of ``(request, first position, target hidden rows)`` items, compacted: the MTP row at
        position ``p`` takes the token at ``p + 1``. Returns the rows, their hidden rows, each item's last row."""
        rows = DecodeRows([], [], [], [])
        last = []
        for seq, first, rows_h in part:
            m = rows_h.shape[0]
            rows.tokens.extend(seq.tokens(first + 1, first + m + 1))
            rows.positions.extend(range(first, first + m))
            rows.state_slots.extend([seq.state_slot] * m)
            rows.block_tables.extend([seq.block_table] * m)
            last.append(len(rows.tokens) - 1)
        return rows, torch.cat([h for _, _, h in part]), last

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor, positions: list[int]):
        """Draft tokens ``[n]`` from MTP logits: argmax for greedy requests, a counter-stream race over the
        processed distribution (kept as ``q``) for sampling ones. Returns (tokens, q rows or None per seq)."""
        tokens = torch.argmax(logits, dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if sampled:
            dev = logits.device
            si = host_to_device(sampled, dev)
            x = self.sampler.process_logits(logits[si], [neutral_params(seqs[i].params) for i in sampled],
                                            output_token_ids=[[] for _ in sampled])
            q = torch.softmax(x, dim=-1)
            seeds = host_to_device([seqs[i].noise_seed for i in sampled], dev)
            pos = host_to_device([positions[i] for i in sampled], dev)
            tokens[si] = race(q, seeds, pos, SALT_DRAFT)
            for r, i in enumerate(sampled):
                probs[i] = q[r]
        return tokens, probs

    def _draft(self, entries, logits: torch.Tensor, hid: torch.Tensor, scores, ensure_blocks) -> None:
        seqs = [e[0] for e in entries]
        want = [e[3] for e in entries]
        n = len(seqs)
        steps = max(want)
        d_pos = [s.num_tokens for s in seqs]                     # position of draft 1
        tok, q = self._choose(seqs, logits, d_pos)
        drafts, probs = [tok], [q]
        slots = host_to_device([s.state_slot for s in seqs], hid.device)
        tail = self.cache.tail[self.mtp.layer]
        snapshot = tail.index_select(0, slots) if steps > 1 else None
        nb = self._bucket(n)
        if scores is not None:
            self.fwd.scores_in[:n].copy_(scores)
        for j in range(1, steps):
            for i, s in enumerate(seqs):   # blocks for this row's position; without them the request stops here
                if want[i] > j and not ensure_blocks(s, s.num_tokens + j - 1):
                    want[i] = j
            rows = DecodeRows([], [], [], [])
            for s in seqs:
                rows.tokens.append(0)
                rows.positions.append(s.num_tokens - 2 + j)
                rows.state_slots.append(s.state_slot)
                rows.block_tables.append(s.block_table)
            out, h, _ = self.fwd.mtp_pass(rows, hid, list(range(nb)), nb, draft=True, tokens=drafts[-1])
            hid = h[:n].clone()
            tok, q = self._choose(seqs, out[:n], [p + j for p in d_pos])
            drafts.append(tok)
            probs.append(q)
        if snapshot is not None:  # draft rows sit past the accepted tokens: put the MTP tail back
            tail.index_copy_(0, slots, snapshot)
        copy = HostCopy(torch.stack(drafts, dim=1))  # read by the next verification on the device
        for i, s in enumerate(seqs):
            s.set_pending_drafts(copy, i, want[i])
            s.draft_probs = None if probs[0][i] is None or not want[i] else \
                torch.stack([probs[j][i] for j in range(want[i])])


__all__ = ["BatchedSpeculation", "DRAIN_ROWS", "MAX_BACKLOG", "MTPBacklog", "VerifyResult", "neutral_params",
           "release_backlogs", "take_backlogs"]
