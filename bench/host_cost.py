"""Host work on a decode step's critical path: staging the step's inputs, the engine's step around the
forward, and detokenizing its tokens.

All of it runs on the host between CUDA-graph replays. Timed on the CPU (no GPU needed):

* ``DecodeStager.stage`` per batch size and context, for requests whose block tables stay the same lists from
  step to step (as a decoding batch's do), and with a fresh copy of every table each step (what a stager that
  cannot skip unchanged entries pays, and what worker ranks that receive pickled rows pay). The buffers are
  plain CPU tensors, so the host-to-device copy becomes a synchronous memcpy of the whole table width (on a
  GPU it is an asynchronous copy); the default width is therefore the largest context's, as ``bench.py``'s
  Setup has, not a long ``max_model_len``.
* ``LLMEngine.step`` of a decoding batch with the model's forward replaced by a stub (its logits pick the
  tokens of a real text, so detokenization and stop checks see text): the engine's own host work per step
  (schedule, stage, sample, record tokens and detokenize, cache bookkeeping), whole and by part, greedy and
  sampled (temperature + top-p) and seeded (the same with a seed per request). On a GPU all of it sits between
  two graph replays.
* The same engine step with MTP speculation on (``num_speculative_tokens=3``) but every step at ``k = 0``
  (the adaptive policy's choice where speculation does not pay), model and MTP forwards stubbed, against the
  engine without MTP: what the speculative engine's k = 0 step adds on the host, per step and in the steps
  that drain each request's MTP backlog (every ``MAX_BACKLOG`` steps), whole and by part.
* The adaptive speculation policy's own work per decode step (choose k, keep or drop a full backlog, take the
  step's time), with a measured-like cost table and with the byte model.
* A full garbage collection in a process holding an engine, with its start-up heap as it is and frozen
  (``glm5.heap``, as the serving processes do), and for each the collections over 30 x ``--engine-steps``
  steps of 32 requests of 16 tokens, each finished request replaced by a new one.
* One seeded row's draw over GLM-5.3-Flash's vocabulary from a CPU generator: what a seeded request would
  pay on the host per token with its generator on the CPU (the engine makes each one on its own device).
* ``IncrementalDetokenizer.add_tokens`` per token, through ``tokenizers``' streaming decoder (a fast HF
  tokenizer) and through the window path (two HF ``decode`` calls per token), on the README's tokens (random
  ids would be mostly invalid UTF-8 pieces, which send a request to the window path after 32 of them) with
  the tokenizer of ``--tokenizer DIR`` (default: the tiny checkpoint's, made in a temporary folder).

Usage: ``python bench/host_cost.py [--out OUT.json] [--batches 1 64 256] [--contexts 1024 8192]
[--max-model-len N] [--block-size 64] [--steps 200] [--engine-steps 100] [--spec-steps 256]
[--spec-batches 8 32] [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import operator
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
try:
    from glm5.engine.cuda_graph import DecodeRows, DecodeStager
except ImportError:  # run from a checkout without the package installed
    sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "kernels")]
    from glm5.engine.cuda_graph import DecodeRows, DecodeStager


def time_stage(batch: int, ctx: int, max_blocks: int, block_size: int, steps: int, fresh: bool) -> float:
    """Median µs of one ``stage`` call over ``steps`` calls (after 10 warm-up calls)."""
    cache = types.SimpleNamespace(block_size=block_size, scratch_block=0, scratch_slot=0)
    stager = DecodeStager(cache, batch, max_blocks, torch.device("cpu"))
    held = ctx // block_size + 1
    tables = [list(range(1 + i * held, 1 + (i + 1) * held)) for i in range(batch)]

    def rows() -> DecodeRows:
        bt = [list(t) for t in tables] if fresh else tables
        return DecodeRows(tokens=[1] * batch, positions=[ctx] * batch, state_slots=list(range(batch)),
                          block_tables=bt)
    for _ in range(10):
        stager.stage(rows(), batch)
    times = []
    for _ in range(steps):
        r = rows()
        t0 = time.perf_counter()
        stager.stage(r, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def time_detokenizer(tokenizer_dir: str | None, tokens: int = 3000) -> dict:
    """µs per token of the streaming and the window detokenizer on the README's tokens (20 before as context)."""
    from transformers import AutoTokenizer

    from glm5.detokenizer import IncrementalDetokenizer
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_dir is None:
            from glm5.tiny_checkpoint import make_tiny_checkpoint
            make_tiny_checkpoint(Path(tmp) / "ckpt")
            tokenizer_dir = str(Path(tmp) / "ckpt")
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    class WindowOnly:  # no backend_tokenizer: the window path
        def decode(self, *a, **kw):
            return tok.decode(*a, **kw)
    text_ids = tok.encode((ROOT / "README.md").read_text() * 8, add_special_tokens=False)
    if len(text_ids) < tokens + 20:
        raise ValueError(f"the README gives {len(text_ids)} tokens with this tokenizer; ask for fewer than {tokens}")
    context, ids = text_ids[:20], text_ids[20:20 + tokens]
    out = {"tokenizer": tokenizer_dir if tokenizer_dir and not tokenizer_dir.startswith(tempfile.gettempdir())
           else "tiny checkpoint", "vocab": len(tok), "tokens": tokens}
    for name, t in (("stream_us_per_token", tok), ("window_us_per_token", WindowOnly())):
        d = IncrementalDetokenizer(t, context)
        t0 = time.perf_counter()
        for i in ids:
            d.add_tokens([i])
        out[name] = (time.perf_counter() - t0) / tokens * 1e6
        if t is tok:
            out["stream_kept_to_the_end"] = d._stream is not None
    return out


