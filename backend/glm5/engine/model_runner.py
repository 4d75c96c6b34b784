"""Turns a scheduler step into one packed forward pass and returns the logits to sample from.

Owns the model weights, the hybrid cache and the vision encoder cache. Per step it packs the
scheduled chunks' token ids and positions, maps multimodal placeholder rows to their vision
embeddings (encoding every not-yet-encoded image/video of the step in one tower call, with an
encoder cache keyed by content hash so a repeated image is encoded once), and runs the model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from glm5.cache.hybrid_cache import CacheConfig, HybridCache
from glm5.cache.snapshot_pool import StateSnapshotPool
from glm5.config import ModelConfig
from glm5.distributed import ParallelContext
from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeGraphRunner, DecodeRows, DecodeStager, graph_buckets
from glm5.engine.media_items import media_hash, media_items
from glm5.engine.prompt_logprobs import prompt_rows
from glm5.engine.scheduler import SchedulerOutput
from glm5.engine.sequence import MultiModalData, Sequence
from glm5.layers.batch import ForwardBatch, SeqChunk, host_to_device
from glm5.layers.glm5 import Glm5ForCausalLM, ModelOutput
from glm5.layers.moe import MoE, RebalanceReport, rebalance_experts
from glm5.layers.mtp import MissingMTPWeights, MTPLayer

logger = logging.getLogger(__name__)


class EncoderCache:
    """LRU of vision embeddings keyed by content hash, bounded in bytes (``max_bytes``).

    An embedding larger than the whole budget is not kept (the request still uses it)."""

    def __init__(self, max_bytes: int = 64 * 2**20):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._d: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str) -> torch.Tensor | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
            self.hits += 1
        return v

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        old = self._d.pop(key, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        self._d[key] = value
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self._d.popitem(last=False)
            self.nbytes -= dropped.numel() * dropped.element_size()


DECODE_PATHS = ("auto", "batched", "per_request")


@dataclass
class ChunkSpec:
    """One request's rows of a packed step, as host values (what :class:`SeqChunk` is built from)."""

    start: int
    num_tokens: int
    context_len: int
    block_table: list[int]
    state_slot: int
    record_states: bool = False


@dataclass
class PackedStep:
    """A packed forward pass as plain host data: what the driver sends to every rank of a distributed engine
    (small and picklable; each rank builds its :class:`ForwardBatch` from it on its own device)."""

    input_ids: list[int]
    positions: list[int]
    chunks: list[ChunkSpec]
    logits_rows: list[int]
    mm_rows: list[int] | None = None
    mm_embeds: torch.Tensor | None = None   # [M, H] on the host
    # prompt logprobs: (chunk index, first logits row, rows, first position), see glm5.engine.prompt_logprobs
    prompt_logprob_rows: list = field(default_factory=list)


