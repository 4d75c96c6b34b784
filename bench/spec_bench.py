"""Speculative decoding benchmark: round cost per batch size and k, acceptance, and the speed-up MTP gives.

Two parts, recorded together as the ``speculative`` section of a results JSON:

* **rounds** (CUDA): the bench config of ``bench/bench.py`` (real GLM-5.3-Flash layer shapes, 8 layers) plus
  its MTP layer, random bf16 weights, run through ``glm5.engine.LLMEngine`` with CUDA graphs. Per batch and
  ``k``: ``step_s`` = wall time of one engine step of a speculative round (verify ``k+1`` rows, accept,
  commit, MTP catch-up, ``k−1`` draft steps, the host work between them) with every draft accepted (the
  catch-up then covers ``k+1`` rows: the dearest round), ``step_s_none_accepted`` with none accepted (what
  random weights give on their own), ``plain_step_s`` = the same engine at ``k = 0`` in the same run, and
  ``bytes`` = what the round must move (``glm5.engine.spec_policy.round_bytes``: touched experts of the verify
  rows and of the MTP passes under uniform routing, the draft steps' weights and LM head reads, KDA state,
  attention), with its roofline fraction at the copy bandwidth measured in the same run.
* **acceptance** (CPU or CUDA): the trained tiny checkpoint (``python -m glm5.trained_tiny_checkpoint``, its
  MTP layer trained against the target) on its 20 agreement prompts, greedy: mean accepted tokens per round
  and per-position acceptance for k = 1..3, with the full draft head and with reduced draft vocabularies,
  and the check that every run's tokens equal k = 0's.

From them: ``speedup`` rows — per batch, at per-position acceptance 0.6 / 0.8 / 0.9 and at the measured
one, the best k and tokens/s against plain decoding, with the round cost interpolated between the two
measured extremes by the expected accepted drafts. ``--cost-table FILE`` also writes the measured round
times in the format ``speculative_cost_table`` reads (the adaptive policy's table).

Usage: ``python bench/spec_bench.py --out DIR [--trained-ckpt DIR] [--batches 1 8 64] [--ctx 1024]
[--acceptance-only | --rounds-only] [--profile] [--cost-table FILE] [--merge RESULTS_JSON]`` (``--merge`` adds
the section to an existing ``bench/bench.py`` results file; ``bench/render_results.py`` renders it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ACCEPTANCE_LEVELS = (0.6, 0.8, 0.9)
K_MAX = 3
GEN_TOKENS = 640   # room for every timed step of one batch size (up to k+1 tokens per step)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ---------------------------------------------------------------------------------------------------- rounds
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(cfg_dict: dict, batch: int, ctx: int, weights: dict, device: str = "cuda"):
    from glm5.engine import EngineArgs, LLMEngine
    tmp = Path(tempfile.mkdtemp(prefix="spec_bench_"))
    (tmp / "config.json").write_text(json.dumps(cfg_dict))
    room = GEN_TOKENS + 64
    blocks = batch * (-(-(ctx + room) // 64)) + 8
    dtype = "bfloat16" if device == "cuda" else "float32"
    args = EngineArgs(model=str(tmp), dtype=dtype, device=device, block_size=64, num_cache_blocks=blocks,
                      max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=ctx + room,
                      num_speculative_tokens=K_MAX, speculative_max_batch=batch, load_progress=False,
                      decode_path="batched",
                      # a bound, not an allocation: the plan takes num_cache_blocks and batch + 1 state slots
                      # (25 MiB each at the bench shapes: batch 64 needs 1.6 GiB, over the 1 GiB default)
                      cache_memory_gb=32.0, enable_prefix_caching=False)
    return LLMEngine(args, weights=weights)


def _accept_all(spec_cls):
    """Make every draft pass (timing only: the tokens are then not the target's): the work of a round whose
    drafts were all right — commit of k+1 rows, catch-up of k+1 rows — whatever the random weights predict."""
    orig = spec_cls._accept

    from glm5.layers.batch import host_to_device

    def accept(self, chunks, logits, k):
        emitted, accepted, lps = orig(self, chunks, logits, k)
        # without waiting for the GPU, as the engine's own accept does: a blocking copy here would time a sync
        # the engine does not make
        nd = host_to_device([c.num_drafts for c in chunks], accepted.device)
        drafts = host_to_device([c.seq.draft_tokens[: c.num_drafts] + [0] * (k - c.num_drafts) for c in chunks],
                                accepted.device)
        emitted = torch.cat([drafts, emitted[:, -1:]], dim=1)
        return emitted, nd, lps
    return orig, accept


def _profile_step(eng, path: Path) -> dict:
    """One engine step under the torch profiler: kernel count, summed GPU kernel time, the top-kernel table."""
    eng.step()
    _sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.step()
        _sync()
    ka = prof.key_averages()
    cuda = [e for e in ka if e.device_type.name == "CUDA"]
    path.write_text(ka.table(sort_by="self_cuda_time_total", row_limit=30))
    return {"cuda_kernels": sum(e.count for e in cuda),
            "kernel_time_s": sum(e.self_device_time_total for e in cuda) / 1e6, "table": path.name}


def run_rounds(cfg_dict: dict, weights: dict, batch: int, ctx: int, steps: int, log,
               profile_dir: Path | None = None, device: str = "cuda") -> list[dict]:
    """Round timings at one batch size (module docstring); ``device="cpu"`` runs the same steps eagerly (the
    CPU tests' dry run of this function)."""
    from glm5.config import ModelConfig
    from glm5.engine.spec_batched import BatchedSpeculation
    from glm5.engine.spec_policy import FixedK, WeightBytes, round_bytes
    from glm5.heap import frozen_heap
    from glm5.sampling_params import SamplingParams

    eng = _engine(cfg_dict, batch, ctx, weights, device)
    cfg = ModelConfig.from_dict(cfg_dict)
    wb = WeightBytes.from_config(cfg)
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{i}", torch.randint(0, cfg.text.vocab_size, (ctx,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    rows = []
    # k = 0 last: a fixed k = 0 says speculation never pays, so the MTP layer stops following the requests at
    # once (glm5.engine.spec_batched), and a later k > 0 would draft nothing
    for k in range(K_MAX, -1, -1):
        row = {"batch": batch, "ctx": ctx, "k": k}
        for mode in ("none", "all") if k else ("plain",):
            eng.k_policy = FixedK(k)
            orig = None
            if mode == "all":
                orig, patched = _accept_all(BatchedSpeculation)
                BatchedSpeculation._accept = patched
            try:
                for _ in range(3):  # the step before drafted k: the timed ones verify k
                    eng.step()
                verified = eng.spec_stats.steps   # one per request a step verified
                times = []
                with frozen_heap():   # as a serving process runs (glm5.heap)
                    for _ in range(steps):
                        _sync()
                        t0 = time.perf_counter()
                        eng.step()
                        _sync()
                        times.append(time.perf_counter() - t0)
            finally:
                if orig is not None:
                    BatchedSpeculation._accept = orig
                key = {"plain": "plain_step_s", "none": "step_s_none_accepted", "all": "step_s"}[mode]
                row[key] = median(times)
            if k and eng.spec_stats.steps - verified < batch * steps:
                raise RuntimeError(f"k={k} ({mode}): {eng.spec_stats.steps - verified} verified requests in {steps} "
                                   f"timed steps of {batch}; the timings would be of steps without speculation")
            if profile_dir is not None and mode in ("plain", "all") and k in (0, K_MAX):
                row["profile" if k else "profile_plain"] = _profile_step(
                    eng, profile_dir / f"profile_spec_b{batch}_k{k}.txt")
        row["bytes"] = round_bytes(cfg, wb, batch, k, ctx)
        rows.append(row)
        log(row)
    rows.reverse()
    plain = rows[0]["plain_step_s"]
    for r in rows:
        r["plain_step_s"] = plain
        if r["k"] == 0:
            r["step_s"] = plain
    for sid in list(eng._requests):
        eng.abort(sid)
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- acceptance
def run_acceptance(ckpt: Path, device: str, log, n_tokens: int = 32) -> list[dict]:
    from glm5 import trained_tiny_checkpoint as trained_tiny

    vocab = int(json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"])
    prompts = trained_tiny.agreement_prompts(vocab)
    dtype = "float32"
    # eager: acceptance does not depend on CUDA graphs, and nine engine builds would spend minutes capturing
    ref = trained_tiny.greedy_tokens(ckpt, prompts, dtype, device=device, n=n_tokens, decode_path="batched",
                                     enforce_eager=True)
    rows = []
    for draft_vocab in (0, vocab // 2, vocab // 4):
        for k in range(1, K_MAX + 1):
            from glm5.engine import EngineArgs, LLMEngine
            from glm5.sampling_params import SamplingParams
            eng = LLMEngine(EngineArgs(model=str(ckpt), device=device, dtype=dtype, block_size=16, num_cache_blocks=256,
                                       max_num_seqs=20, max_num_batched_tokens=512, load_progress=False,
                                       decode_path="batched", num_speculative_tokens=k, draft_vocab_size=draft_vocab,
                                       enforce_eager=True))
            out = [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                                             ignore_eos=True))]
            st = eng.spec_stats.to_dict()
            prop, acc = st["proposed"], st["accepted"]
            cond = [acc[j] / acc[j - 1] if j and acc[j - 1] else (acc[0] / prop[0] if prop[0] else 0.0)
                    for j in range(k)]
            row = {"k": k, "draft_vocab": draft_vocab or vocab, "vocab": vocab, "steps": st["steps"],
                   "mean_accepted_tokens": st["mean_accepted_length"], "acceptance_per_position": st[
                       "acceptance_rate_per_position"], "conditional_acceptance": [round(c, 4) for c in cond],
                   "tokens_equal_k0": out == ref}
            rows.append(row)
            log(row)
    return rows


# ---------------------------------------------------------------------------------------------- speed-up
def speedups(rounds: list[dict], acceptance: list[dict]) -> list[dict]:
    """Per batch and acceptance level: the best k and its tokens/s over plain decoding. The round cost at an
    expected ``E − 1`` accepted drafts is interpolated between the none- and all-accepted measurements."""
    from glm5.engine.spec_policy import expected_tokens
    measured = next((a["conditional_acceptance"] for a in acceptance
                     if a["k"] == K_MAX and a["draft_vocab"] == a["vocab"]), None)
    levels = [(f"{a:.1f}", [a] * K_MAX) for a in ACCEPTANCE_LEVELS]
    if measured:
        levels.append(("measured", measured))
    out = []
    for b in sorted({r["batch"] for r in rounds if "error" not in r}):
        rs = {r["k"]: r for r in rounds if r["batch"] == b and "error" not in r}
        plain = rs[0]["plain_step_s"]
        for name, rates in levels:
            best_k, best = 0, 1.0 / plain
            per_k = {}
            for k in range(1, K_MAX + 1):
                if k not in rs:
                    continue
                e = expected_tokens(rates, k)
                lo, hi = rs[k]["step_s_none_accepted"], rs[k]["step_s"]
                t = lo + (hi - lo) * (e - 1) / k
                per_k[k] = e / t * plain
                if e / t > best:
                    best_k, best = k, e / t
            out.append({"batch": b, "acceptance": name, "rates": [round(x, 4) for x in rates], "best_k": best_k,
                        "speedup": round(best * plain, 4), "speedup_per_k": {k: round(v, 4) for k, v in per_k.items()}})
    return out


def cost_table(rounds: list[dict], device: str) -> dict:
    rows = [{"batch": r["batch"], "k": r["k"], "round_s": r["step_s"]} for r in rounds if "error" not in r]
    return {"device": device, "note": "bench/spec_bench.py: engine step per round, every draft accepted",
            "rounds": rows}


def trained_with_mtp(ckpt: Path | None, out: Path, device: str) -> Path:
    """``ckpt`` when its MTP layer was trained (``train_report.json`` has ``mtp``); a copy with the MTP layer
    trained when it was not (checkpoints made before the MTP stage); a fresh one when there is none."""
    import shutil

    from glm5 import trained_tiny_checkpoint as trained_tiny
    if ckpt is None or not (ckpt / "config.json").is_file():
        return trained_tiny.train_tiny_checkpoint(out / "trained", device=device)
    if json.loads((ckpt / trained_tiny.REPORT_FILE).read_text()).get("mtp"):
        return ckpt
    from glm5.tiny_mtp_training import train_mtp_layer
    copy = out / "trained_mtp"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ckpt, copy)
    train_mtp_layer(copy, trained_tiny.load_transformers_model(copy, device), device=device)
    return copy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created): spec_results.json, log")
    ap.add_argument("--trained-ckpt", type=Path, help="trained tiny checkpoint (default $GLM5_TRAINED_CKPT, else "
                    "one is trained into OUT/trained)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="timed engine steps per (batch, k, mode)")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--acceptance-only", action="store_true", help="only the acceptance part (runs on a CPU)")
    part.add_argument("--rounds-only", action="store_true", help="only the round timings (no acceptance, so no "
                      "speed-up rows at the measured acceptance; not with --merge, which would drop the results "
                      "file's acceptance)")
    ap.add_argument("--profile", action="store_true", help="also profile one plain step and one k=3 round per batch "
                    "(OUT/profile_spec_b{B}_k{k}.txt)")
    ap.add_argument("--cost-table", type=Path, help="also write the measured round times for speculative_cost_table")
    ap.add_argument("--merge", type=Path, help="add the results as the 'speculative' section of this results JSON")
    args = ap.parse_args()
    if args.rounds_only and args.merge:
        ap.error("--rounds-only has no acceptance rows: --merge would replace the file's speculative section "
                 "(its acceptance and speed-ups) with rows that lack them")
    import os
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    from bench import jsonl_logger
    log = jsonl_logger(args.out / "spec_bench.log")

    cuda = torch.cuda.is_available()
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name() if cuda else "none", "torch": torch.__version__,
                 "command": " ".join(sys.argv)}
    ckpt = args.trained_ckpt or (Path(os.environ["GLM5_TRAINED_CKPT"]) if os.environ.get("GLM5_TRAINED_CKPT") else None)
    res["acceptance"] = []
    if not args.rounds_only:
        ckpt = trained_with_mtp(ckpt, args.out, "cuda" if cuda else "cpu")
        res["trained_checkpoint"] = str(ckpt)
        res["acceptance"] = run_acceptance(ckpt, "cuda" if cuda else "cpu", log)
    if not args.acceptance_only:
        if not cuda:
            raise SystemExit("the round timings need a CUDA GPU; use --acceptance-only on a CPU")
        from bench import bench_config_dict, ceilings
        from glm5.config import ModelConfig
        from glm5.weights import dummy_weights
        cfg_dict = bench_config_dict()
        cfg_dict["text_config"]["num_nextn_predict_layers"] = 1
        res["ceilings"] = ceilings()
        log(res["ceilings"])
        weights = dummy_weights(ModelConfig.from_dict(cfg_dict), "cuda", torch.bfloat16, include_mtp=True)
        res["rounds"] = []
        for b in args.batches:
            try:
                res["rounds"] += run_rounds(cfg_dict, weights, b, args.ctx, args.steps, log,
                                            args.out if args.profile else None)
            except Exception as e:  # record and go on: one size failing must not hide the others
                res["rounds"].append({"batch": b, "ctx": args.ctx, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                log(res["rounds"][-1])
                torch.cuda.empty_cache()
        bw = res["ceilings"]["copy_bw_Bps"]
        for r in res["rounds"]:
            if "error" not in r:
                r["roofline_fraction"] = r["bytes"]["total"] / bw / r["step_s"]
        res["speedup"] = speedups(res["rounds"], res["acceptance"])
        if args.cost_table:
            args.cost_table.write_text(json.dumps(cost_table(res["rounds"], res["gpu"]), indent=1) + "\n")
    (args.out / "spec_results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if args.merge:
        merged = json.loads(args.merge.read_text()) if args.merge.exists() else {}
        merged["speculative"] = res
        args.merge.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
