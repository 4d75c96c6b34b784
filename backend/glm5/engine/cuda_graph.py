"""Decode steps without per-step host work: pinned input staging and CUDA-graph replay.

A decode step of a small batch is bound by kernel launches (several thousand per step on the real
layer shapes), not by the GPU. The batched decode path (:class:`~glm5.layers.batch.DecodeMeta`) has
no per-request loop and no host sync, so the whole forward — embeddings to logits — can be captured
once per batch-size bucket and replayed: one launch per step.

* :class:`DecodeStager` owns one pinned host buffer and the static device buffers of a decode step
  (token ids, positions, state slots, latent slot of each row, padded block tables). A step writes
  its rows into the pinned buffer (of the block tables only what changed since the row's last step),
  pads up to the bucket size with rows that point at the cache's scratch block and slot, and issues one
  asynchronous host-to-device copy per tensor.
* :class:`DecodeGraphRunner` captures the model's forward over those static buffers for every
  bucket (largest first, one shared memory pool) and replays the smallest bucket that fits.

The graph's outputs are static tensors overwritten by the next replay of any bucket (the buckets share
one memory pool): callers consume (or clone) them within the step, as the engine does (sampling, then
the MTP proposal). Padding rows are routed through the MoE like real rows, so a step padded to its
bucket may stream a few more experts than its real rows need.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from glm5.cache.hybrid_cache import HybridCache
from glm5.config import TextConfig
from glm5.layers.batch import DecodeMeta, ForwardBatch
from glm5.layers.glm5 import Glm5ForCausalLM, ModelOutput

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_buckets(max_batch: int) -> list[int]:
    """Bucket sizes up to ``max_batch`` (which is always one of them)."""
    out = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return out + [max_batch]


class _Slices(NamedTuple):
    """The first ``b`` rows of a :class:`DecodeStager`'s buffers (views, made once per batch size)."""

    ids: torch.Tensor
    positions: torch.Tensor
    state_slots: torch.Tensor
    slot_mapping: torch.Tensor
    logits: torch.Tensor       # every row's logits (``logits_indices[:b]``)
    dev_bt: torch.Tensor
    host_bt: torch.Tensor


@dataclass
class DecodeRows:
    """Host-side description of a decode step, one entry per request (in batch row order).

    ``block_tables`` are the requests' own lists, which the KV cache manager only ever extends or replaces:
    :class:`DecodeStager` relies on that to write only the entries a row's list gained since it last staged
    that same list. (Worker ranks of a multi-process executor receive unpickled copies each step, so they
    rewrite whole tables: correct, without the saving.)"""

    tokens: list[int]
    positions: list[int]
    state_slots: list[int]
    block_tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