class ModelRunner:
    """``decode_path``: ``batched`` runs pure decode steps (one token per request, no drafts) through
    the batch-wide, sync-free path (:class:`~glm5.layers.batch.DecodeMeta`), ``per_request`` through the
    reference per-request loops; ``auto`` is batched on CUDA, per-request on CPU (the oracle tests'
    rounding). ``max_model_len`` sizes the decode block-table buffers."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], cache_cfg: CacheConfig,
                 device: torch.device, dtype: torch.dtype, use_mtp: bool = False, index_fp8: bool = False,
                 max_model_len: int | None = None, decode_path: str = "auto", encoder_cache_bytes: int = 64 * 2**20,
                 par: ParallelContext | None = None, draft_vocab: torch.Tensor | None = None):
        """``par``: this rank's place in a tensor/expert-parallel engine (``weights`` are then its shards);
        default a single device."""
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path={decode_path!r}: choose one of {', '.join(DECODE_PATHS)}")
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.par = par = par or ParallelContext.single()
        self.model = Glm5ForCausalLM(cfg, weights, par)
        self.mtp: MTPLayer | None = None
        mla_layers = list(cfg.text.mla_layer_ids)
        if use_mtp:
            if not cfg.text.mtp_layer_ids:
                raise MissingMTPWeights("speculative decoding needs an MTP layer, but the config declares "
                                        "num_nextn_predict_layers = 0; set num_speculative_tokens=0")
            layer = cfg.text.mtp_layer_ids[0]
            self.mtp = MTPLayer(cfg, weights, layer, self.model.embed, self.model.lm_head, par,
                                draft_vocab=draft_vocab, overlap=self.model.overlap)
            mla_layers.append(layer)
        self.cache = HybridCache(cfg.text, cache_cfg, device, dtype, mla_layers=mla_layers, index_fp8=index_fp8,
                                 kda_heads=cfg.text.linear_num_heads // par.tp_size)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.vision_calls = 0
        self.batched_decode = decode_path == "batched" or (decode_path == "auto" and device.type == "cuda")
        self.stager: DecodeStager | None = None
        self.graphs: DecodeGraphRunner | None = None
        if self.batched_decode:
            max_len = max_model_len or cache_cfg.num_blocks * cache_cfg.block_size
            max_blocks = -(-max_len // cache_cfg.block_size)
            self.stager = DecodeStager(self.cache, cache_cfg.num_state_slots, max_blocks, device)
            self._prepare_decode = DecodeAttentionPlanner(cfg.text, self.stager.max_batch, dtype, device)
        logger.info("hybrid cache: %d blocks × %d tokens, %d state slots, %.1f MiB", cache_cfg.num_blocks,
                    cache_cfg.block_size, cache_cfg.num_state_slots, self.cache.nbytes() / 2**20)

    # ------------------------------------------------------------------ vision
    def _encode_items(self, items: list[tuple[torch.Tensor, torch.Tensor]], keys: list[str]) -> list[torch.Tensor]:
        """items: (pixels, grid [1, 3] flattened per attention span) and their content hashes →
        embeddings per item, one tower call."""
        if self.model.vision is None:
            raise ValueError("this checkpoint has no vision tower (no vision_config / visual.* weights); "
                             "send text only")
        out: list[torch.Tensor | None] = [None] * len(items)
        # The same image twice in one step (two requests, or one prompt repeating it) is encoded
        # once: later copies wait for the first and count as cache hits.
        first_of: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k not in first_of:
                first_of[k] = i
                out[i] = self.encoder_cache.get(k)
        todo = [i for k, i in first_of.items() if out[i] is None]
        if todo:
            self.encoder_cache.misses += len(todo)
            pixels = torch.cat([items[i][0] for i in todo]).to(self.device)
            grids = torch.cat([items[i][1] for i in todo]).to(self.device)
            emb = self.model.vision(pixels, grids)
            merge = self.cfg.vision.spatial_merge_size ** 2
            sizes = [int(items[i][1].prod(-1).sum()) // merge for i in todo]
            self.vision_calls += 1
            for i, e in zip(todo, emb.split(sizes)):
                self.encoder_cache.put(keys[i], e)
                out[i] = e
        for i, k in enumerate(keys):
            if out[i] is None:
                out[i] = out[first_of[k]]
                self.encoder_cache.hits += 1
        return out  # type: ignore[return-value]

    def encode_multimodal(self, seqs: list[Sequence]) -> None:
        """Fill ``seq.mm.embeds`` for every sequence in ``seqs`` that lacks them (one batched tower call)."""
        pending: list[tuple[MultiModalData, list[int]]] = []
        items: list[tuple[torch.Tensor, torch.Tensor]] = []
        keys: list[str] = []
        for seq in seqs:
            mm = seq.mm
            if mm is None or mm.embeds is not None:
                continue
            mine = media_items(mm)
            pending.append((mm, list(range(len(items), len(items) + len(mine)))))
            keys.extend(mm.item_hashes if mm.item_hashes is not None else [media_hash(p, g) for p, g in mine])
            items.extend(mine)
        if not items:
            return
        embs = self._encode_items(items, keys)
        for mm, idx in pending:
            parts_img = [embs[i] for i in idx[: 0 if mm.image_grid_thw is None else len(mm.image_grid_thw)]]
            parts_vid = [embs[i] for i in idx[len(parts_img):]]
            img = torch.cat(parts_img) if parts_img else None
            vid = torch.cat(parts_vid) if parts_vid else None
            positions, rows = [], []
            if img is not None:
                positions.append(mm.image_positions)
                rows.append(img)
            if vid is not None:
                positions.append(mm.video_positions)
                rows.append(vid)
            pos = torch.cat(positions)
            emb = torch.cat(rows)
            if pos.numel() != emb.shape[0]:
                raise ValueError(f"{pos.numel()} placeholder tokens but {emb.shape[0]} vision embeddings; "
                                 "the prompt's <|image|> count must match the media grids")
            order = torch.argsort(pos)
            mm.positions, mm.embeds = pos[order], emb[order]

    # ------------------------------------------------------------------ step
    def pack(self, sched: SchedulerOutput) -> tuple[PackedStep, list[tuple[int, int, int]]]:
        """The step as host data (vision embeddings computed first). Also returns, per sampling chunk,
        ``(chunk index, first logits row, rows)``: one row for a plain chunk, ``1 + drafts`` for a verification
        chunk."""
        ids, pos, chunks, logit_rows, sample_idx, prompt_lp = [], [], [], [], [], []
        mm_rows, mm_embeds = [], []
        start = 0
        self.encode_multimodal([c.seq for c in sched.chunks])
        for ci, c in enumerate(sched.chunks):
            s = c.seq
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + c.num_tokens
            if c.num_drafts:
                ids.extend(s.tokens(lo, lo + 1) + s.draft_tokens[: c.num_drafts])
            else:
                ids.extend(s.tokens(lo, hi))
            pos.extend(range(lo, hi))
            chunks.append(ChunkSpec(start=start, num_tokens=c.num_tokens, context_len=lo,
                                    block_table=list(s.block_table), state_slot=s.state_slot,
                                    record_states=c.num_drafts > 0))
            if s.mm is not None and s.mm.positions is not None:
                sel = (s.mm.positions >= lo) & (s.mm.positions < hi)
                if sel.any():
                    mm_rows.extend((s.mm.positions[sel] - lo + start).tolist())
                    mm_embeds.append(s.mm.embeds[sel])
            scored = prompt_rows(s, lo, hi)
            if scored is not None:
                prompt_lp.append((ci, len(logit_rows), scored[1] - scored[0], scored[0]))
                logit_rows.extend(range(start + scored[0] - lo, start + scored[1] - lo))
            if c.samples:
                n_rows = 1 + c.num_drafts
                sample_idx.append((ci, len(logit_rows), n_rows))
                logit_rows.extend(range(start + c.num_tokens - n_rows, start + c.num_tokens))
            start += c.num_tokens
        step = PackedStep(input_ids=ids, positions=pos, chunks=chunks, logits_rows=logit_rows,
                          mm_rows=mm_rows or None, mm_embeds=torch.cat(mm_embeds).cpu() if mm_embeds else None,
                          prompt_logprob_rows=prompt_lp)
        return step, sample_idx

    def batch_from(self, step: PackedStep, shared_pools: dict | None = None) -> ForwardBatch:
        """The :class:`ForwardBatch` of a packed step on this runner's device. Every integer list goes in one
        asynchronous copy (:func:`~glm5.layers.batch.host_to_device`) and is cut into views: one blocking
        ``torch.tensor(list, device=cuda)`` per list would wait for the GPU 4 + requests times per step."""
        dev = self.device
        parts = [step.input_ids, step.positions, step.logits_rows, step.mm_rows or [],
                 *(c.block_table for c in step.chunks)]
        flat = host_to_device([x for part in parts for x in part], dev, torch.long)
        ids, pos, logits_rows, mm_rows, *tables = flat.split([len(part) for part in parts])
        return ForwardBatch(
            input_ids=ids, positions=pos,
            seqs=[SeqChunk(start=c.start, num_tokens=c.num_tokens, context_len=c.context_len, block_table=table,
                           state_slot=c.state_slot, record_states=c.record_states)
                  for c, table in zip(step.chunks, tables)],
            logits_indices=logits_rows,
            mm_embeds=step.mm_embeds.to(dev) if step.mm_embeds is not None else None,
            mm_rows=mm_rows if step.mm_rows else None,
            shared_pools=shared_pools, prompt_logprob_rows=list(step.prompt_logprob_rows))

    def prepare(self, sched: SchedulerOutput) -> tuple[ForwardBatch, list[tuple[int, int, int]]]:
        """Pack the step into a device batch (see :meth:`pack`)."""
        step, sample_idx = self.pack(sched)
        return self.batch_from(step), sample_idx

    def forward_packed(self, step: PackedStep) -> tuple[ForwardBatch, ModelOutput]:
        batch = self.batch_from(step)
        return batch, self.model.forward(batch, self.cache)

    def execute(self, sched: SchedulerOutput, mtp_rows: bool = True
                ) -> tuple[ForwardBatch, ModelOutput, list[tuple[int, int, int]]]:
        """Run the step. ``mtp_rows``: a decode step lists each request's rows in ``batch.seqs`` for the MTP
        proposal (False where the MTP layer follows none of the step's requests: nothing reads them)."""
        rows = self._decode_rows(sched) if self.batched_decode else None
        if rows is not None:
            return self._execute_decode(sched, rows, mtp_rows)
        step, sample_idx = self.pack(sched)
        batch, out = self.forward_packed(step)
        return batch, out, sample_idx

    def reset_slot(self, slot: int) -> None:
        """Zero a state slot before a new request uses it."""
        self.cache.reset_slot(slot)

    #: the snapshot pool the prefix cache uses over :meth:`kv_cache_view` (a distributed runner's replicates)
    snapshot_pool_cls = StateSnapshotPool

    def kv_cache_view(self) -> HybridCache:
        """The cache the KV-cache manager mutates (slot resets, snapshot copies): this runner's own."""
        return self.cache

    # ------------------------------------------------------------------ batched decode / CUDA graphs
    def capture_cuda_graphs(self, max_batch: int | None = None) -> str | None:
        """Capture decode graphs; returns ``None`` on success or the reason graphs stay off."""
        from glm5.layers.backends import index_backend, moe_backend
        reason = None
        if self.device.type != "cuda":
            reason = "not on a CUDA device"
        elif not self.batched_decode:
            reason = "decode_path is per_request"
        elif moe_backend(self.device, self.dtype) != "triton" and any(
                k == "moe" for k in self.cfg.text.mlp_kinds):
            reason = "the torch MoE (per-expert loop) syncs with the host; use moe_backend=triton"
        elif index_backend(self.device, self.dtype) != "triton":
            reason = "index_backend is torch"
        elif self.par.config.expert_parallel and self.par.config.ep_dispatch == "all2all":
            reason = "ep_dispatch=all2all exchanges its send sizes on the host; use allgather_reducescatter"
        if reason is not None:
            logger.info("decode CUDA graphs off: %s", reason)
            return reason
        buckets = graph_buckets(min(max_batch or self.stager.max_batch, self.stager.max_batch))
        self.graphs = DecodeGraphRunner(self.model, self.cache, self.stager, buckets, prepare=self._prepare_decode)
        before = torch.cuda.memory_reserved(self.device)
        self.graphs.capture()
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        return None

    def _decode_rows(self, sched: SchedulerOutput) -> DecodeRows | None:
        """The step as decode rows, or ``None`` when some chunk is not a plain single-token step
        (prefill chunk, verification rows, a multimodal placeholder token)."""
        rows = DecodeRows([], [], [], [])
        for c in sched.chunks:
            s = c.seq
            lo = s.num_computed_tokens
            if c.num_tokens != 1 or c.num_drafts or prompt_rows(s, lo, lo + 1) is not None:
                return None
            if s.mm is not None and (s.mm.positions is None or bool((s.mm.positions == lo).any())):
                return None  # not encoded yet (prepare() encodes) or the row is a placeholder
            rows.tokens.append(s.tokens(lo, lo + 1)[0])
            rows.positions.append(lo)
            rows.state_slots.append(s.state_slot)
            rows.block_tables.append(s.block_table)
        return rows

    def forward_decode(self, rows: DecodeRows) -> tuple[ForwardBatch, ModelOutput]:
        """A pure decode step on the batched path: a captured graph when one fits, else staged and run eagerly."""
        n = len(rows)
        if self.graphs is not None and self.graphs.bucket_for(n) is not None:
            return self.graphs.run(rows)
        batch = self.stager.stage(rows, n, self._prepare_decode)
        return batch, self.model.forward(batch, self.cache)

    def _execute_decode(self, sched: SchedulerOutput, rows: DecodeRows, mtp_rows: bool = True
                        ) -> tuple[ForwardBatch, ModelOutput, list[tuple[int, int, int]]]:
        batch, out = self.forward_decode(rows)
        if self.mtp is not None and mtp_rows:  # the MTP proposal reads each request's rows from batch.seqs
            meta = batch.decode
            # block_table here: the request's row of the padded int32 decode buffer (valid for this step only)
            batch.seqs = [SeqChunk(start=i, num_tokens=1, context_len=p, block_table=meta.block_tables[i],
                                   state_slot=slot)
                          for i, (p, slot) in enumerate(zip(rows.positions, rows.state_slots))]
        sample_idx = [(ci, ci, 1) for ci, c in enumerate(sched.chunks) if c.samples]
        return batch, out, sample_idx

    # ------------------------------------------------------------------ measurements (every rank; bench/multigpu.py)
    #: methods a distributed driver may run on every rank through :meth:`call_all`
    RANK_CALLS = frozenset({"fill_cache_random", "memory_report", "profile_decode"})
    load_seconds = init_seconds = 0.0
    graph_bytes = 0

    def run_decode_step(self, rows: DecodeRows) -> tuple[ForwardBatch, ModelOutput]:
        """One pure decode step on the batched path (a graph replay when one fits), on every rank."""
        return self.forward_decode(rows)

    def run_packed(self, step: PackedStep) -> tuple[ForwardBatch, ModelOutput]:
        """One packed forward (prefill chunks, verification rows), on every rank."""
        return self.forward_packed(step)

    def call_all(self, name: str, *args) -> list:
        """``getattr(runner, name)(*args)`` on every rank; the results in rank order."""
        if name not in self.RANK_CALLS:
            raise ValueError(f"{name!r} is not a per-rank call; choose one of {sorted(self.RANK_CALLS)}")
        return [getattr(self, name)(*args)]

    def fill_cache_random(self, seed: int) -> None:
        """Random cache contents (a decode step's cost depends on the cache sizes, not the values)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for group, std in ((self.cache.latent, 1.0), (self.cache.pool_keys, 1.0), (self.cache.recurrent, 0.02),
                           (self.cache.conv, 1.0)):
            for t in group.values():
                if t.is_floating_point() and t.element_size() > 1:
                    t.normal_(0.0, std, generator=g)

    def memory_report(self) -> dict:
        """Bytes this rank holds: weights (the loaded shards), caches, decode graphs; CUDA allocator totals."""
        seen: set[int] = set()
        weights = 0
        for t in self.model.weights.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        out = {"rank": self.par.ranks.rank, "device": str(self.device), "weights": weights,
               "cache": self.cache.nbytes(), "graphs": self.graph_bytes, "load_s": self.load_seconds,
               "init_s": self.init_seconds}
        state = sum(t.numel() * t.element_size() for g in (self.cache.conv, self.cache.recurrent, self.cache.tail)
                    for t in g.values())
        out["state_slots"] = state
        if self.device.type == "cuda":
            out.update(cuda_allocated=torch.cuda.memory_allocated(self.device),
                       cuda_reserved=torch.cuda.memory_reserved(self.device),
                       cuda_max_allocated=torch.cuda.max_memory_allocated(self.device))
        return out

    def profile_decode(self, rows: DecodeRows) -> dict:
        """One eager batched decode step under the profiler: summed kernel (CUDA) or op (CPU) time and the part
        spent in collectives (NCCL kernels / gloo ops)."""
        batch = self.stager.stage(rows, len(rows), self._prepare_decode)
        self.model.forward(batch, self.cache)
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            batch = self.stager.stage(rows, len(rows), self._prepare_decode)
            self.model.forward(batch, self.cache)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        events = prof.key_averages()
        if self.device.type == "cuda":
            ev = [e for e in events if e.device_type.name == "CUDA"]
            total = sum(e.self_device_time_total for e in ev)
            comm = sum(e.self_device_time_total for e in ev if "nccl" in e.key.lower())
        else:
            total = sum(e.self_cpu_time_total for e in events)
            comm = sum(e.self_cpu_time_total for e in events if e.key.startswith(("gloo:", "c10d::", "record_param")))
        return {"rank": self.par.ranks.rank, "kernel_s": total / 1e6, "comm_s": comm / 1e6}

    # ------------------------------------------------------------------ expert-parallel load balancing
    def moe_layers(self) -> list[MoE]:
        layers = self.model.moe_layers()
        if self.mtp is not None and isinstance(self.mtp.mlp, MoE):
            layers.append(self.mtp.mlp)
        return layers

    def rebalance_experts(self) -> RebalanceReport:
        """One EPLB rebalance of every MoE layer (all ranks together; see :func:`glm5.layers.moe.rebalance_experts`)."""
        report = rebalance_experts(self.moe_layers(), self.par)
        logger.info("EPLB: %d/%d MoE layers re-placed, rank imbalance %.3f -> %.3f, %.1f MiB received",
                    report.moved_layers, report.layers, report.imbalance_before, report.imbalance_after,
                    report.bytes_received / 2**20)
        return report

    # ------------------------------------------------------------------ speculative decoding
    def commit_accepted(self, batch: ForwardBatch, state_slot: int, valid_rows: int) -> None:
        """Bring the KDA states and kpool tail of a verification chunk (per-request path) to ``valid_rows`` rows:
        the chunk left the recurrent state as before the step (see ``KDARecord``), so this runs even when every
        draft was accepted."""
        for (layer, slot), rec in batch.records.items():
            if slot != state_slot:
                continue
            if layer in self.cache.recurrent:
                rec.restore(self.cache.conv[layer][slot], self.cache.recurrent[layer][slot], valid_rows)
            else:
                rec.restore(self.cache.tail[layer][slot], valid_rows)

    @staticmethod
    def pack_mtp(entries: list[tuple[Sequence, int, list[int]]], want_logits: list[bool]) -> PackedStep:
        ids, pos, chunks, rows = [], [], [], []
        start = 0
        for (seq, lo, next_tokens), want in zip(entries, want_logits):
            n = len(next_tokens)
            ids.extend(next_tokens)
            pos.extend(range(lo, lo + n))
            chunks.append(ChunkSpec(start=start, num_tokens=n, context_len=lo, block_table=list(seq.block_table),
                                    state_slot=seq.state_slot))
            if want:
                rows.append(start + n - 1)
            start += n
        return PackedStep(input_ids=ids, positions=pos, chunks=chunks, logits_rows=rows)

    def mtp_forward_packed(self, step: PackedStep, hidden: torch.Tensor,
                           shared_pools: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp.forward(self.batch_from(step, shared_pools), hidden, self.cache)

    def mtp_forward(self, entries: list[tuple[Sequence, int, list[int]]], hidden: torch.Tensor,
                    want_logits: list[bool], shared_pools: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the MTP layer on rows ``(seq, first position, next tokens)``; ``hidden`` holds the matching
        target (or recycled) hidden rows in the same order. Returns (logits of the last row of every
        entry with ``want_logits``, recycled hidden of every row)."""
        return self.mtp_forward_packed(self.pack_mtp(entries, want_logits), hidden, shared_pools)

    def snapshot_mtp_tails(self, slots: list[int]) -> torch.Tensor:
        layer = self.mtp.layer
        return self.cache.tail[layer][slots].clone()

    def restore_mtp_tails(self, slots: list[int], snapshot: torch.Tensor) -> None:
        self.cache.tail[self.mtp.layer][slots] = snapshot
