"""The full GLM-5.3-Flash on N GPUs: 45 decoder layers + MTP at real shapes, dummy weights made on each rank.

One command (issue 19's run) on a machine with N GPUs::

    python bench/multigpu.py --gpus 8 --layout tp --weight-dtype fp8 --out bench/results/results_multigpu.json
    python bench/multigpu.py --gpus 8 --layout ep ...        # experts EP = N, attention TP = N

It builds the engine through the distributed executor (rank 0 here, one worker per other GPU) with
``load_format=dummy``: every rank makes only its shard of random weights, directly on its GPU (no host copy of the
model; fp8 = e4m3 with 128×128 block scales, the checkpoint's format), and measures in one run:

* load / initialisation time per rank; memory per rank (weights, caches, KDA state slots, decode graphs, the
  CUDA allocator's totals);
* decode step time and tok/s at batch 1/8/64/256 × context 1K/8K/32K with CUDA graphs (rows whose cache does not
  fit the rank are recorded as skipped), with the step's roofline on rank 0 (bytes the rank must move ÷ the copy
  bandwidth measured on this machine) and the communication share of an eager step (profile: NCCL kernels);
* prefill 8K / 32K tok/s and TFLOP/s against the measured bf16 matmul peak × N;
* an MTP k=3 step (verification of 4 rows per request + 3 draft steps) against a plain step;
* optionally (``--serve``) the same model behind a real ``tritonserver`` (``glm5 serve``) under the project's load
  client at concurrency 1/16/64: TTFT, ITL, tok/s.

Writes ``--out`` (fields: ``gpus``, ``num_hidden_layers``, ``weight_dtype``, ``tensor_parallel_size``,
``expert_parallel``, ``decode`` rows with ``batch``, ``ctx``, ``step_s``, ``tok_s``, ``bytes``; ``prefill`` rows with
``tokens``, ``time_s``, ``tflops``; ``init``, ``memory``, ``mtp``, ``serve``, ``ceilings``), and ``--render`` turns it
into markdown + a plot (``RESULTS_MULTIGPU.md``, ``decode_multigpu.png`` beside it).

Dry run (no GPU): ``python bench/multigpu.py --device cpu --gpus 1 --layers 2 --tiny-shapes --out /tmp/m.json``
runs every stage at world size 1 on the CPU (gloo, no graphs) with the tiny checkpoint's shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


# --------------------------------------------------------------------------------------------------------- config
def full_config(layers: int, tiny: bool) -> dict:
    """The real config (tests/fixtures) with its first ``layers`` layers + the MTP layer; ``tiny``: the tiny
    checkpoint's shapes instead (CPU dry run)."""
    if tiny:
        from glm5.tiny_checkpoint import ensure_default_checkpoint
        d = json.loads((Path(ensure_default_checkpoint()) / "config.json").read_text())
    else:
        d = json.loads((ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json").read_text())
    t = d["text_config"]
    n_full = t["num_hidden_layers"]
    lt = t.get("layer_types") or ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n_full)]
    mt = t.get("mlp_layer_types") or ["dense"] * 3 + ["sparse"] * (n_full - 3)
    lt = [lt[i % len(lt)] for i in range(layers)]
    mt = [mt[i] if i < len(mt) else "sparse" for i in range(layers)]
    if layers >= 2 and "sparse" not in mt:
        mt[-1] = "sparse"
    t.update(num_hidden_layers=layers, layer_types=lt, mlp_layer_types=mt, num_nextn_predict_layers=1)
    lac = dict(t.get("linear_attn_config") or {})
    lac["kda_layers"] = [i for i, k in enumerate(lt) if k == "linear_attention"]
    lac["full_attn_layers"] = [i for i, k in enumerate(lt) if k != "linear_attention"]
    t["linear_attn_config"] = lac
    t.pop("index_topk_pattern", None)
    d.pop("vision_config", None)
    return d


