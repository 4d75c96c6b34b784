"""Prefix-cache benchmark: hit rate and time to first token with the cache on vs off, in one run.

``workloads`` (default model: the tiny checkpoint, on the CPU) drives the engine with closed-loop
clients — a client sends its next request when its previous answer is complete, and client ``i``
starts once client ``i-1`` has its first token — over two traffic patterns:

* **chat**: C conversations x T turns over an S-token shared system prompt; turn t's prompt is the
  system prompt, the conversation so far (user messages and answers) and a new U-token message,
  answered with A tokens;
* **rag**: Q questions, K clients at a time, over one D-token document that ends mid-block (the
  shared part is the document; each prompt is document + question).

Each pattern runs with the cache off and with the cache on in several snapshot designs (default:
request end, preemption, prompt end, junction; without junction snapshots; without prompt-end
snapshots; with interval checkpoints). Reported per run: hit rate in tokens (cached / prompt tokens
over all requests), shared-token reuse, TTFT p50/p99 (all requests and follow-up requests), wall
time, and snapshots saved / tokens hit per snapshot kind.

``followup`` measures what a chat user feels on a long conversation: TTFT of a follow-up turn over
an H-token history (default 8192) with the cache on vs off in the same process, on the H200 bench
config (real per-layer shapes of GLM-5.3-Flash with 8 layers and random bf16 weights, as
``bench/bench.py`` builds it). ``--tiny`` runs the same code on the tiny checkpoint's shapes (CPU
check that the mode works end to end).

Usage::

    python bench/prefix_cache_bench.py workloads --out bench/results/prefix_cache_cpu.json
    python bench/prefix_cache_bench.py followup --device cuda --out bench/results/prefix_cache_h200.json
    python bench/prefix_cache_bench.py followup --device cpu --tiny --history 256 --out /tmp/followup.json

Each writes one JSON file (numbers, command, date, machine); ``workloads`` also prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 600  # token ids of random prompts: below the tiny tokenizer's special tokens


def rand_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count()}
    if hasattr(os, "getloadavg"):
        info["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------------------------
# closed-loop clients
# ---------------------------------------------------------------------------------------------
@dataclass
class Client:
    """A user: ``next(previous answer or None)`` returns the next prompt, or None when done."""

    next: Callable[[list[int] | None], list[int] | None]
    shared: int = 0          # leading prompt tokens this client shares with every other (system prompt / document)


@dataclass
class Record:
    client: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    shared_tokens: int
    ttft_s: float


def run_clients(eng, clients: list[Client], concurrency: int, answer_tokens: int) -> tuple[list[Record], float]:
    from glm5.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    waiting = list(range(len(clients)))
    active: dict[str, tuple[int, int, int]] = {}   # request id -> (client, turn, prompt tokens)
    answers: dict[str, list[int]] = {}
    records: list[Record] = []
    last_started: str | None = None
    first_seen: set[str] = set()
    n = 0
    t0 = time.perf_counter()

    def submit(ci: int, turn: int, prompt: list[int]) -> str:
        nonlocal n
        rid = f"c{ci}-t{turn}-{n}"
        n += 1
        eng.add_request(rid, prompt, params)
        active[rid] = (ci, turn, len(prompt))
        answers[rid] = []
        return rid

    while waiting or active:
        clients_active = {ci for ci, _, _ in active.values()}
        if waiting and len(clients_active) < concurrency and (last_started is None or last_started in first_seen):
            ci = waiting.pop(0)
            last_started = submit(ci, 0, clients[ci].next(None))
        for out in eng.step():
            if out.token_ids:
                first_seen.add(out.request_id)
            answers[out.request_id].extend(out.token_ids)
            if not out.finished:
                continue
            ci, turn, plen = active.pop(out.request_id)
            records.append(Record(ci, turn, plen, out.num_cached_tokens, clients[ci].shared,
                                  out.metrics.ttft if out.metrics and out.metrics.ttft is not None else float("nan")))
            nxt = clients[ci].next(answers.pop(out.request_id))
            if nxt is not None:
                submit(ci, turn + 1, nxt)
    return records, time.perf_counter() - t0


def chat_clients(conversations: int, turns: int, system: int, user: int, seed: int = 0) -> list[Client]:
    sys_prompt = rand_tokens(system, seed)

    def make(ci: int) -> Client:
        state = {"hist": list(sys_prompt), "turn": 0}

        def nxt(answer: list[int] | None) -> list[int] | None:
            if answer is not None:
                state["hist"] += answer
            if state["turn"] == turns:
                return None
            state["hist"] += rand_tokens(user, seed * 1000 + ci * 100 + state["turn"] + 1)
            state["turn"] += 1
            return list(state["hist"])
        return Client(nxt, shared=system)
    return [make(ci) for ci in range(conversations)]


def rag_clients(questions: int, document: int, question: int, seed: int = 1) -> list[Client]:
    doc = rand_tokens(document, seed)

    def make(qi: int) -> Client:
        q = rand_tokens(question, seed * 1000 + qi + 1)
        q[0] = (doc[-1] + 1 + qi) % VOCAB  # every question diverges from the others at its first token
        sent = {"done": False}

        def nxt(answer: list[int] | None) -> list[int] | None:
            if sent["done"]:
                return None
            sent["done"] = True
            return doc + q
        return Client(nxt, shared=document)
    return [make(qi) for qi in range(questions)]


def summarize(records: list[Record], wall: float, eng, answer_tokens: int) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    follow = [r for r in records if r.turn > 0]
    later = sorted(records, key=lambda r: (r.turn, r.client))[2:]  # from the third request on
    ttft = [r.ttft_s for r in records]
    out = {
        "requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate_tokens": round(cached / prompt, 4) if prompt else 0.0,
        "shared_reuse_from_third_request": round(
            sum(min(r.cached_tokens, r.shared_tokens) for r in later) / max(1, sum(r.shared_tokens for r in later)), 4),
        "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
        "wall_s": round(wall, 2),
    }
    first_turn = sorted((r for r in records if r.turn == 0), key=lambda r: r.client)[2:]
    if first_turn and follow:   # chat: the system prompt's reuse by first turns, from the third conversation on
        out["first_turn_shared_reuse_from_third"] = round(
            sum(min(r.cached_tokens, r.shared_tokens) for r in first_turn) / sum(r.shared_tokens for r in first_turn), 4)
    if follow:
        prev_tokens = {(r.client, r.turn): r.prompt_tokens for r in records}
        reuse = [r.cached_tokens / (prev_tokens[(r.client, r.turn - 1)] + answer_tokens)
                 for r in follow if (r.client, r.turn - 1) in prev_tokens]
        out.update(follow_up_ttft_p50_s=round(percentile([r.ttft_s for r in follow], 50), 4),
                   follow_up_ttft_p99_s=round(percentile([r.ttft_s for r in follow], 99), 4),
                   follow_up_reuse_of_previous_turn_min=round(min(reuse), 4) if reuse else None)
    kv = eng.kv
    if kv.enabled:
        out.update(snapshots_saved=dict(kv.saved_by_kind), tokens_hit_by_snapshot=dict(kv.hits_by_kind),
                   snapshot_slots=kv.snapshots.capacity,
                   snapshot_mib=round(kv.snapshots.nbytes() / kv.snapshots.capacity / 2**20, 4))
    return out


#: engine settings per design; ``small_pool`` sizes the snapshot pool to the clients in flight + 2
DESIGNS = {
    "off": {"enable_prefix_caching": False},
    "default": {},
    "no_junction": {"prefix_cache_snapshot_points": "request_end,preempted,prompt_end"},
    "no_prompt_end": {"prefix_cache_snapshot_points": "request_end,preempted,junction"},
    "interval_4": {"prefix_cache_checkpoint_interval": 4},
    "small_pool": {"small_pool": True},
    "small_pool_no_prompt_end": {"small_pool": True, "prefix_cache_snapshot_points": "request_end,preempted,junction"},
}


def cmd_workloads(a: argparse.Namespace) -> dict:
    from glm5.cache.snapshot_pool import StateSnapshotPool
    from glm5.engine import EngineArgs, LLMEngine
    from glm5.tiny_checkpoint import ensure_default_checkpoint

    model = a.model or str(ensure_default_checkpoint())
    base = dict(model=model, device=a.device, block_size=a.block_size, max_num_seqs=a.concurrency,
                max_num_batched_tokens=a.max_num_batched_tokens, load_progress=False,
                max_model_len=max(a.system_tokens + a.turns * (a.user_tokens + a.answer_tokens),
                                  a.document_tokens + a.question_tokens + a.answer_tokens) + 64,
                num_cache_blocks=a.num_cache_blocks, prefix_cache_snapshot_memory_gb=a.snapshot_memory_gb)
    patterns = {
        "chat": lambda: chat_clients(a.conversations, a.turns, a.system_tokens, a.user_tokens),
        "rag": lambda: rag_clients(a.questions, a.document_tokens, a.question_tokens),
    }
    probe = LLMEngine(EngineArgs(**base))
    per_snapshot = StateSnapshotPool.bytes_per_snapshot(probe.runner.cache)
    del probe
    results: dict = {}
    for pname, make_clients in patterns.items():
        if a.only and pname not in a.only:
            continue
        results[pname] = {}
        concurrency = a.concurrency if pname == "chat" else a.rag_concurrency
        for dname in a.designs:
            settings = {**base, **DESIGNS[dname]}
            if settings.pop("small_pool", False):
                settings["prefix_cache_snapshot_memory_gb"] = (concurrency + 2.5) * per_snapshot / 2**30
            eng = LLMEngine(EngineArgs(**settings))
            records, wall = run_clients(eng, make_clients(), concurrency, a.answer_tokens)
            results[pname][dname] = summarize(records, wall, eng, a.answer_tokens)
            print(f"{pname:5s} {dname:14s} {json.dumps(results[pname][dname])}", flush=True)
            del eng
    return results


# ---------------------------------------------------------------------------------------------
# follow-up TTFT on the bench config
# ---------------------------------------------------------------------------------------------
def bench_config(tiny: bool) -> dict:
    if tiny:
        from glm5.tiny_checkpoint import make_tiny_checkpoint
        with tempfile.TemporaryDirectory() as d:
            return json.loads((make_tiny_checkpoint(Path(d) / "ckpt") / "config.json").read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import bench_config_dict  # the H200 bench config of bench/bench.py
    return bench_config_dict()


def cmd_followup(a: argparse.Namespace) -> dict:
    from glm5.config import ModelConfig
    from glm5.engine import EngineArgs, LLMEngine
    from glm5.weights import dummy_weights

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg_dict = bench_config(a.tiny)
    cfg_dict["text_config"]["num_nextn_predict_layers"] = 0
    tmp = tempfile.TemporaryDirectory(prefix="prefix_bench_")   # holds config.json only (no weights)
    work = Path(tmp.name)
    (work / "config.json").write_text(json.dumps(cfg_dict))
    cfg = ModelConfig.from_pretrained(str(work))
    weights = dummy_weights(cfg, device, dtype, include_mtp=False)
    vocab = min(cfg.text.vocab_size, 150000)
    total = a.history + a.answer_tokens + a.user_tokens
    runs: dict = {}
    for name, on in (("off", False), ("on", True)):
        eng = LLMEngine(EngineArgs(model=str(work), device=device, dtype=str(dtype).replace("torch.", ""),
                                   block_size=64, max_num_seqs=4, max_model_len=total + 64,
                                   max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=on,
                                   load_progress=False, cache_memory_gb=a.cache_memory_gb), weights=weights)
        from glm5.sampling_params import SamplingParams
        answer = SamplingParams(temperature=0.0, max_tokens=a.answer_tokens, ignore_eos=True)
        first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ttfts, cached = [], []
        for rep in range(a.reps + 1):  # rep 0 warms up (kernel compilation, allocator)
            hist = rand_tokens(a.history, 100 + rep, vocab)
            turn1 = eng.generate([hist], answer)[0]
            follow = hist + turn1.token_ids + rand_tokens(a.user_tokens, 200 + rep, vocab)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            out = eng.generate([follow], first_token)[0]
            if rep:
                ttfts.append(out.metrics.ttft)
                cached.append(out.num_cached_tokens)
        runs[name] = {"ttft_s": [round(t, 5) for t in ttfts], "ttft_median_s": round(statistics.median(ttfts), 5),
                      "num_cached_tokens": cached, "prompt_tokens": total}
        if on:
            runs[name]["snapshot_mib"] = round(eng.kv.snapshots.nbytes() / eng.kv.snapshots.capacity / 2**20, 2)
        print(f"followup cache {name}: {json.dumps(runs[name])}", flush=True)
        del eng
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    tmp.cleanup()
    speedup = runs["off"]["ttft_median_s"] / runs["on"]["ttft_median_s"]
    t = cfg.text
    return {"config": "tiny" if a.tiny else "h200 bench config (real per-layer shapes, 8 layers, dummy bf16 weights)",
            "layers": {"kda": len(t.kda_layer_ids), "mla": len(t.mla_layer_ids)}, "device": device,
            "dtype": str(dtype), "history_tokens": a.history, "answer_tokens": a.answer_tokens,
            "user_tokens": a.user_tokens, "runs": runs, "ttft_speedup": round(speedup, 2), "target_speedup": 5.0,
            "meets_target": speedup >= 5.0}


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workloads", help="chat and RAG hit rates and TTFT, cache off vs on (snapshot designs)")
    w.add_argument("--model", help="checkpoint (default: the tiny checkpoint)")
    w.add_argument("--device", default="cpu")
    w.add_argument("--conversations", type=int, default=16)
    w.add_argument("--turns", type=int, default=6)
    w.add_argument("--system-tokens", type=int, default=2048)
    w.add_argument("--user-tokens", type=int, default=48)
    w.add_argument("--answer-tokens", type=int, default=16)
    w.add_argument("--concurrency", type=int, default=16, help="chat clients in flight (max_num_seqs)")
    w.add_argument("--questions", type=int, default=24)
    w.add_argument("--document-tokens", type=int, default=2000, help="RAG document (2000 = 31 blocks of 64 + 16)")
    w.add_argument("--question-tokens", type=int, default=24)
    w.add_argument("--rag-concurrency", type=int, default=4)
    w.add_argument("--block-size", type=int, default=64)
    w.add_argument("--max-num-batched-tokens", type=int, default=2048)
    w.add_argument("--num-cache-blocks", type=int, default=None)
    w.add_argument("--snapshot-memory-gb", type=float, default=1.0)
    w.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    w.add_argument("--only", nargs="+", choices=["chat", "rag"], help="run only these patterns")
    w.add_argument("--out", type=Path, required=True)
    f = sub.add_parser("followup", help="TTFT of a follow-up turn over a long history, cache off vs on")
    f.add_argument("--device", default="auto")
    f.add_argument("--tiny", action="store_true", help="the tiny checkpoint's shapes instead of the H200 bench config")
    f.add_argument("--history", type=int, default=8192)
    f.add_argument("--answer-tokens", type=int, default=64)
    f.add_argument("--user-tokens", type=int, default=64)
    f.add_argument("--reps", type=int, default=3)
    f.add_argument("--max-num-batched-tokens", type=int, default=2048)
    f.add_argument("--cache-memory-gb", type=float, default=4.0)
    f.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    results = cmd_workloads(a) if a.cmd == "workloads" else cmd_followup(a)
    doc = {"benchmark": f"prefix_cache_bench {a.cmd}", "date_utc": started.isoformat(timespec="seconds"),
           "command": "python bench/prefix_cache_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": info, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
