"""The synchronous engine: add requests, step, read outputs.

``LLMEngine`` ties the pieces together — prompt processing (tokenizer, chat template, multimodal
placeholders; :mod:`glm5.engine.prompt_processor`), the scheduler, the model runner, the sampler and
per-request incremental detokenisation with stop handling. It is single-threaded by design;
:mod:`glm5.engine.async_engine` runs it on its own thread for the Triton backend and prepares prompts
on a worker pool (:meth:`LLMEngine.prepare` is the thread-safe part, :meth:`LLMEngine.add_prepared`
the engine-thread part).

Fault isolation: when a step raises, the caches of every request in it may be half-written (a layer
failed after others ran), so those requests are evicted (cache freed, recomputed from their tokens
later, as after a preemption) and re-run in halves until the failing request is alone; it gets a
final output with ``finish_reason="error"`` and the others continue with identical tokens. A device
failure (:func:`glm5.engine.errors.is_unrecoverable`) raises :class:`EngineDeadError` instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from glm5.cache.hybrid_cache import CacheConfig, check_block_size
from glm5.cache.memory import CacheMemoryPlan, plan_cache_memory
from glm5.cache.snapshot_pool import StateSnapshotPool
from glm5.config import ModelConfig
from glm5.engine.args import EngineArgs
from glm5.engine.errors import EngineDeadError, is_unrecoverable
from glm5.engine.faults import FaultInjection
from glm5.engine.kv_cache_manager import KVCacheManager, PrefixCacheConfig
from glm5.engine.media_items import describe_media
from glm5.engine.model_runner import ModelRunner
from glm5.engine.outputs import CompletionOutput, EngineStats, PromptInput, RequestOutput
from glm5.engine.prompt_logprobs import score as score_prompt_logprobs
from glm5.engine.prompt_processor import PreparedPrompt, PromptProcessor, PromptTooLongError
from glm5.engine.scheduler import Scheduler, SchedulerOutput
from glm5.engine.sequence import Sequence
from glm5.engine.spec_batched import MAX_BACKLOG, BatchedSpeculation, MTPBacklog, VerifyResult, drop_backlogs, \
    neutral_params, release_backlogs
from glm5.engine.spec_decode import SpecStats, greedy_verify, target_distributions
from glm5.engine.spec_sampling import SALT_DRAFT, accept_sampled, race
from glm5.engine.spec_policy import AdaptiveK, FixedK, SpecCostModel
from glm5.detokenizer import RequestOutputProcessor
from glm5.layers.batch import host_to_device
from glm5.sampler import Sampler, TokenLogprobs, bad_word_token_ids, make_generator
from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Share of ``cache_memory_gb`` given to the vision embedding cache unless ``encoder_cache_mb`` is set.
ENCODER_CACHE_SHARE = 0.05


class _NoTextTokenizer:
    """Stands in for a checkpoint without tokenizer files: token ids flow, text stays empty."""

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return ""


@dataclass
class _RequestState:
    seq: Sequence
    proc: RequestOutputProcessor
    prompt_text: str | None
    prompt_logprobs_sent: bool = False


class LLMEngine:
    def __init__(self, args: EngineArgs, weights: dict[str, torch.Tensor] | None = None):
        from glm5.weights import load_weights

        self.args = args
        self.device, self.dtype = args.torch_device, args.torch_dtype
        if self.device.type == "cuda" and self.device.index is not None:
            # streams, events and Triton launches follow the current device: make it the engine's (cuda:N
            # when Triton places the instance on another GPU; a bare "cuda" already means the current one)
            torch.cuda.set_device(self.device)
        self.model_config = ModelConfig.from_pretrained(args.model)
        text = self.model_config.text
        check_block_size(args.block_size, text.index_kpool)
        if weights is None and not args.uses_executor:
            quant = args.load_quantization
            if quant != args.quantization:
                logger.info("quantization=auto on %s: fp8 checkpoint weights are dequantized to %s at load (no fp8 "
                            "GEMM here; quantization=fp8 keeps fp8 storage and dequantizes per call)", self.device,
                            self.dtype)
            if args.load_format == "dummy":
                from glm5.weights import dummy_weights
                weights = dummy_weights(self.model_config, self.device, self.dtype,
                                        include_mtp=args.num_speculative_tokens > 0, fp8=quant == "fp8")
            else:
                weights = load_weights(args.model, self.model_config, device=self.device, dtype=self.dtype,
                                       progress=args.load_progress, allow_missing_mtp=args.num_speculative_tokens == 0,
                                       quantization=quant)
        elif weights is not None and args.uses_executor:
            raise ValueError("weights cannot be handed to a distributed engine (each rank loads its own shard from "
                             "args.model); drop the weights argument or run with tensor_parallel_size=1")
        self.tokenizer = self._load_tokenizer(args.model)
        use_mtp = args.num_speculative_tokens > 0
        mla_layers = list(text.mla_layer_ids) + (text.mtp_layer_ids[:1] if use_mtp else [])
        self.memory_plan = self._plan_memory(args, mla_layers)
        logger.info("%s", self.memory_plan.describe())
        cache_cfg = CacheConfig(block_size=args.block_size, num_blocks=self.memory_plan.num_blocks,
                                num_state_slots=args.max_num_seqs)
        # A request can never hold more tokens than the whole cache: cap the length there, so that a
        # too-long prompt is rejected at admission and generation ends with "length", instead of the
        # request waiting forever for blocks that cannot exist.
        capacity = cache_cfg.num_blocks * cache_cfg.block_size
        self.max_model_len = min(args.max_model_len, capacity)
        if self.max_model_len < args.max_model_len:
            logger.warning("max_model_len %d exceeds the cache (%d blocks x %d tokens): capped to %d",
                           args.max_model_len, cache_cfg.num_blocks, cache_cfg.block_size, self.max_model_len)
        k = args.num_speculative_tokens
        encoder_bytes = self.memory_plan.bytes_of("vision_encoder_cache")
        if args.uses_executor:  # one process per device; this one is rank 0 (glm5.engine.executor)
            from glm5.engine.executor import DistributedRunner
            if args.draft_vocab_size:
                raise ValueError(f"draft_vocab_size={args.draft_vocab_size} is not supported with tensor/expert "
                                 "parallelism; draft over the full vocabulary (draft_vocab_size=0)")
            self.runner = DistributedRunner.start(args, self.model_config, cache_cfg, self.max_model_len,
                                                  encoder_cache_bytes=encoder_bytes)
            self.device = self.runner.device
        else:
            self.runner = ModelRunner(self.model_config, weights, cache_cfg, self.device, self.dtype,
                                      use_mtp=use_mtp, index_fp8=args.index_cache == "fp8",
                                      max_model_len=self.max_model_len, decode_path=args.decode_path,
                                      encoder_cache_bytes=encoder_bytes, draft_vocab=self._draft_vocab(args))
        self._log_backends()
        self.sampler = Sampler(seed=args.seed)
        # speculative steps of pure-decode batches on the batched path (glm5.engine.spec_batched); it drives the
        # runner's model and cache directly, so a multi-device engine speculates on the per-request path
        spec_batch = min(args.speculative_max_batch, args.max_num_seqs)
        self.spec_stats = SpecStats(k) if k else None
        self.spec = BatchedSpeculation(self.runner, self.sampler, k, spec_batch, stats=self.spec_stats) \
            if k > 0 and self.runner.batched_decode and not args.uses_executor else None
        if self.device.type == "cuda" and not args.enforce_eager:
            graph_max = args.cuda_graph_max_batch or args.max_num_seqs
            self.runner.capture_cuda_graphs(graph_max)
            if self.spec is not None and self.runner.graphs is not None:
                self.spec.capture_cuda_graphs(graph_max, pool=self.runner.graphs.pool)
        self.k_policy = self._k_policy(args)
        self._k_next = k
        self._mtp_ran = False   # the last step ran the MTP layer (so it was no plain step)
        self._noise_seeds = torch.Generator().manual_seed(args.seed)
        # cache mutations go through the runner's view: a distributed runner replays them on every rank
        self.kv = KVCacheManager(self.runner.kv_cache_view(), cache_cfg.num_blocks, cache_cfg.num_state_slots,
                                 self._prefix_cache_config(args), pool_cls=self.runner.snapshot_pool_cls)
        self.blocks, self.slots = self.kv.blocks, self.kv.slots
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.batched_tokens_budget(self.device))
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        self.prompts = PromptProcessor(self.model_config, self.tokenizer, args.model, args.media_caps,
                                       self.max_model_len)
        self.faults = FaultInjection.from_dict(args.test_faults)
        if self.faults is not None:
            logger.warning("test_faults is set (%s): steps will fail on purpose; never use this in production",
                           self.faults)
        self.aborted_total = 0
        self.failed_total = 0
        self.finished_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ setup helpers
    def _log_backends(self) -> None:
        from glm5.layers import backends as b
        dev = self.device
        rank = self.model_config.text.kv_lora_rank
        logger.info("backends on %s %s: kda=%s prefill_attn=%s decode_attn=%s index=%s moe=%s mhc=%s router=%s "
                    "fuse=%s fp8_linear=%s sampling=%s decode_path=%s", dev, self.dtype, b.kda_backend(dev, self.dtype),
                    b.attn_backend(dev, self.dtype, rank), b.decode_attn_backend(dev, self.dtype, rank),
                    b.index_backend(dev, self.dtype), b.moe_backend(dev, self.dtype), b.mhc_backend(dev, self.dtype),
                    b.router_backend(dev, self.dtype), b.fuse_backend(dev, self.dtype),
                    b.fp8_linear_backend(dev, self.dtype), b.sampling_backend(dev),
                    "batched" if self.runner.batched_decode else "per_request")

    def _prefix_cache_config(self, args: EngineArgs) -> PrefixCacheConfig | None:
        """Prefix caching settings; the snapshot pool's size comes from the memory plan."""
        if not args.enable_prefix_caching:
            return None
        n = self.memory_plan.units_of("prefix_cache_snapshots")
        per = StateSnapshotPool.bytes_per_snapshot(self.runner.cache)
        logger.info("prefix caching on: %d state snapshots x %.2f MiB (%.2f GiB), checkpoint interval %s",
                    n, per / 2**20, n * per / 2**30,
                    f"{args.prefix_cache_checkpoint_interval} blocks" if args.prefix_cache_checkpoint_interval else "off")
        # lookahead: the MTP layer's cache row at p is computed from token p+1 (glm5.cache.prefix_keys);
        # junctions: a split that saves later requests less than a block is not worth its extra step
        return PrefixCacheConfig(num_snapshots=n, lookahead=1 if self.runner.mtp is not None else 0,
                                 checkpoint_interval=args.prefix_cache_checkpoint_interval,
                                 points=args.snapshot_points, min_junction_gain=args.block_size)

    def _draft_vocab(self, args: EngineArgs) -> torch.Tensor | None:
        if args.num_speculative_tokens == 0 or args.draft_vocab_size == 0:
            return None
        from glm5.engine.draft_vocab import load_draft_vocab
        return load_draft_vocab(args.draft_vocab_file or Path(args.model) / "draft_vocab.json", args.draft_vocab_size,
                                self.model_config.text.vocab_size)

    def _k_policy(self, args: EngineArgs):
        k = args.num_speculative_tokens
        if k == 0 or args.speculative_policy == "fixed":
            return FixedK(k)
        vocab = args.draft_vocab_size or None
        cost = SpecCostModel.load(args.speculative_cost_table, self.model_config, draft_vocab=vocab) \
            if args.speculative_cost_table else SpecCostModel(self.model_config, draft_vocab=vocab)
        return AdaptiveK(k, cost)

    @staticmethod
    def _load_tokenizer(path: str):
        p = Path(path)
        if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
            from glm5.tokenizer import load_tokenizer
            return load_tokenizer(p)
        logger.warning("no tokenizer in %s: only token-id prompts work and no text is produced", path)
        return None

    def _plan_memory(self, args: EngineArgs, mla_layers: list[int]) -> CacheMemoryPlan:
        """Every cache in ``cache_memory_gb`` (glm5.cache.memory); raises CacheBudgetError when it does not fit."""
        budget = int(args.cache_memory_gb * 2**30)
        encoder = (args.encoder_cache_mb * 2**20 if args.encoder_cache_mb is not None
                   else budget * ENCODER_CACHE_SHARE) if self.model_config.vision is not None else 0
        snap = args.prefix_cache_snapshot_memory_gb
        free = None
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        return plan_cache_memory(self.model_config.text, dtype=self.dtype, block_size=args.block_size,
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 budget_bytes=budget, mla_layers=mla_layers, index_fp8=args.index_cache == "fp8",
                                 encoder_cache_bytes=int(encoder), num_blocks=args.num_cache_blocks,
                                 device_free_bytes=free, prefix_caching=args.enable_prefix_caching,
                                 snapshot_budget_bytes=None if snap is None else int(snap * 2**30))

    @property
    def mm_processor(self):
        return self.prompts.mm_processor

    # ------------------------------------------------------------------ requests
    def prepare(self, prompt: PromptInput | str | list[int], params: SamplingParams | None = None
                ) -> tuple[PreparedPrompt, SamplingParams]:
        """Validate the sampling parameters and tokenize / decode / check the prompt.

        Thread-safe and free of engine state: the async engine calls it on its worker pool. Raises
        ValueError (incl. SamplingParamsError / MediaError) on bad input."""
        params = params or SamplingParams()
        params.validate(vocab_size=self.model_config.text.vocab_size)
        if params.num_sequences > 1:
            raise ValueError(f"n={params.n} / best_of={params.best_of}: the engine runs one sequence per request; "
                             "add one request per sequence with params.for_sequence(i)")
        if isinstance(prompt, str):
            prompt = PromptInput(text=prompt)
        elif isinstance(prompt, list):
            prompt = PromptInput(token_ids=prompt)
        return self.prompts.process(prompt), params

    def add_request(self, request_id: str, prompt: PromptInput | str | list[int],
                    params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ValueError (incl. SamplingParamsError/MediaError) on bad input."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        prepared, params = self.prepare(prompt, params)
        self.add_prepared(request_id, prepared, params)

    def add_prepared(self, request_id: str, prepared: PreparedPrompt, params: SamplingParams) -> None:
        """Queue a request whose prompt :meth:`prepare` made (engine thread)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        ids, mm, prompt_text = prepared.token_ids, prepared.mm, prepared.prompt_text
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if params.truncate_prompt_tokens is not None:
            if mm is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images or videos (their "
                                 "placeholder tokens would be lost); send the prompt without it")
            keep = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len} leaves no room to generate; "
                "shorten the prompt or raise max_model_len (and the cache: num_cache_blocks / cache_memory_gb)")
        if mm is not None and mm.item_hashes is None and self.model_config.vision is not None:
            describe_media(mm, self.model_config.vision.spatial_merge_size ** 2)  # prepared elsewhere than prepare()
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       eos_token_ids=self.eos_token_ids, arrival_order=next(self._order), mm=mm)
        if params.seed is not None:  # on the logits' device: a CPU generator would draw V floats per step on the host
            seq.generator = make_generator(params.seed, self.device)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the checkpoint's tokenizer; ban token ids with logit_bias instead")
            seq.bad_words_token_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        if self.spec_stats is not None:
            seq.spec_stats = SpecStats(self.args.num_speculative_tokens)
            # counter-based sampling streams of batched speculation: the request's seed, else one drawn
            # from the engine seed (reproducible runs), never from the batch
            seq.noise_seed = params.seed if params.seed is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self._noise_seeds))
        proc = RequestOutputProcessor(self.tokenizer or _NoTextTokenizer(), ids, params, self.eos_token_ids)
        self._requests[request_id] = _RequestState(seq=seq, proc=proc, prompt_text=prompt_text)
        self.prompt_tokens_total += len(ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its cache; its last output has finish_reason 'abort'."""
        st = self._requests.get(request_id)
        if st is None or st.seq.is_finished:
            return False
        self.scheduler.finish(st.seq, "abort")
        self.aborted_total += 1
        self._pending_outputs.append(self._output(st, [], "", True))
        del self._requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # ------------------------------------------------------------------ stepping
    def _output(self, st: _RequestState, new_ids: list[int], text: str, finished: bool,
                logprobs: list[dict] | None = None) -> RequestOutput:
        s = st.seq
        prompt_lps = None
        if s.params.prompt_logprobs is not None and not st.prompt_logprobs_sent:
            prompt_lps, st.prompt_logprobs_sent = list(s.prompt_logprobs), True
        return RequestOutput(request_id=s.request_id, text=text, token_ids=new_ids, finished=finished,
                             finish_reason=s.finish_reason if finished else None,
                             num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=len(s.output_token_ids),
                             logprobs=logprobs, prompt_text=st.prompt_text, metrics=s.metrics,
                             stop_reason=s.stop_reason, prompt_logprobs=prompt_lps,
                             num_cached_tokens=s.num_cached_tokens or 0)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the new outputs. A failing request is isolated and ends with
        ``finish_reason="error"``; an unrecoverable device error raises :class:`EngineDeadError`."""
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if sched.chunks:
            t0 = time.perf_counter()
            drafts = sum(c.num_drafts for c in sched.chunks)
            decode = sched.decode_only
            # the policy's clock (what speculation and its probes cost) runs on decode steps only: a prefill
            # step's time (first-call compilation included) says nothing about them
            self._mtp_ran = False
            if self._run_isolated(sched, outputs) and decode:
                idle = not drafts and not self._k_next   # nothing verified this step, nothing drafted for the next
                self.k_policy.observe_time(time.perf_counter() - t0, len(sched.chunks),
                                           plain=idle and not self._mtp_ran, mtp_only=idle and self._mtp_ran)
        return outputs

    def _run_isolated(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """Run a step; on failure evict its requests and bisect them (module docstring). True if it ran."""
        try:
            self._run_step(sched, outputs)
            return True
        except Exception as exc:  # noqa: BLE001 (classified below; nothing is swallowed)
            if is_unrecoverable(exc):
                raise EngineDeadError(f"unrecoverable device error in an engine step: {exc}") from exc
            self._isolate(self._evict(sched), exc, outputs)
            return False

    def _evict(self, sched: SchedulerOutput) -> list[Sequence]:
        """Free the caches of a failed step's unfinished requests and take them off the queues."""
        seqs = []
        for c in sched.chunks:
            seq = c.seq
            if seq.is_finished or seq.request_id not in self._requests:
                continue
            self.scheduler.evict(seq)
            seqs.append(seq)
        return sorted(seqs, key=lambda s: s.arrival_order)

    def _isolate(self, seqs: list[Sequence], exc: Exception, outputs: list[RequestOutput]) -> None:
        if not seqs:
            return
        if len(seqs) == 1:
            self._fail(seqs[0], exc, outputs)
            return
        logger.warning("an engine step of %d requests failed (%s: %s); re-running them in halves to find the "
                       "failing request", len(seqs), type(exc).__name__, exc)
        mid = len(seqs) // 2
        for part in (seqs[:mid], seqs[mid:]):
            self._trial(part, outputs)

    def _trial(self, part: list[Sequence], outputs: list[RequestOutput]) -> None:
        """Run ``part`` alone (everyone else stays queued, caches untouched) until each of its requests has
        caught up and sampled a token, finished, or failed; then put the queues back together."""
        sched = self.scheduler
        saved_running, saved_waiting = sched.running, sched.waiting
        sched.running, sched.waiting = [], deque(part)
        pending = {s.request_id for s in part}
        try:
            while pending:
                out = sched.schedule()
                if not out.chunks:
                    break
                sampling = {c.seq.request_id for c in out.chunks if c.samples}  # before the step advances them
                if self._run_isolated(out, outputs):
                    pending -= sampling
                else:
                    pending -= {c.seq.request_id for c in out.chunks}  # settled by the nested bisection
                pending &= set(self._requests)
        finally:
            sched.running = saved_running + sched.running
            sched.waiting = deque([*sched.waiting, *saved_waiting])

    def _fail(self, seq: Sequence, exc: Exception, outputs: list[RequestOutput]) -> None:
        st = self._requests.pop(seq.request_id)
        self.scheduler.finish(seq, "error")
        self.failed_total += 1
        logger.error("request %s failed in an engine step and was removed; the other requests go on (%s: %s)",
                     seq.request_id, type(exc).__name__, exc)
        out = self._output(st, [], "", True)
        out.error = f"{type(exc).__name__}: {exc}"
        outputs.append(out)

    def _run_step(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """Forward, sample, record tokens (appended to ``outputs`` as they are made), MTP proposals."""
        if self.faults is not None:
            self.faults.check(sched)
        # where the MTP layer follows none of the step's requests (speculation cannot pay: spec_batched), the
        # step is the plain engine's - no verification bookkeeping, no per-request rows for a proposal
        follows = self.runner.mtp is not None and not all(c.seq.mtp_off for c in sched.chunks)
        if follows and self.spec is not None and self.spec.accepts(sched):
            self._speculative_step(sched, outputs)
            return
        # a probe only on a decode step: the policy times those alone (step())
        self._k_next = self._choose_k(len(self.scheduler.running), may_probe=sched.decode_only)
        batch, model_out, sample_idx = self.runner.execute(sched, mtp_rows=follows)
        for ci, row, n, p0 in batch.prompt_logprob_rows:
            score_prompt_logprobs(sched.chunks[ci].seq, model_out.logits[row:row + n], p0)
        valid_rows: dict[int, int] = {}
        for ci, c in enumerate(sched.chunks):
            valid_rows[ci] = c.num_tokens - c.num_drafts
            c.seq.num_computed_tokens += valid_rows[ci]
        plain = [(ci, row) for ci, row, n in sample_idx if n == 1]
        new_tokens: dict[int, tuple[list[int], list[dict | None]]] = {}
        if plain:
            seqs = [sched.chunks[ci].seq for ci, _ in plain]
            logits, rows = model_out.logits, [row for _, row in plain]
            if rows != list(range(logits.shape[0])):   # a decode step samples every row in order: no gather
                logits = logits[host_to_device(rows, logits.device)]
            result = self.sampler.sample(
                logits, [s.params for s in seqs], generators=[s.generator for s in seqs],
                output_token_ids=[s.output_token_ids for s in seqs], prompt_token_ids=[s.prompt_token_ids for s in seqs],
                eos_token_ids=[s.eos_token_ids for s in seqs],
                bad_words_token_ids=[s.bad_words_token_ids for s in seqs])
            tokens = result.token_ids.tolist()
            for k, (ci, _) in enumerate(plain):
                new_tokens[ci] = ([tokens[k]], [TokenLogprobs.as_dict(result.logprobs[k])])
        for ci, row, n in sample_idx:
            if n > 1:
                new_tokens[ci] = (self._verify(sched.chunks[ci], batch, model_out.logits[row:row + n]), [])
                valid_rows[ci] += len(new_tokens[ci][0]) - 1
        now = time.time()
        finished: list[Sequence] = []
        trimmed: set[int] = set()
        for ci, c in enumerate(sched.chunks):
            c.seq.draft_tokens, c.seq.draft_probs = [], None
            if ci in new_tokens:
                toks, lps = new_tokens[ci]
                outputs.append(self._append_tokens(c.seq, toks, lps, now))
                if c.seq.is_finished:
                    finished.append(c.seq)
                    excess = self._trim_to_output(c.seq)
                    valid_rows[ci] -= excess
                    if excess:
                        trimmed.add(id(c.seq))
        self._finish_step(sched, finished, trimmed, lambda: follows and self._propose(
            sched, batch, model_out.hidden, valid_rows, {ci for ci, _, _ in sample_idx}))

    def _finish_step(self, sched: SchedulerOutput, finished: list[Sequence], trimmed: set[int], propose) -> None:
        """After the step's tokens are recorded: MTP proposals (``propose``), then — the step's rows being
        final — share its full blocks, take planned snapshots and release what finished, with a snapshot at
        its end (the next chat turn starts there) unless its states hold rows past its output (``trimmed``)."""
        complete = False
        try:
            self._mtp_ran = bool(propose())
            for c in sched.chunks:
                self.kv.after_step(c.seq)
            complete = True
        finally:  # a failed step still frees what finished, but leaves no snapshot of a half-updated state
            for seq in finished:
                self.scheduler.release_finished(seq, snapshot=complete and id(seq) not in trimmed)

    def _trim_to_output(self, seq: Sequence) -> int:
        """Rows a finished request computed past the output it keeps (a stop token or stop string inside
        accepted drafts): its computed count is cut back to the kept tokens, so only their blocks are
        shared, and the caller skips its end-of-request snapshot (its KDA states already include the extra
        rows; the accepted-row commit cannot be undone). Returns the rows dropped."""
        excess = seq.num_computed_tokens - (seq.num_tokens - 1)
        if excess <= 0 or not self.kv.enabled:
            return 0
        seq.num_computed_tokens -= excess
        return excess

    # ------------------------------------------------------------------ speculative decoding
    def _choose_k(self, batch: int, may_probe: bool = True) -> int:
        """The next step's drafts: none above the batched speculation's request cap (those steps decode on
        the plain batched path and the MTP layer waits), else the policy's; no probe where the MTP layer
        follows no running request (nobody could draft for it)."""
        if self.spec is not None and batch > self.spec.max_requests:
            return 0
        may_probe = may_probe and not all(s.mtp_off for s in self.scheduler.running)
        return self.k_policy.choose(batch, may_probe=may_probe)

    def _mtp_history(self, batch: int) -> tuple[bool, bool]:
        """``(keep, hold)`` for the MTP layer's history at ``batch`` requests when nobody drafts
        (glm5.engine.spec_batched). ``keep``: a full backlog is caught up rather than dropped - the policy's
        ``keeps_mtp`` (adaptive: some ``k > 0`` could beat ``k = 0`` at the optimistic acceptance, and its
        exploration credit pays for the drain). ``hold``: decode rows wait in backlogs at all - the policy's
        ``holds_mtp``; where not, the MTP layer stops following the requests at once (a backlog that would only
        be dropped when full is not carried). Above the batched speculation's cap, rows wait for the batch to
        shrink and a full backlog is dropped."""
        if self.spec is not None and batch > self.spec.max_requests:
            return False, True
        return self.k_policy.keeps_mtp(batch), self.k_policy.holds_mtp(batch)

    def _speculative_step(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """A pure-decode step on the batched path: verify, accept and commit on the device, then draft."""
        res: VerifyResult = self.spec.verify(sched)
        now = time.time()
        observed, live, finished, trimmed = [], [], [], set()
        for i, c in enumerate(sched.chunks):
            seq = c.seq
            seq.num_computed_tokens += 1 + res.accepted[i]
            if res.drafts[i]:
                self.spec_stats.record(res.drafts[i], res.accepted[i])
                seq.spec_stats.record(res.drafts[i], res.accepted[i])
                observed.append((res.drafts[i], res.accepted[i]))
            seq.draft_tokens, seq.draft_probs = [], None
            outputs.append(self._append_tokens(seq, res.tokens[i], res.logprobs[i], now))
            if seq.is_finished:
                finished.append(seq)
                if self._trim_to_output(seq):
                    trimmed.add(id(seq))
            else:
                live.append((i, seq))
        self.k_policy.observe_step(observed)
        self._k_next = self._choose_k(len(live))

        def propose() -> bool:
            keep, hold = self._mtp_history(len(live))
            return self.spec.propose([(i, s, self._num_drafts(s)) for i, s in live], res,
                                     self.scheduler.ensure_blocks, keep_mtp=keep, hold_mtp=hold)
        self._finish_step(sched, finished, trimmed, lambda: bool(live) and propose())

    def _verify(self, chunk, batch, logits: torch.Tensor) -> list[int]:
        """Accept drafts of a verification chunk (per-request path) and commit its states to the accepted rows."""
        seq = chunk.seq
        drafts = seq.draft_tokens[: chunk.num_drafts]
        probs = target_distributions(self.sampler, logits, seq.params, seq.output_token_ids, seq.prompt_token_ids,
                                     drafts, seq.eos_token_ids, seq.bad_words_token_ids)
        if seq.params.is_greedy:
            tokens = greedy_verify(probs, drafts)
        else:  # the batched path's sampler on one request: same counter streams, so either path gives its tokens
            dev = probs.device
            emitted, acc = accept_sampled(probs[None], seq.draft_probs[None, : len(drafts)].to(dev),
                                          torch.tensor([drafts], device=dev), torch.tensor([len(drafts)], device=dev),
                                          torch.tensor([seq.noise_seed], device=dev),
                                          torch.tensor([seq.num_computed_tokens - 1], device=dev))
            tokens = emitted[0, : int(acc[0]) + 1].tolist()
        accepted = len(tokens) - 1
        self.runner.commit_accepted(batch, seq.state_slot, 1 + accepted)
        seq.num_computed_tokens += accepted
        self.k_policy.observe_step([(len(drafts), accepted)])
        self.spec_stats.record(len(drafts), accepted)
        seq.spec_stats.record(len(drafts), accepted)
        return tokens

    def _num_drafts(self, seq: Sequence) -> int:
        if not self._k_next or seq.mtp_off:  # no speculation this step (the common step where it does not
            return 0                           # pay), or the MTP layer no longer follows the request
        p = seq.params
        if p.logprobs is not None:  # logprobs come from the sampling path only, not from verified drafts
            return 0
        room = min(p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        return max(0, min(self._k_next, room - 1))

    def _draft_from(self, seq: Sequence, logits: torch.Tensor) -> int:
        """One draft from MTP logits, as the batched path drafts (glm5.engine.spec_batched): argmax, or the
        request's counter stream over the temperature/top-k/top-p distribution (no penalties: any draft
        distribution keeps verification exact), which is kept for the rejection test."""
        if seq.params.is_greedy:
            token = int(torch.argmax(logits))
        else:
            x = self.sampler.process_logits(logits[None], [neutral_params(seq.params)], output_token_ids=[[]])
            probs = torch.softmax(x, dim=-1)[0]
            pos = torch.tensor([seq.num_tokens + len(seq.draft_tokens)], device=probs.device)
            token = int(race(probs[None], torch.tensor([seq.noise_seed], device=probs.device), pos, SALT_DRAFT)[0])
            seq.draft_probs = probs[None] if seq.draft_probs is None else torch.cat([seq.draft_probs, probs[None]])
        seq.draft_tokens.append(token)
        return token

    def _propose(self, sched, batch, hidden: torch.Tensor, valid_rows: dict[int, int], sampled: set[int]) -> bool:
        """MTP catch-up over this step's accepted rows, then draft steps for requests that will decode. True
        when the MTP layer ran."""
        entries, rows, want, step_rows = [], [], [], []
        for ci, c in enumerate(sched.chunks):
            seq, v = c.seq, valid_rows[ci]
            # a finished request's rows are caught up only for its end-of-request snapshot (prefix caching)
            if seq.state_slot is None or (seq.is_finished and not self.kv.enabled) or seq.mtp_off:
                continue
            step_rows.append(v)
            lo = seq.num_computed_tokens - v
            start = batch.seqs[ci].start
            own = hidden[start:start + v]
            if seq.mtp_backlog is not None:  # rows batched steps held back (glm5.engine.spec_batched)
                [(lo, own)] = release_backlogs([seq], [own])
                v = own.shape[0]
            entries.append((seq, lo, seq.tokens(lo + 1, lo + v + 1)))
            rows.append(own)
            want.append(ci in sampled and not seq.is_finished and self._num_drafts(seq) > 0)
        if not any(want):  # nobody drafts next step: decode rows can wait for the MTP layer (prompt chunks do not)
            # a finished request is caught up now: its end-of-request snapshot holds the MTP layer's rows too
            # a full backlog of a decoding request is caught up, or dropped where speculation cannot pay; where
            # it would only be dropped, a decoding request's rows are not held back at all (spec_batched)
            pays, hold = self._mtp_history(len(self.scheduler.running))
            keep, drop = [], []
            for i, (r, v) in enumerate(zip(rows, step_rows)):
                seq, lo, _ = entries[i]
                if v > 1 or seq.is_finished or (r.shape[0] >= MAX_BACKLOG and pays):
                    keep.append(i)
                elif r.shape[0] >= MAX_BACKLOG or not hold:
                    drop.append(seq)
                else:  # graph outputs are overwritten by the next replay: the backlog keeps a copy
                    seq.mtp_backlog = MTPBacklog(lo, [r.clone()])
            drop_backlogs(drop, self.spec_stats)
            entries, rows, want = [entries[i] for i in keep], [rows[i] for i in keep], [want[i] for i in keep]
        if not entries:
            return False
        shared = {} if self.model_config.text.index_share_for_mtp_iteration else None
        logits, h = self.runner.mtp_forward(entries, torch.cat(rows), want, shared)
        drafting, last_rows, offset = [], [], 0
        for (seq, lo, nxt), w in zip(entries, want):
            offset += len(nxt)
            if w:
                self._draft_from(seq, logits[len(drafting)])
                drafting.append(seq)
                last_rows.append(offset - 1)
        if not drafting:
            return True
        hid = h[host_to_device(last_rows, h.device)]
        slots = [s.state_slot for s in drafting]
        snapshot = self.runner.snapshot_mtp_tails(slots)
        for j in range(1, max(self._num_drafts(s) for s in drafting)):
            step = [(i, s) for i, s in enumerate(drafting)
                    if len(s.draft_tokens) == j and j < self._num_drafts(s)
                    and self.scheduler.ensure_blocks(s, s.num_tokens + j - 1)]
            if not step:
                break
            ents = [(s, s.num_tokens - 2 + j, [s.draft_tokens[-1]]) for _, s in step]
            idx = host_to_device([i for i, _ in step], hid.device)
            logits, h = self.runner.mtp_forward(ents, hid[idx], [True] * len(ents), shared)
            for r, (i, s) in enumerate(step):
                self._draft_from(s, logits[r])
                hid[i] = h[r]
        self.runner.restore_mtp_tails(slots, snapshot)
        return True

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[dict | None],
                       now: float) -> RequestOutput:
        """Record newly accepted tokens (one, or several after speculative verification) and finish
        the request on EOS / stop token / stop string / max_tokens / max_model_len."""
        st = self._requests[seq.request_id]
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_latencies.append(now - (m.last_token_time or now))
        m.last_token_time = now
        room = self.max_model_len - seq.num_tokens
        step = st.proc.add_tokens(tokens[:max(room, 0)])
        accepted = tokens[: step.num_accepted]
        seq.output_token_ids.extend(accepted)
        self.generation_tokens_total += len(accepted)
        reason = step.finish_reason.value if step.finish_reason is not None else None
        text = step.text
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
            text += st.proc.detok.flush() + st.proc.stops.flush()
        finished = reason is not None
        lps = [lp for lp in logprobs[: len(accepted)] if lp is not None]
        seq.logprobs.extend(lps)
        if finished:
            seq.stop_reason = step.stop_reason
            self.scheduler.finish(seq, reason, release=False)  # released at the end of the step
            self.finished_total += 1
            del self._requests[seq.request_id]
        return self._output(st, accepted, text, finished, lps or None)

    def fatal_error(self) -> BaseException | None:
        """An unrecoverable failure the engine already knows of between steps (a distributed engine's worker
        that exited), so that an idle server stops serving at once instead of at its next request."""
        return getattr(self.runner, "failure", None)

    def shutdown(self) -> None:
        """Release what the engine holds outside this process: the distributed executor's workers and process
        group (a single-device engine holds nothing; idempotent)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # ------------------------------------------------------------------ stats and offline API
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preempted_total=self.scheduler.num_preemptions, aborted_total=self.aborted_total,
            finished_total=self.finished_total, failed_total=self.failed_total,
            cache_usage=self.blocks.num_used / self.blocks.num_blocks,
            free_state_slots=self.slots.num_free, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            encoder_cache_hits=self.runner.encoder_cache.hits, vision_calls=self.runner.vision_calls,
            prefix_cache_queries=self.kv.queries, prefix_cache_hits=self.kv.hits,
            speculative=self.spec_stats.to_dict() if self.spec_stats is not None else None)

    def generate(self, prompts: list[PromptInput | str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts to completion together (continuous batching) and return them in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._order)}" for _ in prompts]
        results: dict[str, CompletionOutput] = {}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            st = self._requests[rid]
            results[rid] = CompletionOutput(request_id=rid, prompt_token_ids=list(st.seq.prompt_token_ids),
                                            token_ids=[], text="", finish_reason=None,
                                            logprobs=[] if p.logprobs is not None else None)
        while self.has_unfinished():
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                r.token_ids.extend(out.token_ids)
                r.text += out.text
                if out.logprobs and r.logprobs is not None:
                    r.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    r.finish_reason, r.metrics, r.error = out.finish_reason, out.metrics, out.error
                    r.stop_reason, r.num_cached_tokens = out.stop_reason, out.num_cached_tokens
        return [results[r] for r in ids]
