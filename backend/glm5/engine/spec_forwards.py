"""The forward passes of a batched speculative step, eager or replayed from CUDA graphs.

Four passes, each over inputs staged by :class:`~glm5.engine.cuda_graph.DecodeStager` into fixed buffers:

* **verify** — the target model over ``T = k + 1`` rows per request (``DecodeMeta.rows_per_seq``), leaving
  the commit's inputs in :class:`~glm5.layers.speculative.VerifyBuffers`;
* **commit** — :func:`~glm5.layers.speculative.commit_verification` with the accepted lengths in a fixed
  device buffer;
* **MTP catch-up** — the MTP layer over the rows the target just accepted (compacted, padded to
  ``requests × T``), logits of each request's last row, and (index sharing) the index scores it chose;
* **MTP draft step** — one row per request, reusing those scores;
* **MTP drain** — up to ``drain_rows`` backlog rows per request for the MTP layer's cache only (no logits).

:class:`SpecGraphs` captures each pass per (batch bucket, rows per request) and replays it; a step whose
shape has no graph (a batch above the cap) runs eagerly with
the same staging. The graphs share one memory pool, so a pass's outputs are valid until the next replay:
the caller consumes or copies them first (as :mod:`glm5.engine.spec_batched` does).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from glm5.engine.cuda_graph import DecodeRows, DecodeStager
from glm5.layers.batch import ForwardBatch
from glm5.layers.glm5 import ModelOutput
from glm5.layers.speculative import VerifyBuffers, commit_verification

logger = logging.getLogger(__name__)


class SpecForwards:
    """Eager passes (see module docstring). ``prepare``: host planning of the decode attention (FlashInfer)."""

    def __init__(self, model, mtp, cache, stager: DecodeStager, buffers: VerifyBuffers, prepare=None,
                 share_index: bool = True):
        self.model, self.mtp, self.cache, self.stager, self.buffers = model, mtp, cache, stager, buffers
        self.prepare = prepare
        self.share_index = share_index
        dev, rows, reqs = stager.device, stager.max_batch, buffers.max_requests
        self.hidden_in = torch.zeros(rows, model.cfg.text.hidden_size, device=dev, dtype=model.dtype)
        self.n_valid = torch.zeros(reqs, dtype=torch.int64, device=dev)
        max_pools = stager.max_blocks * cache.pools_per_block
        self.scores_in = torch.zeros(reqs, max_pools, device=dev, dtype=torch.float32)

    # ------------------------------------------------------------------ staging (shared with the graphs)
    def _stage_verify(self, rows: DecodeRows, t: int, padded_requests: int,
                      drafts: torch.Tensor | None = None) -> ForwardBatch:
        """``drafts [n, t - 1]`` (device): the drafts of the ``n`` requests, written over the rows' draft tokens
        (the host's rows then hold placeholders), so staging need not wait for the draft passes."""
        self.buffers.check(padded_requests, t)
        batch = self.stager.stage(rows, padded_requests * t, self.prepare, rows_per_seq=t, verify=self.buffers)
        if drafts is not None:
            n = drafts.shape[0]
            batch.input_ids[: n * t].view(n, t)[:, 1:].copy_(drafts)
        return batch

    def _stage_mtp(self, rows: DecodeRows, hidden: torch.Tensor, logits_rows: list[int], padded_rows: int,
                   draft: bool, tokens: torch.Tensor | None) -> ForwardBatch:
        batch = self.stager.stage(rows, padded_rows, self.prepare, logits_rows=logits_rows)
        self.hidden_in[: hidden.shape[0]].copy_(hidden)
        if tokens is not None:  # draft step: this step's input tokens are the previous step's drafts (device)
            batch.input_ids[: tokens.shape[0]].copy_(tokens)
        if self.share_index:
            if draft:
                batch.decode.index_scores = {self.mtp.layer: self.scores_in[:padded_rows]}
            else:
                batch.decode.scores_out = {}
        return batch

    # ------------------------------------------------------------------ passes
    def verify(self, rows: DecodeRows, t: int, padded_requests: int,
               drafts: torch.Tensor | None = None) -> tuple[ForwardBatch, ModelOutput]:
        batch = self._stage_verify(rows, t, padded_requests, drafts)
        return batch, self.model.forward(batch, self.cache)

    def commit(self, batch: ForwardBatch, n_valid: torch.Tensor) -> None:
        """``n_valid [padded requests]`` int64 (0 for padding requests)."""
        n = n_valid.shape[0]
        self.n_valid[:n].copy_(n_valid)
        commit_verification(self.model, batch, self.n_valid[:n], self.cache)

    def mtp_pass(self, rows: DecodeRows, hidden: torch.Tensor, logits_rows: list[int], padded_rows: int,
                 draft: bool = False, tokens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MTP layer over staged rows; ``hidden [rows, H]`` the matching target (catch-up) or recycled (draft)
        hidden rows. Returns (logits ``[len(logits_rows), V]``, recycled hidden of every row, index scores of
        every row when a catch-up shares them)."""
        batch = self._stage_mtp(rows, hidden, logits_rows, padded_rows, draft, tokens)
        logits, h = self.mtp.forward(batch, self.hidden_in[:padded_rows], self.cache)
        scores = (batch.decode.scores_out or {}).get(self.mtp.layer)
        return logits, h, scores

    def mtp_drain(self, rows: DecodeRows, hidden: torch.Tensor, padded_requests: int, t: int) -> None:
        """MTP layer over up to ``t`` backlog rows per request for its cache only (no logits, no drafts)."""
        batch = self._stage_mtp(rows, hidden, [], padded_requests * t, False, None)
        self.mtp.forward(batch, self.hidden_in[: padded_requests * t], self.cache)


class SpecGraphs(SpecForwards):
    """:class:`SpecForwards` with every pass of a bucketed shape captured as a CUDA graph."""

    def __init__(self, *args, buckets: list[int], k_max: int, drain_rows: int, pool=None, **kw):
        super().__init__(*args, **kw)
        self.buckets = sorted(buckets)
        self.k_max, self.drain_rows = k_max, drain_rows
        self.pool = pool
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}

    def _empty(self) -> DecodeRows:
        return DecodeRows([], [], [], [])

    def capture(self) -> None:
        t0 = time.perf_counter()
        dev = self.stager.device
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for t in range(self.k_max + 1, 1, -1):
                    batch = self._stage_verify(self._empty(), t, b)
                    self._capture(("verify", b, t), functools.partial(self.model.forward, batch, self.cache), stream)
                    self._capture(("commit", b, t), functools.partial(commit_verification, self.model, batch,
                                                                      self.n_valid[:b], self.cache), stream)
                for t in range(self.k_max + 1, 0, -1):
                    mb = self._stage_mtp(self._empty(), self.hidden_in[:0], [0] * b, b * t, False, None)
                    self._capture(("catchup", b, t), functools.partial(self._mtp_outputs, mb, b * t), stream)
                mb = self._stage_mtp(self._empty(), self.hidden_in[:0], list(range(b)), b, True, None)
                self._capture(("draft", b), functools.partial(self._mtp_outputs, mb, b), stream)
                t = self.drain_rows
                mb = self._stage_mtp(self._empty(), self.hidden_in[:0], [], b * t, False, None)
                self._capture(("drain", b, t), functools.partial(self._mtp_outputs, mb, b * t), stream)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        logger.info("captured %d speculative CUDA graphs (batches %s, k <= %d) in %.1f s", len(self.graphs),
                    self.buckets, self.k_max, time.perf_counter() - t0)

    def _mtp_outputs(self, batch: ForwardBatch, rows: int):
        logits, h = self.mtp.forward(batch, self.hidden_in[:rows], self.cache)
        return logits, h, (batch.decode.scores_out or {}).get(self.mtp.layer)

    def _capture(self, key: tuple, fn, stream) -> None:
        for _ in range(2):  # compile / autotune every kernel outside capture
            fn()
        torch.cuda.synchronize(self.stager.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)

    def verify(self, rows: DecodeRows, t: int, padded_requests: int,
               drafts: torch.Tensor | None = None) -> tuple[ForwardBatch, ModelOutput]:
        key = ("verify", padded_requests, t)
        if key not in self.graphs:
            return super().verify(rows, t, padded_requests, drafts)
        batch = self._stage_verify(rows, t, padded_requests, drafts)
        graph, out = self.graphs[key]
        graph.replay()
        return batch, out

    def commit(self, batch: ForwardBatch, n_valid: torch.Tensor) -> None:
        n, t = n_valid.shape[0], batch.decode.rows_per_seq
        key = ("commit", n, t)
        if key not in self.graphs:
            return super().commit(batch, n_valid)
        self.n_valid[:n].copy_(n_valid)
        self.graphs[key][0].replay()

    def mtp_pass(self, rows: DecodeRows, hidden: torch.Tensor, logits_rows: list[int], padded_rows: int,
                 draft: bool = False, tokens: torch.Tensor | None = None):
        n_req = len(logits_rows)
        key = ("draft", n_req) if draft else ("catchup", n_req, padded_rows // max(n_req, 1))
        if key not in self.graphs or (not draft and padded_rows != n_req * key[2]):
            return super().mtp_pass(rows, hidden, logits_rows, padded_rows, draft, tokens)
        self._stage_mtp(rows, hidden, logits_rows, padded_rows, draft, tokens)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def mtp_drain(self, rows: DecodeRows, hidden: torch.Tensor, padded_requests: int, t: int) -> None:
        key = ("drain", padded_requests, t)
        if key not in self.graphs:
            return super().mtp_drain(rows, hidden, padded_requests, t)
        self._stage_mtp(rows, hidden, [], padded_requests * t, False, None)
        self.graphs[key][0].replay()


__all__ = ["SpecForwards", "SpecGraphs"]