class DecodeStager:
    """Pinned host staging and static device buffers for decode-step inputs (see module docstring)."""

    def __init__(self, cache: HybridCache, max_batch: int, max_blocks: int, device: torch.device):
        self.cache, self.max_batch, self.max_blocks, self.device = cache, max_batch, max_blocks, device
        pin = device.type == "cuda"
        # rows: token ids, positions, state slots, latent slot of each row, logits rows (when not every row)
        self.host_i64 = torch.zeros(5, max_batch, dtype=torch.int64, pin_memory=pin)
        self.host_bt = torch.full((max_batch, max_blocks), cache.scratch_block, dtype=torch.int32, pin_memory=pin)
        # per host row: the block-table list written there and how many of its entries (past them: scratch)
        self._staged_lists: list[list[int] | None] = [None] * max_batch
        self._staged_lens: list[int] = [0] * max_batch
        self.dev_i64 = torch.zeros(5, max_batch, dtype=torch.int64, device=device)
        self.dev_bt = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pin else None
        # the device as an index: current_stream(torch.device("cuda")) resolves the current device on every call
        self._stream_device = (device.index if device.index is not None else torch.cuda.current_device()) if pin else None
        self._pad_slot = cache.scratch_block * cache.block_size  # latent row of a padding row's token
        # numpy views of the pinned buffers and, per batch size, the buffers' slices: made once, since slicing
        # tensors costs microseconds of host time per view, each step
        self._host_np = self.host_i64.numpy(), self.host_bt.numpy()
        self._slices: dict[int, _Slices] = {}

    def stage(self, rows: DecodeRows, padded: int,
              prepare: Callable[[ForwardBatch], None] | None = None, *, rows_per_seq: int = 1,
              logits_rows: list[int] | None = None, verify=None) -> ForwardBatch:
        """Write ``rows`` (then padding up to ``padded`` rows) into the device buffers; return the batch view.

        ``prepare(batch)``: the step's host-side planning (FlashInfer). Its copies are enqueued before the
        event that the next :meth:`stage` waits on before rewriting pinned memory. Speculative steps:
        ``rows_per_seq`` rows per request (verification, with ``verify`` the layers' buffers), and
        ``logits_rows`` when only some rows need logits (the MTP catch-up: each request's last row). A row
        whose position lies past its request's blocks (a draft beyond the blocks the scheduler granted)
        writes its latent row to the scratch block."""
        n = len(rows)
        if not n <= padded <= self.max_batch:
            raise ValueError(f"decode batch of {n} rows padded to {padded}: must be <= max batch {self.max_batch}")
        if padded % rows_per_seq or n % rows_per_seq:
            raise ValueError(f"{n} rows padded to {padded} are not whole requests of {rows_per_seq} rows")
        lens = list(map(len, rows.block_tables))
        longest = max(lens, default=0)
        if longest > self.max_blocks:
            raise ValueError(f"a request holds {longest} blocks but the decode buffers have {self.max_blocks} "
                             "columns (max_model_len / block_size); raise max_model_len")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffer
        bs = self.cache.block_size
        h, bt = self._host_np
        h[0, :n] = rows.tokens
        h[1, :n] = rows.positions
        h[2, :n] = rows.state_slots
        self._write_block_tables(bt, rows.block_tables, lens, padded)
        pad = self._pad_slot  # each row's latent slot: its block's row for the position, scratch past its blocks
        h[3, :n] = [t[p // bs] * bs + p % bs if p // bs < m else pad
                    for t, p, m in zip(rows.block_tables, rows.positions, lens)]
        h[0, n:padded] = 0
        h[1, n:padded] = 0
        h[2, n:padded] = self.cache.scratch_slot
        h[3, n:padded] = self._pad_slot
        if logits_rows is not None:
            h[4, : len(logits_rows)] = logits_rows
        # the whole [5, max_batch] block: a column slice is not contiguous and would go through a pageable copy
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        sl = self._sliced(padded)
        sl.dev_bt.copy_(sl.host_bt, non_blocking=True)
        batch = self.view(padded, positions_host=list(rows.positions) + [0] * (padded - n), rows_per_seq=rows_per_seq,
                          n_logits=None if logits_rows is None else len(logits_rows), verify=verify)
        if prepare is not None:
            prepare(batch)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self._stream_device))
        return batch

    def _write_block_tables(self, bt, tables: list[list[int]], lens: list[int], padded: int) -> None:
        """Make host rows ``[0, padded)`` hold ``tables`` (padding rows: all scratch), writing only what
        changed. A row that staged the same list object before gets just the entries appended since (one
        per 64 tokens of a decoding request), any other row its whole table: converting every entry of every
        table each step costs ~30 ns per entry on the host, on the critical path. Entries past a row's table
        are the scratch block, as the kernels expect of unused columns. A step whose rows all hold the lists
        and lengths they held last step (most decode steps) is recognised by C-level comparisons alone."""
        n = len(tables)
        staged, written = self._staged_lists, self._staged_lens
        scratch = self.cache.scratch_block
        if lens != written[:n] or not all(map(operator.is_, tables, staged)):
            for i, (table, m) in enumerate(zip(tables, lens)):
                w = written[i]
                if table is staged[i] and m >= w:
                    if m == w:
                        continue
                    bt[i, w:m] = table[w:]
                else:
                    bt[i, :m] = table
                    if w > m:
                        bt[i, m:w] = scratch
                staged[i], written[i] = table, m
        for i in range(n, padded):  # padding rows
            if written[i]:
                bt[i, : written[i]] = scratch
                written[i] = 0
            staged[i] = None

    def _sliced(self, b: int) -> _Slices:
        sl = self._slices.get(b)
        if sl is None:
            sl = self._slices[b] = _Slices(*(self.dev_i64[i, :b] for i in range(4)), self.logits_indices[:b],
                                           self.dev_bt[:b], self.host_bt[:b])
        return sl

    def view(self, b: int, positions_host: list[int] | None = None, rows_per_seq: int = 1,
             n_logits: int | None = None, verify=None) -> ForwardBatch:
        """The first ``b`` rows of the static buffers as a decode batch: logits for every row, or for the
        first ``n_logits`` entries of the staged logits rows."""
        sl = self._sliced(b)
        logits = sl.logits if n_logits is None else self.dev_i64[4, :n_logits]
        return ForwardBatch(input_ids=sl.ids, positions=sl.positions, seqs=[], logits_indices=logits,
                            decode=DecodeMeta(state_slots=sl.state_slots, block_tables=sl.dev_bt,
                                              slot_mapping=sl.slot_mapping, positions_host=positions_host,
                                              rows_per_seq=rows_per_seq, verify=verify))


