"""The synchronous engine: add requests, step, read outputs.

``LLMEngine`` ties the pieces together — prompt processing (tokenizer, chat template, multimodal
placeholders), the scheduler, the model runner, the sampler and per-request incremental
detokenisation with stop handling. It is single-threaded by design; :mod:`glm5.engine.async_engine`
runs it on its own thread for the Triton backend.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from glm5.cache.allocator import BlockAllocator, SlotAllocator
from glm5.cache.hybrid_cache import CacheConfig, check_block_size
from glm5.config import ModelConfig
from glm5.engine.args import EngineArgs
from glm5.engine.model_runner import ModelRunner
from glm5.engine.outputs import CompletionOutput, EngineStats, PromptInput, RequestOutput
from glm5.engine.prompt_logprobs import score as score_prompt_logprobs
from glm5.engine.scheduler import Scheduler
from glm5.engine.sequence import MultiModalData, Sequence
from glm5.engine.spec_decode import SpecStats, draw, greedy_verify, rejection_sample, target_distributions
from glm5.detokenizer import RequestOutputProcessor
from glm5.sampler import Sampler, TokenLogprobs, bad_word_token_ids, make_generator
from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


def _logprob_dict(lp: TokenLogprobs | None) -> dict | None:
    if lp is None:
        return None
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


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
            if args.load_format == "dummy":
                from glm5.weights import dummy_weights
                weights = dummy_weights(self.model_config, self.device, self.dtype,
                                        include_mtp=args.num_speculative_tokens > 0,
                                        fp8=getattr(args, "quantization", None) == "fp8")
            else:
                weights = load_weights(args.model, self.model_config, device=self.device, dtype=self.dtype,
                                       progress=args.load_progress, allow_missing_mtp=args.num_speculative_tokens == 0)
        elif weights is not None and args.uses_executor:
            raise ValueError("weights cannot be handed to a distributed engine (each rank loads its own shard from "
                             "args.model); drop the weights argument or run with tensor_parallel_size=1")
        self.tokenizer = self._load_tokenizer(args.model)
        cache_cfg = CacheConfig(block_size=args.block_size, num_blocks=self._num_blocks(args),
                                num_state_slots=args.max_num_seqs)
        # A request can never hold more tokens than the whole cache: cap the length there, so that a
        # too-long prompt is rejected at admission and generation ends with "length", instead of the
        # request waiting forever for blocks that cannot exist.
        capacity = cache_cfg.num_blocks * cache_cfg.block_size
        self.max_model_len = min(args.max_model_len, capacity)
        if self.max_model_len < args.max_model_len:
            logger.warning("max_model_len %d exceeds the cache (%d blocks x %d tokens): capped to %d",
                           args.max_model_len, cache_cfg.num_blocks, cache_cfg.block_size, self.max_model_len)
        if args.uses_executor:  # one process per device; this one is rank 0 (glm5.engine.executor)
            from glm5.engine.executor import DistributedRunner
            self.runner = DistributedRunner.start(args, self.model_config, cache_cfg, self.max_model_len)
            self.device = self.runner.device
        else:
            self.runner = ModelRunner(self.model_config, weights, cache_cfg, self.device, self.dtype,
                                      use_mtp=args.num_speculative_tokens > 0, index_fp8=args.index_cache == "fp8",
                                      max_model_len=self.max_model_len, decode_path=args.decode_path)
        self._log_backends()
        if self.device.type == "cuda" and not args.enforce_eager:
            self.runner.capture_cuda_graphs(args.cuda_graph_max_batch or args.max_num_seqs)
        self.spec_stats = SpecStats(args.num_speculative_tokens) if args.num_speculative_tokens else None
        self.blocks = BlockAllocator(cache_cfg.num_blocks)
        self.slots = SlotAllocator(cache_cfg.num_state_slots)
        self.scheduler = Scheduler(self.blocks, self.slots, args.block_size, args.max_num_seqs,
                                   args.max_num_batched_tokens, on_slot_allocated=self.runner.reset_slot)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        self._mm_processor = None
        self.aborted_total = 0
        self.finished_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.sampler = Sampler(seed=args.seed)

    # ------------------------------------------------------------------ setup helpers
    def _log_backends(self) -> None:
        from glm5.layers import backends as b
        dev = self.device
        logger.info("backends on %s %s: kda=%s prefill_attn=%s decode_attn=%s index=%s moe=%s mhc=%s sampling=%s "
                    "decode_path=%s", dev, self.dtype, b.kda_backend(dev, self.dtype), b.attn_backend(dev),
                    b.decode_attn_backend(dev, self.dtype, self.model_config.text.kv_lora_rank),
                    b.index_backend(dev, self.dtype), b.moe_backend(dev, self.dtype), b.mhc_backend(dev, self.dtype),
                    b.sampling_backend(dev), "batched" if self.runner.batched_decode else "per_request")

    @staticmethod
    def _load_tokenizer(path: str):
        p = Path(path)
        if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
            from glm5.tokenizer import load_tokenizer
            return load_tokenizer(p)
        logger.warning("no tokenizer in %s: only token-id prompts work and no text is produced", path)
        return None

    def _num_blocks(self, args: EngineArgs) -> int:
        if args.num_cache_blocks is not None:
            return args.num_cache_blocks
        t = self.model_config.text
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = len(t.mla_layer_ids) * elem * args.block_size * (
            t.kv_lora_rank + t.index_head_dim / t.index_kpool)
        n = int(args.cache_memory_gb * 2**30 // max(per_block, 1))
        needed = -(-args.max_model_len // args.block_size)
        return max(n, needed)

    @property
    def mm_processor(self):
        if self._mm_processor is None:
            from glm5.multimodal import MediaCaps, MultiModalProcessor
            caps = MediaCaps.from_dict(self.args.media_caps) if self.args.media_caps else None
            self._mm_processor = MultiModalProcessor.from_checkpoint(self.args.model, caps=caps,
                                                                     tokenizer=self.tokenizer)
        return self._mm_processor

    # ------------------------------------------------------------------ requests
    def _process_prompt(self, prompt: PromptInput) -> tuple[list[int], MultiModalData | None, str | None]:
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if prompt.mm_inputs is not None:
            return self._from_preprocessed(prompt.mm_inputs)
        if sum(given) != 1:
            raise ValueError("a prompt needs exactly one of text, token_ids or messages")
        if prompt.token_ids is not None:
            if prompt.images or prompt.videos:
                raise ValueError("images/videos need a text or chat prompt (placeholders are expanded from text)")
            ids = [int(t) for t in prompt.token_ids]
            vocab = self.model_config.text.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return ids, None, None
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: send prompt token ids")
        if prompt.messages is not None:
            from glm5.tokenizer import render_chat
            text = render_chat(self.tokenizer, prompt.messages)
        else:
            text = prompt.text
        if prompt.images or prompt.videos:
            processed = self.mm_processor.process(text, images=prompt.images, videos=prompt.videos)
            return (*self._from_processed(processed), text)
        return self.tokenizer.encode(text, add_special_tokens=False), None, text

    def _placeholder_positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.model_config
        is_img = ids == c.image_token_id
        in_video = torch.cumsum((ids == c.video_start_token_id).long(), 0) > torch.cumsum(
            (ids == c.video_end_token_id).long(), 0)
        return (is_img & ~in_video).nonzero().squeeze(1), (is_img & in_video).nonzero().squeeze(1)

    def _mm_from_tensors(self, ids: list[int], pv, igrid, pvv, vgrid) -> MultiModalData | None:
        def t(x, dtype):
            if x is None or (hasattr(x, "shape") and x.shape[0] == 0):
                return None
            return torch.as_tensor(x).to(dtype)
        pv, pvv = t(pv, torch.float32), t(pvv, torch.float32)
        if pv is None and pvv is None:
            return None
        img_pos, vid_pos = self._placeholder_positions(torch.tensor(ids))
        return MultiModalData(pixel_values=pv, image_grid_thw=None if pv is None else t(igrid, torch.long),
                              pixel_values_videos=pvv, video_grid_thw=None if pvv is None else t(vgrid, torch.long),
                              image_positions=img_pos, video_positions=vid_pos)

    def _from_processed(self, p) -> tuple[list[int], MultiModalData | None]:
        ids = [int(x) for x in p.token_ids]
        return ids, self._mm_from_tensors(ids, p.pixel_values, p.image_grid_thw, p.pixel_values_videos,
                                          p.video_grid_thw)

    def _from_preprocessed(self, d: dict) -> tuple[list[int], MultiModalData | None, str | None]:
        if "input_ids" not in d:
            raise ValueError("preprocessed inputs need 'input_ids'")
        ids = [int(x) for x in torch.as_tensor(d["input_ids"]).flatten().tolist()]
        mm = self._mm_from_tensors(ids, d.get("pixel_values"), d.get("image_grid_thw"),
                                   d.get("pixel_values_videos"), d.get("video_grid_thw"))
        return ids, mm, d.get("prompt_text")

    def add_request(self, request_id: str, prompt: PromptInput | str | list[int],
                    params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ValueError (incl. SamplingParamsError/MediaError) on bad input."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        params = params or SamplingParams()
        params.validate(vocab_size=self.model_config.text.vocab_size)
        if params.num_sequences > 1:
            raise ValueError(f"n={params.n} / best_of={params.best_of}: the engine runs one sequence per request; "
                             "add one request per sequence with params.for_sequence(i)")
        if isinstance(prompt, str):
            prompt = PromptInput(text=prompt)
        elif isinstance(prompt, list):
            prompt = PromptInput(token_ids=prompt)
        processed = self._process_prompt(prompt)
        ids, mm, prompt_text = processed if len(processed) == 3 else (*processed, None)
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if params.truncate_prompt_tokens is not None:
            if mm is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images or videos (their "
                                 "placeholder tokens would be lost); send the prompt without it")
            keep = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len} leaves no room "
                             "to generate; shorten the prompt or raise max_model_len (and the cache: num_cache_blocks "
                             "/ cache_memory_gb)")
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       eos_token_ids=self.eos_token_ids, arrival_order=next(self._order), mm=mm)
        if params.seed is not None:
            seq.generator = make_generator(params.seed)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the checkpoint's tokenizer; ban token ids with logit_bias instead")
            seq.bad_words_token_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        if self.spec_stats is not None:
            seq.spec_stats = SpecStats(self.args.num_speculative_tokens)
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
                             stop_reason=s.stop_reason, prompt_logprobs=prompt_lps)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return outputs
        batch, model_out, sample_idx = self.runner.execute(sched)
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
            rows = torch.tensor([row for _, row in plain], device=model_out.logits.device)
            result = self.sampler.sample(
                model_out.logits[rows], [s.params for s in seqs], generators=[s.generator for s in seqs],
                output_token_ids=[s.output_token_ids for s in seqs], prompt_token_ids=[s.prompt_token_ids for s in seqs],
                eos_token_ids=[s.eos_token_ids for s in seqs],
                bad_words_token_ids=[s.bad_words_token_ids for s in seqs])
            tokens = result.token_ids.tolist()
            for k, (ci, _) in enumerate(plain):
                new_tokens[ci] = ([tokens[k]], [_logprob_dict(result.logprobs[k])])
        for ci, row, n in sample_idx:
            if n > 1:
                new_tokens[ci] = (self._verify(sched.chunks[ci], batch, model_out.logits[row:row + n]), [])
                valid_rows[ci] += len(new_tokens[ci][0]) - 1
        now = time.time()
        for ci, c in enumerate(sched.chunks):
            c.seq.draft_tokens, c.seq.draft_probs = [], None
            if ci in new_tokens:
                toks, lps = new_tokens[ci]
                outputs.append(self._append_tokens(c.seq, toks, lps, now))
        if self.runner.mtp is not None:
            self._propose(sched, batch, model_out.hidden, valid_rows, {ci for ci, _, _ in sample_idx})
        return outputs

    # ------------------------------------------------------------------ speculative decoding
    def _generator(self, seq: Sequence) -> torch.Generator:
        return seq.generator if seq.generator is not None else self.sampler.shared_generator(self.device)

    def _verify(self, chunk, batch, logits: torch.Tensor) -> list[int]:
        """Accept drafts of a verification chunk; roll its states back to the last accepted row."""
        seq = chunk.seq
        drafts = seq.draft_tokens[: chunk.num_drafts]
        probs = target_distributions(self.sampler, logits, seq.params, seq.output_token_ids, seq.prompt_token_ids,
                                     drafts, seq.eos_token_ids)
        if seq.params.is_greedy:
            tokens = greedy_verify(probs, drafts)
        else:
            tokens = rejection_sample(probs, seq.draft_probs[: len(drafts)], drafts, self._generator(seq))
        accepted = len(tokens) - 1
        if accepted < len(drafts):
            self.runner.rollback(batch, seq.state_slot, 1 + accepted)
        seq.num_computed_tokens += accepted
        self.spec_stats.record(len(drafts), accepted)
        seq.spec_stats.record(len(drafts), accepted)
        return tokens

    def _num_drafts(self, seq: Sequence) -> int:
        p = seq.params
        if p.logprobs is not None or p.bad_words:  # logprobs / bad words are applied on the sampling path
            return 0                                  # only, not to verified drafts: no speculation
        room = min(p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        return max(0, min(self.args.num_speculative_tokens, room - 1))

    def _draft_from(self, seq: Sequence, logits: torch.Tensor) -> int:
        probs = target_distributions(self.sampler, logits[None], seq.params, seq.output_token_ids + seq.draft_tokens,
                                     seq.prompt_token_ids, [], seq.eos_token_ids)[0]
        if seq.params.is_greedy:
            token = int(torch.argmax(probs))
        else:
            token = draw(probs, self._generator(seq))
            seq.draft_probs = probs[None] if seq.draft_probs is None else torch.cat([seq.draft_probs, probs[None]])
        seq.draft_tokens.append(token)
        return token

    def _propose(self, sched, batch, hidden: torch.Tensor, valid_rows: dict[int, int], sampled: set[int]) -> None:
        """MTP catch-up over this step's accepted rows, then draft steps for requests that will decode."""
        entries, rows, want = [], [], []
        for ci, c in enumerate(sched.chunks):
            seq, v = c.seq, valid_rows[ci]
            if seq.is_finished or seq.state_slot is None:
                continue
            lo = seq.num_computed_tokens - v
            entries.append((seq, lo, seq.tokens(lo + 1, lo + v + 1)))
            start = batch.seqs[ci].start
            rows.append(hidden[start:start + v])
            want.append(ci in sampled and self._num_drafts(seq) > 0)
        if not entries:
            return
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
            return
        hid = h[torch.tensor(last_rows, device=h.device)]
        slots = [s.state_slot for s in drafting]
        snapshot = self.runner.snapshot_mtp_tails(slots)
        for j in range(1, max(self._num_drafts(s) for s in drafting)):
            step = [(i, s) for i, s in enumerate(drafting)
                    if len(s.draft_tokens) == j and j < self._num_drafts(s)
                    and self.scheduler.ensure_blocks(s, s.num_tokens + j - 1)]
            if not step:
                break
            ents = [(s, s.num_tokens - 2 + j, [s.draft_tokens[-1]]) for _, s in step]
            idx = torch.tensor([i for i, _ in step], device=hid.device)
            logits, h = self.runner.mtp_forward(ents, hid[idx], [True] * len(ents), shared)
            for r, (i, s) in enumerate(step):
                self._draft_from(s, logits[r])
                hid[i] = h[r]
        self.runner.restore_mtp_tails(slots, snapshot)

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
            self.scheduler.finish(seq, reason)
            self.finished_total += 1
            del self._requests[seq.request_id]
        return self._output(st, accepted, text, finished, lps or None)

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
            finished_total=self.finished_total, cache_usage=self.blocks.num_used / self.blocks.num_blocks,
            free_state_slots=self.slots.num_free, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            encoder_cache_hits=self.runner.encoder_cache.hits, vision_calls=self.runner.vision_calls,
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
                    r.finish_reason, r.metrics = out.finish_reason, out.metrics
        return [results[r] for r in ids]