#: sampling settings of request ``i`` per :func:`time_engine_step` mode
ENGINE_MODES = {"greedy": lambda i: {"temperature": 0.0},
                "sampled": lambda i: {"temperature": 0.8, "top_p": 0.95},
                "seeded": lambda i: {"temperature": 0.8, "top_p": 0.95, "seed": i}}
#: GLM-5.3-Flash's vocabulary: what one seeded row's draw covers each step
REAL_VOCAB = 154880
#: (label, object attribute path) of the engine-step parts timed by :func:`time_engine_step`
ENGINE_PARTS = (("schedule", "scheduler.schedule"), ("stage", "runner.stager.stage"),
                ("sample", "sampler.sample"), ("record_tokens", "_append_tokens"), ("finish_step", "_finish_step"))


def decoding_engine(batch: int, mode: str, ckpt: Path, speculative: int = 0, keep_mtp: bool = True):
    """A CPU engine on ``ckpt`` whose ``batch`` requests have all finished their prompts, with the model's
    forward replaced by a stub whose logits make row r emit the README's tokens (from offset 97 r).
    ``speculative`` > 0: MTP speculation with that many drafts at most, the MTP layer's forward stubbed too,
    under the adaptive policy (its per-step work included) reading a cost table on which every draft costs
    two plain steps, so that it picks k = 0 at every step (probes off); ``keep_mtp``: the policy says
    speculation could pay (backlogs are carried, full ones drained), else that it cannot (the MTP layer stops
    following the requests at once, glm5.engine.spec_batched)."""
    from glm5.engine.args import EngineArgs
    from glm5.engine.llm_engine import LLMEngine
    from glm5.engine.spec_policy import AdaptiveK, SpecCostModel
    from glm5.layers.glm5 import ModelOutput
    from glm5.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(model=str(ckpt), max_num_seqs=batch, max_model_len=8192, cache_memory_gb=1.0,
                               decode_path="batched", load_progress=False, num_speculative_tokens=speculative))
    if speculative:
        if eng.spec is None:
            raise RuntimeError("the engine runs no batched speculation; --decode-path batched and an MTP layer needed")
        cost = SpecCostModel(eng.model_config, {k: [(1, 1e-3 * (1 + 2 * k)), (batch + 1, 1e-3 * (1 + 2 * k))]
                                                for k in range(speculative + 1)})
        eng.k_policy = AdaptiveK(speculative, cost, probe_every=0)
        eng.k_policy.keeps_mtp = eng.k_policy.holds_mtp = lambda b: keep_mtp
        hidden_size = eng.model_config.text.hidden_size

        def mtp_forward(fwd_batch, hidden, cache):
            n = int(fwd_batch.logits_indices.shape[0])
            return torch.zeros(n, eng.model_config.text.vocab_size), torch.zeros(hidden.shape[0], hidden_size)
        eng.runner.mtp.forward = mtp_forward
    text_ids = eng.tokenizer.encode((ROOT / "README.md").read_text() * 2, add_special_tokens=False)
    for i in range(batch):
        sp = SamplingParams(max_tokens=1 << 20, ignore_eos=True, **ENGINE_MODES[mode](i))
        eng.add_request(f"r{i}", text_ids[i:i + 32], sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    model, clock = eng.runner.model, [0]

    def forward(fwd_batch, cache):  # logits that make row r emit the text's token (clock + 97 r)
        n = int(fwd_batch.logits_indices.shape[0])
        logits = torch.full((n, eng.model_config.text.vocab_size), -30.0)
        rows = torch.arange(n)
        logits[rows, torch.tensor([text_ids[(clock[0] + 97 * r) % len(text_ids)] for r in range(n)])] = 30.0
        clock[0] += 1
        return ModelOutput(logits=logits, hidden=torch.zeros(int(fwd_batch.input_ids.shape[0]),
                                                            eng.model_config.text.hidden_size))
    model.forward = forward
    return eng


def time_engine_step(batch: int, mode: str, steps: int, ckpt: Path) -> dict:
    """Median ms of ``LLMEngine.step`` over ``steps`` decode steps of ``batch`` requests (forward stubbed), and
    the mean ms per step of each part in :data:`ENGINE_PARTS`."""
    eng = decoding_engine(batch, mode, ckpt)
    times, spent = _time_steps({mode: (eng, ENGINE_PARTS)}, steps)[mode]
    assert len(eng.scheduler.running) == batch, "a request left the batch during the timing"
    step_ms = statistics.median(times) * 1e3
    return {"batch": batch, "mode": mode, "step_ms": step_ms, "us_per_request": step_ms * 1e3 / batch,
            "parts_ms": {k: v / steps * 1e3 for k, v in spent.items()}}


#: (label, object attribute path) of the extra parts a speculative engine's k = 0 step has
SPEC_PARTS = (("propose", "spec.propose"), ("drain", "spec._catch_up"))


def _wrap_parts(eng, parts) -> dict[str, float]:
    """Wrap each ``(label, attribute path)`` of ``eng`` so that its calls add their seconds to the returned dict."""
    spent = {label: 0.0 for label, _ in parts}
    for label, path in parts:
        owner_path, _, name = path.rpartition(".")
        owner = operator.attrgetter(owner_path)(eng) if owner_path else eng
        inner = getattr(owner, name)

        def timed_part(*a, _inner=inner, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[_label] += time.perf_counter() - t0
        setattr(owner, name, timed_part)
    return spent


def _time_steps(engines: dict[str, tuple[object, tuple]], steps: int, warmup: int = 10
                ) -> dict[str, tuple[list[float], dict[str, float]]]:
    """Per name: seconds of each of ``steps`` engine steps after ``warmup`` untimed ones, and seconds spent in
    each of its ``(label, attribute path)`` parts. Several engines step alternately, one step each in turn, so
    that a slow stretch of this machine hits them alike."""
    spent = {name: _wrap_parts(eng, parts) for name, (eng, parts) in engines.items()}
    for _ in range(warmup):
        for eng, _ in engines.values():
            eng.step()
    for d in spent.values():
        d.update({k: 0.0 for k in d})
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, (eng, _) in engines.items():
            t0 = time.perf_counter()
            eng.step()
            times[name].append(time.perf_counter() - t0)
    return {name: (times[name], spent[name]) for name in engines}


def time_spec_k0(batch: int, steps: int, ckpt: Path) -> dict:
    """The engine step (forwards stubbed, greedy) without MTP and with MTP speculation held at k = 0, the
    engines stepped alternately over the same ``steps`` (a multiple of the backlog cap keeps the drains in
    proportion): mean and median ms, the slow steps (the drains), and ms per step of each part. Two
    speculative engines: ``spec_k0`` keeps the MTP layer's history (its policy says speculation could pay at
    this batch size, so every request holds a backlog and full ones are drained), ``spec_k0_drop`` is told it
    cannot (the MTP layer stops following the requests at the first step, glm5.engine.spec_batched, and they
    step as cheaply as without MTP); the keeping engine's steps before its first full backlog (backlogs
    carried, none drained yet: each new request's first ``MAX_BACKLOG`` steps where speculation could pay)
    are also timed apart."""
    from glm5.engine.spec_batched import MAX_BACKLOG
    engines = {"plain": (decoding_engine(batch, "greedy", ckpt), ENGINE_PARTS),
               "spec_k0": (decoding_engine(batch, "greedy", ckpt, 3), ENGINE_PARTS + SPEC_PARTS),
               "spec_k0_drop": (decoding_engine(batch, "greedy", ckpt, 3, keep_mtp=False), ENGINE_PARTS + SPEC_PARTS)}
    warmup = 10
    # the timed steps before the first full backlog (the requests' rows since their prompts: the warm-up's, then
    # these): every request of the keeping engine holds a backlog, none drained yet
    first = MAX_BACKLOG - warmup - 1
    out: dict = {"batch": batch, "steps": steps, "max_backlog": MAX_BACKLOG, "interleaved": True,
                 "before_first_drain_steps": first}
    for name, (ts, spent) in _time_steps(engines, steps, warmup).items():
        assert len(engines[name][0].scheduler.running) == batch, "a request left the batch during the timing"
        med = statistics.median(ts)
        out[name] = {"mean_ms": statistics.fmean(ts) * 1e3, "median_ms": med * 1e3,
                     "before_first_drain_mean_ms": statistics.fmean(ts[:first]) * 1e3,
                     "slow_steps": sum(t > 3 * med for t in ts), "max_ms": max(ts) * 1e3,
                     "mtp_dropped": engines[name][0].spec_stats.mtp_dropped if name != "plain" else 0,
                     "parts_ms": {k: v / steps * 1e3 for k, v in spent.items()}}
    out["mean_ratio"] = out["spec_k0"]["mean_ms"] / out["plain"]["mean_ms"]
    out["drop_mean_ratio"] = out["spec_k0_drop"]["mean_ms"] / out["plain"]["mean_ms"]
    out["before_first_drain_ratio"] = (out["spec_k0"]["before_first_drain_mean_ms"]
                                       / out["plain"]["before_first_drain_mean_ms"])
    return out


def time_gc(batch: int, steps: int, ckpt: Path, tokens: int = 16) -> dict:
    """What a full garbage collection costs in a process holding an engine (the stall it puts between two decode
    steps when the collector's thresholds call one), with the start-up heap as it is and frozen
    (glm5.heap, what the serving processes do); and, for each, the collections of every generation and
    their longest time over ``steps`` engine steps (forward stubbed) of a churning batch: ``batch`` requests of
    ``tokens`` tokens each, a new one added as each finishes (so request objects keep reaching the oldest
    generation, as in a server)."""
    import gc

    from glm5.heap import frozen_heap
    from glm5.sampling_params import SamplingParams

    eng = decoding_engine(batch, "greedy", ckpt)
    for i in range(batch):
        eng.abort(f"r{i}")
    prompt = list(range(100, 132))
    added = [0]

    def add() -> None:
        eng.add_request(f"c{added[0]}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        added[0] += 1

    def full_ms() -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def churn() -> dict:
        spent: dict[int, list[float]] = {0: [], 1: [], 2: []}
        started = [0.0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                spent[info["generation"]].append(time.perf_counter() - started[0])
        gc.callbacks.append(on_gc)
        try:
            for _ in range(steps):
                while len(eng.scheduler.running) + len(eng.scheduler.waiting) < batch:
                    add()
                eng.step()
        finally:
            gc.callbacks.remove(on_gc)
        return {str(g): {"count": len(t), "max_ms": max(t, default=0.0) * 1e3} for g, t in spent.items()}

    out = {"batch": batch, "steps": steps, "tokens_per_request": tokens, "tracked_objects": len(gc.get_objects()),
           "full_collection_ms": full_ms()}
    out["collections"] = churn()
    with frozen_heap() as frozen:
        out["frozen_objects"] = frozen
        out["full_collection_frozen_ms"] = full_ms()
        out["collections_frozen"] = churn()
    out["requests"] = added[0]
    return out


def time_policy(batches: list[int], calls: int = 2000) -> dict:
    """µs per decode step of the adaptive policy's own work (``choose`` the next k, ``keeps_mtp`` for a full
    backlog and ``holds_mtp`` for the step's rows, ``observe_time`` of the step) at each batch size, on the
    real config, with round costs from a measured-like table and from the byte model (no table), the
    acceptance estimate unchanged between steps (a step at k = 0 verifies nothing)."""
    from glm5.config import ModelConfig
    from glm5.engine.spec_policy import AdaptiveK, SpecCostModel

    cfg = ModelConfig.from_pretrained(str(ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json"))
    table = {k: [(b, 1e-3 * b ** 0.5 * (1 + 0.8 * k)) for b in (1, 8, 64)] for k in range(4)}
    out: dict = {"calls": calls}
    for name, cost in (("table", SpecCostModel(cfg, table)), ("byte_model", SpecCostModel(cfg))):
        policy = AdaptiveK(3, cost)
        rows = []
        for b in batches:
            t0 = time.perf_counter()
            for _ in range(calls):
                policy.choose(b)
                policy.keeps_mtp(b)
                policy.holds_mtp(b)
                policy.observe_time(1e-3, b, plain=True)
            rows.append({"batch": b, "us_per_step": (time.perf_counter() - t0) / calls * 1e6})
        out[name] = rows
    return out


def time_cpu_generator_draw(vocab: int = REAL_VOCAB, reps: int = 50) -> float:
    """µs of one seeded row's Exp(1) draw over ``vocab`` tokens from a CPU generator (a seeded request's
    host cost per sampled token were its generator on the CPU)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.empty(vocab)
    q.exponential_(generator=gen)
    t0 = time.perf_counter()
    for _ in range(reps):
        q.exponential_(generator=gen)
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="sets the stager's block-table width (default: the largest context + 2 blocks)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--engine-steps", type=int, default=100, help="timed engine steps per batch and mode")
    ap.add_argument("--tokenizer", help="tokenizer folder for the detokenizer timing (default: the tiny checkpoint's)")
    ap.add_argument("--spec-steps", type=int, default=256,
                    help="timed steps of the speculative k = 0 comparison per batch (0: skip it)")
    ap.add_argument("--spec-batches", type=int, nargs="+", default=[8, 32])
    args = ap.parse_args(argv)
    max_len = args.max_model_len or max(args.contexts) + 2 * args.block_size
    max_blocks = -(-max_len // args.block_size)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(),
           "command": " ".join(["bench/host_cost.py", *(argv if argv is not None else sys.argv[1:])]),
           "max_blocks": max_blocks, "stage": []}
    for ctx in args.contexts:
        for b in args.batches:
            row = {"batch": b, "ctx": ctx, "blocks_per_request": ctx // args.block_size + 1,
                   "same_lists_us": time_stage(b, ctx, max_blocks, args.block_size, args.steps, fresh=False),
                   "fresh_lists_us": time_stage(b, ctx, max_blocks, args.block_size, args.steps, fresh=True)}
            out["stage"].append(row)
            print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        from glm5.tiny_checkpoint import make_tiny_checkpoint
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt")
        out["engine_step"] = []
        for mode in ENGINE_MODES:
            for b in args.batches:
                row = time_engine_step(b, mode, args.engine_steps, ckpt)
                out["engine_step"].append(row)
                print(json.dumps(row), flush=True)
        out["spec_k0"] = []
        for b in args.spec_batches if args.spec_steps else ():
            row = time_spec_k0(b, args.spec_steps, ckpt)
            out["spec_k0"].append(row)
            print(json.dumps(row), flush=True)
        out["policy"] = time_policy(sorted({1, *args.spec_batches}))
        print(json.dumps(out["policy"]), flush=True)
        out["gc"] = time_gc(32, args.engine_steps * 30, ckpt)
        print(json.dumps(out["gc"]), flush=True)
    out["cpu_generator_draw_us"] = {"vocab": REAL_VOCAB, "us_per_row": time_cpu_generator_draw()}
    print(json.dumps(out["cpu_generator_draw_us"]), flush=True)
    out["detokenizer"] = time_detokenizer(args.tokenizer)
    print(json.dumps(out["detokenizer"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