class DecodeAttentionPlanner:
    """Host-side planning of the decode attention backend before each forward / graph replay.

    Only FlashInfer needs it: its MLA wrapper schedules work from every query row's selection size,
    which depends only on the positions (:func:`glm5_kernels.indexer.count_selected`), so one plan per
    step serves every MLA layer and no device value is read. The Triton and torch backends need nothing."""

    def __init__(self, text_cfg: TextConfig, max_batch: int, dtype: torch.dtype, device: torch.device):
        self.cfg, self.max_batch, self.dtype, self.device = text_cfg, max_batch, dtype, device
        self.wrapper = None  # FlashInferSparseMLA, made on first use
        self.backend: str | None = None  # resolved on the first call (graphs captured then keep that choice)

    def __call__(self, batch: ForwardBatch) -> None:
        if self.backend is None:
            from glm5.layers.backends import decode_attn_backend
            self.backend = decode_attn_backend(self.device, self.dtype, self.cfg.kv_lora_rank)
        if self.backend != "flashinfer":
            return
        from glm5_kernels.flashinfer_mla import FlashInferSparseMLA
        from glm5_kernels.indexer_ref import count_selected
        t = self.cfg
        if self.wrapper is None:
            self.wrapper = FlashInferSparseMLA(t.num_attention_heads, self.max_batch, t.index_topk + t.index_kpool - 1,
                                               t.qk_head_dim ** -0.5, head_dim=t.kv_lora_rank, dtype=self.dtype,
                                               device=self.device)
        self.wrapper.plan(count_selected(batch.decode.positions_host, t.index_topk // t.index_kpool, t.index_kpool))
        batch.decode.flashinfer = self.wrapper


class DecodeGraphRunner:
    """CUDA graphs of the model's batched decode forward, one per batch bucket."""

    def __init__(self, model: Glm5ForCausalLM, cache: HybridCache, stager: DecodeStager,
                 buckets: list[int] | None = None, prepare: Callable[[ForwardBatch], None] | None = None):
        """``prepare(batch)``: host-side work before every forward of a staged batch (capture and replay),
        e.g. planning FlashInfer's MLA wrapper into the fixed buffers the graph reads."""
        self.model, self.cache, self.stager = model, cache, stager
        self.prepare = prepare or (lambda batch: None)
        self.buckets = sorted(buckets or graph_buckets(stager.max_batch))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ModelOutput]] = {}
        self.pool = None

    def capture(self) -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(device=self.stager.device)
        stream.wait_stream(torch.cuda.current_stream(self.stager.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: later graphs reuse its memory pool
                # every row a padding row: warm-up and capture touch only the scratch cache rows
                batch = self.stager.stage(DecodeRows([], [], [], []), b, self.prepare)
                for _ in range(2):  # compile / autotune every kernel outside capture
                    self.model.forward(batch, self.cache)
                torch.cuda.synchronize(self.stager.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model.forward(batch, self.cache)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = (graph, out)
        torch.cuda.current_stream(self.stager.device).wait_stream(stream)
        torch.cuda.synchronize(self.stager.device)
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.buckets,
                    time.perf_counter() - t0)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, rows: DecodeRows) -> tuple[ForwardBatch, ModelOutput]:
        """Stage ``rows``, replay the fitting graph; outputs are views of the graph's static tensors."""
        n = len(rows)
        b = self.bucket_for(n)
        if b is None or b not in self.graphs:
            raise ValueError(f"no captured decode graph for {n} rows (buckets {self.buckets})")
        batch = self.stager.stage(rows, b, self.prepare)
        graph, out = self.graphs[b]
        graph.replay()
        return batch, ModelOutput(logits=out.logits[:n], hidden=out.hidden[:n])