def write_model_dir(cfg: dict, out: Path) -> Path:
    """config.json + the tiny checkpoint's tokenizer files (the load client sends text; ids it does not know
    decode to nothing) — no weights: the engine makes them (load_format=dummy)."""
    from glm5.tiny_checkpoint import ensure_default_checkpoint
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    src = Path(ensure_default_checkpoint())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


# --------------------------------------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


class RoutingRecorder:
    """Unique experts per MoE layer call on rank 0 (routing is replicated, so rank 0 sees every rank's pairs)."""

    def __init__(self):
        from glm5.layers import moe as moe_mod
        self.mod, self.orig, self.calls = moe_mod, moe_mod.route, []

        def hook(*a, **kw):
            r = self.orig(*a, **kw)
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                self.calls.append(r.experts.reshape(-1).unique().tolist())
            return r
        moe_mod.route = hook

    def close(self) -> None:
        self.mod.route = self.orig


def decode_bytes(cfg, pc, weight_format: str, b: int, ctx: int, touched: list[list[int]], elem: int = 2) -> dict:
    """Bytes rank 1 (every rank but the driver: no vision) must move for one decode step: its non-routed weights,
    its part of the touched routed experts, its KDA states (read + write), the selected latent rows and the
    pooled keys its indexer scans."""
    from glm5.distributed import Ranks
    from glm5.distributed.eplb import initial_placement
    from glm5.weights.memory_plan import rank_weight_bytes
    t = cfg.text
    rank = Ranks.of(min(1, pc.world_size - 1), pc)
    w = rank_weight_bytes(cfg, pc, weight_format, rank.rank)
    nonrouted = w.total - w.parts["routed experts"] - w.parts["embedding + LM head"] / 2  # the embedding is a gather
    n_moe = sum(1 for k in t.mlp_kinds if k == "moe") + 1
    per_expert = w.parts["routed experts"] / (n_moe * (pc.num_physical_experts(t.n_routed_experts) // pc.expert_parallel_size
                                                         if pc.expert_parallel else t.n_routed_experts))
    if pc.expert_parallel:
        p2l = initial_placement(t.n_routed_experts, pc.num_redundant_experts)
        per = len(p2l) // pc.expert_parallel_size
        mine = set(p2l[rank.ep_rank * per:(rank.ep_rank + 1) * per])
        routed = sum(len(set(c) & mine) for c in touched) * per_expert
    else:
        routed = sum(len(c) for c in touched) * per_expert
    heads = t.linear_num_heads // pc.tensor_parallel_size
    mla = len(t.mla_layer_ids)
    parts = {"weights_nonrouted": nonrouted, "weights_routed": routed,
             "kda_state": len(t.kda_layer_ids) * b * 2 * (heads * t.linear_head_dim ** 2 * 4 + (t.linear_conv_kernel_dim - 1)
                                                         * 3 * heads * t.linear_head_dim * elem),
             "mla_latent": mla * b * min(ctx + 1, t.index_topk + t.index_kpool - 1) * t.kv_lora_rank * elem,
             "index_pool_keys": mla * b * ((ctx + 1) // t.index_kpool) * t.index_head_dim * elem}
    parts["total"] = sum(parts.values())
    return parts


def prefill_flops(cfg, n: int) -> float:
    """FLOPs of an ``n``-token prefill of the whole model (one device's worth): 2 × active parameters per token
    (every non-routed matrix, ``num_experts_per_tok`` routed experts, the LM head on the last row) + MLA
    attention over the selected tokens + the indexer's scores."""
    from glm5.weights import expected_weight_shapes
    t = cfg.text
    per_tok = 0
    for name, shape in expected_weight_shapes(cfg, include_mtp=False).items():
        if len(shape) < 2 or name in ("embed_tokens.weight", "lm_head.weight") or name.startswith("visual."):
            continue
        if ".mlp.experts." in name:
            per_tok += math.prod(shape[1:]) * t.num_experts_per_tok
        else:
            per_tok += math.prod(shape)
    flops = 2 * per_tok * n + 2 * t.vocab_size * t.hidden_size
    sel = t.index_topk + t.index_kpool - 1
    pairs = n * (n + 1) // 2 if n <= sel else sel * (sel + 1) // 2 + (n - sel) * sel
    mla = len(t.mla_layer_ids)
    flops += mla * 2 * t.num_attention_heads * (t.qk_head_dim + t.v_head_dim) * pairs
    flops += mla * 2 * t.index_n_heads * t.index_head_dim * (n * (n + 1) // 2) / t.index_kpool
    return float(flops)


class _Seq:
    """What the MTP packer reads from a request (block table, state slot)."""

    def __init__(self, block_table: list[int], state_slot: int):
        self.block_table, self.state_slot = block_table, state_slot


# --------------------------------------------------------------------------------------------------------- stages
def run(args) -> dict:
    from glm5.config import ModelConfig
    from glm5.engine import EngineArgs, LLMEngine
    from glm5.engine.cuda_graph import DecodeRows
    from glm5.engine.model_runner import ChunkSpec, PackedStep

    device = torch.device(args.device)
    cfg_d = full_config(args.layers, args.tiny_shapes)
    tmp = Path(tempfile.mkdtemp(prefix="glm5-multigpu-"))
    mdir = write_model_dir(cfg_d, tmp / "model")
    cfg = ModelConfig.from_pretrained(mdir)
    bs = 64
    batches, ctxs = args.batches, args.ctxs
    max_ctx = max(max(ctxs), max(args.prefill))
    blocks_per_req = -(-(max_ctx + 2 * bs) // bs)
    layout = dict(tensor_parallel_size=args.gpus, enable_expert_parallel=args.layout == "ep")
    fp8 = args.weight_dtype == "fp8"
    if fp8 and "quantization" not in EngineArgs.__dataclass_fields__:
        raise SystemExit("--weight-dtype fp8 needs the fp8 weight path (EngineArgs.quantization, issue 17); use "
                         "--weight-dtype bf16")
    ekw = dict(model=str(mdir), load_format="dummy", device=args.device,
               dtype="bfloat16" if device.type == "cuda" else "float32", block_size=bs,
               num_cache_blocks=args.cache_blocks, max_num_seqs=max(batches), max_model_len=max_ctx + 2 * bs,
               max_num_batched_tokens=args.chunk, num_speculative_tokens=3, decode_path="batched",
               cuda_graph_max_batch=max(batches), distributed=True, load_progress=False, **layout)
    if fp8:
        ekw["quantization"] = "fp8"
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "gpus": args.gpus, "num_hidden_layers": args.layers, "mtp_layers": 1,
                 "weight_dtype": args.weight_dtype, "tensor_parallel_size": args.gpus,
                 "expert_parallel": args.layout == "ep", "tiny_shapes": args.tiny_shapes}
    if device.type == "cuda":
        from bench import ceilings
        res["ceilings"] = ceilings()
    t0 = time.perf_counter()
    eng = LLMEngine(EngineArgs(**ekw))
    res["init"] = {"engine_s": time.perf_counter() - t0}
    runner = eng.runner
    try:
        res["memory"] = runner.call_all("memory_report")
        res["init"]["ranks"] = [{"rank": m["rank"], "load_s": m["load_s"], "init_s": m["init_s"]} for m in res["memory"]]
        runner.call_all("fill_cache_random", 0)
        n_blocks = eng.runner.cache.cache_cfg.num_blocks
        res["decode"] = []
        rec = RoutingRecorder()
        pc = eng.args.parallel_config
        for ctx in ctxs:
            for b in batches:
                need = b * (-(-(ctx + 2) // bs))
                if need > n_blocks:
                    res["decode"].append({"batch": b, "ctx": ctx, "skipped": f"needs {need} cache blocks, the rank "
                                          f"has {n_blocks} (--cache-blocks)"})
                    continue
                per = -(-(ctx + 2) // bs)
                rows = DecodeRows(tokens=[(7 * i) % cfg.text.vocab_size for i in range(b)], positions=[ctx] * b,
                                  state_slots=list(range(b)),
                                  block_tables=[list(range(i * per, (i + 1) * per)) for i in range(b)])
                try:
                    rec.calls.clear()
                    prof = runner.call_all("profile_decode", rows)    # eager, every rank, records the routing
                    touched = list(rec.calls)
                    times = timed(lambda: runner.run_decode_step(rows), device, args.reps, warmup=2)
                    step = median(times)
                    byt = decode_bytes(cfg, pc, args.weight_dtype, b, ctx, touched,
                                       elem=2 if device.type == "cuda" else 4)
                    row = {"batch": b, "ctx": ctx, "step_s": step, "tok_s": b / step, "steps": times,
                           "graph": runner.graphs is not None and runner.graphs.bucket_for(b) is not None,
                           "bytes": byt, "experts_touched": [len(c) for c in touched],
                           "eager_kernel_s": max(p["kernel_s"] for p in prof),
                           "eager_comm_s": max(p["comm_s"] for p in prof)}
                    if "ceilings" in res:
                        row["roofline_s"] = byt["total"] / res["ceilings"]["copy_bw_Bps"]
                        row["vs_roofline"] = step / row["roofline_s"]
                except Exception as e:  # record and go on: one size must not hide the others
                    row = {"batch": b, "ctx": ctx, "error": f"{type(e).__name__}: {str(e)[:300]}",
                           "trace": traceback.format_exc()[-1200:]}
                print(json.dumps({k: v for k, v in row.items() if k not in ("steps", "trace")})[:300], flush=True)
                res["decode"].append(row)
        rec.close()
        res["prefill"] = []
        for n in args.prefill:
            def prefill(n=n):
                runner.reset_slot(0)
                for lo in range(0, n, args.chunk):
                    m = min(args.chunk, n - lo)
                    runner.run_packed(PackedStep(input_ids=[(3 * j) % cfg.text.vocab_size for j in range(m)],
                                                 positions=list(range(lo, lo + m)),
                                                 chunks=[ChunkSpec(0, m, lo, list(range(blocks_per_req)), 0)],
                                                 logits_rows=[m - 1]))
            try:
                times = timed(prefill, device, 1 if n > 8192 else 2, warmup=1)
                t = median(times)
                fl = prefill_flops(cfg, n)
                row = {"tokens": n, "chunk": args.chunk, "time_s": t, "tok_s": n / t, "tflops": fl / t / 1e12}
                if "ceilings" in res:
                    row["vs_peak_x_gpus"] = fl / t / (res["ceilings"]["matmul_bf16_flops"] * args.gpus)
            except Exception as e:
                row = {"tokens": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row)[:300], flush=True)
            res["prefill"].append(row)
        res["mtp"] = run_mtp(runner, cfg, device, args, bs)
    finally:
        eng.shutdown()
    if args.serve:
        res["serve"] = run_serve(mdir, ekw, args)
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def run_mtp(runner, cfg, device, args, bs: int) -> list[dict]:
    """Per batch at ``--mtp-ctx``: a plain decode step against an MTP k=3 step (the target verifies 4 rows per
    request, the MTP layer drafts 3 tokens one row at a time), as the engine runs them."""
    from glm5.engine.cuda_graph import DecodeRows
    from glm5.engine.model_runner import ChunkSpec, PackedStep
    out = []
    ctx, k = args.mtp_ctx, 3
    per = -(-(ctx + k + 2) // bs)
    for b in args.mtp_batches:
        if b * per > runner.cache.cache_cfg.num_blocks:
            out.append({"batch": b, "ctx": ctx, "skipped": "cache too small"})
            continue
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        rows = DecodeRows(tokens=[5] * b, positions=[ctx] * b, state_slots=list(range(b)), block_tables=tables)
        verify = PackedStep(input_ids=[5] * (b * (k + 1)), positions=[p for _ in range(b) for p in range(ctx, ctx + k + 1)],
                            chunks=[ChunkSpec(i * (k + 1), k + 1, ctx, tables[i], i, record_states=True) for i in range(b)],
                            logits_rows=list(range(b * (k + 1))))
        seqs = [_Seq(tables[i], i) for i in range(b)]
        hidden = torch.zeros(b, cfg.text.hidden_size, device=device,
                             dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

        def spec_step():
            runner.run_packed(verify)
            h, shared = hidden, {}
            for j in range(k):
                _, h = runner.mtp_forward([(s, ctx + j, [5]) for s in seqs], h, [True] * b, shared)
        try:
            plain = median(timed(lambda: runner.run_decode_step(rows), device, args.reps, warmup=2))
            spec = median(timed(spec_step, device, max(2, args.reps // 2), warmup=1))
            out.append({"batch": b, "ctx": ctx, "k": k, "plain_step_s": plain, "mtp_step_s": spec,
                        "ratio": spec / plain, "break_even_accepted_tokens": spec / plain - 1})
        except Exception as e:
            out.append({"batch": b, "ctx": ctx, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(out[-1])[:300], flush=True)
    return out


def run_serve(mdir: Path, ekw: dict, args) -> list[dict]:
    """The same model behind tritonserver (glm5 serve's machinery), the project's load client per concurrency."""
    import asyncio

    from glm5.serving.launcher import TritonServerProcess
    from glm5_client.bench import run_bench
    overrides = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in ekw.items()
                 if k not in ("model", "load_progress")}
    out = []
    try:
        with TritonServerProcess(model_dir=str(mdir), models=("glm5",), engine_overrides=overrides,
                                 ready_timeout_s=args.serve_timeout) as srv:
            for c in args.concurrency:
                rep = asyncio.run(run_bench(srv.grpc_url, "glm5", "Hello " * args.serve_prompt_words,
                                            num_requests=max(2 * c, 4), concurrency=c,
                                            sampling={"max_tokens": args.serve_max_tokens, "ignore_eos": True,
                                                      "temperature": 0.0}))
                out.append({"concurrency": c, **rep.as_dict()})
                print(json.dumps(out[-1])[:300], flush=True)
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {str(e)[:500]}"})
    return out


# --------------------------------------------------------------------------------------------------------- render
def render(res: dict) -> str:
    lines = [f"# GLM-5.3-Flash on {res['gpus']} × {res['device']}: {res['num_hidden_layers']} layers + MTP, "
             f"{res['weight_dtype']}, TP={res['tensor_parallel_size']}{', EP' if res['expert_parallel'] else ''}", "",
             f"{res['date']}, `{res['command']}`", ""]
    if res.get("tiny_shapes"):
        lines += ["**Dry run at the tiny checkpoint's shapes — not a measurement of the model.**", ""]
    init = res.get("init", {})
    lines += [f"Engine up in {init.get('engine_s', float('nan')):.1f} s; per rank load / init (s): " + ", ".join(
        f"{r['rank']}: {r['load_s']:.1f} / {r['init_s']:.1f}" for r in init.get("ranks", [])), "",
              "| rank | weights GiB | cache GiB | state slots GiB | graphs GiB | allocated GiB |", "|---:|---:|---:|---:|---:|---:|"]
    for m in res.get("memory", []):
        lines.append(f"| {m['rank']} | {m['weights'] / 2**30:.2f} | {m['cache'] / 2**30:.2f} | {m['state_slots'] / 2**30:.2f} "
                     f"| {m['graphs'] / 2**30:.2f} | {m.get('cuda_allocated', 0) / 2**30:.2f} |")
    lines += ["", "| batch | ctx | step ms | tok/s | roofline ms | × roofline | comm share (eager) |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.get("decode", []):
        if "step_s" not in r:
            lines.append(f"| {r['batch']} | {r['ctx']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        share = r["eager_comm_s"] / r["eager_kernel_s"] if r.get("eager_kernel_s") else float("nan")
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.2f} | {r['tok_s']:.0f} | "
                     f"{r.get('roofline_s', float('nan')) * 1e3:.2f} | {r.get('vs_roofline', float('nan')):.2f} | {share:.0%} |")
    lines += ["", "| prefill tokens | s | tok/s | TFLOP/s | of peak × GPUs |", "|---:|---:|---:|---:|---:|"]
    for r in res.get("prefill", []):
        if "time_s" in r:
            lines.append(f"| {r['tokens']} | {r['time_s']:.2f} | {r['tok_s']:.0f} | {r['tflops']:.1f} | "
                         f"{r.get('vs_peak_x_gpus', float('nan')):.1%} |")
    lines += ["", "| MTP k=3, batch | ctx | plain ms | MTP step ms | ratio |", "|---:|---:|---:|---:|---:|"]
    for r in res.get("mtp", []):
        if "ratio" in r:
            lines.append(f"| {r['batch']} | {r['ctx']} | {r['plain_step_s'] * 1e3:.2f} | {r['mtp_step_s'] * 1e3:.2f} | "
                         f"{r['ratio']:.2f} |")
    if res.get("serve"):
        lines += ["", "| concurrency | TTFT p50 s | ITL p50 ms | tok/s | errors |", "|---:|---:|---:|---:|---:|"]
        for r in res["serve"]:
            if "concurrency" in r:
                lines.append(f"| {r['concurrency']} | {(r['ttft_s'] or {}).get('p50', float('nan')):.3f} | "
                             f"{(r['itl_s'] or {}).get('p50', float('nan')) * 1e3:.1f} | {r['output_tokens_per_s']:.0f} | "
                             f"{r['errors']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for ctx in sorted({r["ctx"] for r in res.get("decode", []) if "step_s" in r}):
        rows = [r for r in res["decode"] if r["ctx"] == ctx and "step_s" in r]
        ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=f"ctx {ctx}")
        if rows and "roofline_s" in rows[0]:
            ax.plot([r["batch"] for r in rows], [r["batch"] / r["roofline_s"] for r in rows], ls="--", alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tok/s (dashed: roofline)")
    ax.set_title(f"{res['gpus']} GPUs, {res['weight_dtype']}, TP={res['tensor_parallel_size']}"
                 f"{' EP' if res['expert_parallel'] else ''}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 1, help="ranks = GPUs (TP = this)")
    ap.add_argument("--layout", choices=("tp", "ep"), default="tp", help="ep: experts EP = N, attention TP = N")
    ap.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--layers", type=int, default=45, help="decoder layers (45 = the model; the MTP layer is added)")
    ap.add_argument("--tiny-shapes", action="store_true", help="the tiny checkpoint's shapes (CPU dry run)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctxs", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--cache-blocks", type=int, default=16384, help="cache blocks of 64 tokens per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--mtp-batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--mtp-ctx", type=int, default=8192)
    ap.add_argument("--serve", action="store_true", help="also through tritonserver with the load client")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--serve-max-tokens", type=int, default=128)
    ap.add_argument("--serve-prompt-words", type=int, default=200)
    ap.add_argument("--serve-timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "results_multigpu.json")
    ap.add_argument("--render", type=Path, help="render this results JSON (markdown + plot beside it) and exit")
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(args.render.read_text())
        md = args.render.with_name("RESULTS_MULTIGPU.md")
        try:
            note = plot(res, args.render.with_name("decode_multigpu.png"))
        except Exception as e:  # noqa: BLE001 (no matplotlib / no decode rows: the tables still render)
            note = f"no plot: {e}"
        md.write_text(render(res) + "\n![decode](decode_multigpu.png)\n" if not note.startswith("no plot") else render(res))
        print(md)
        return 0
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
