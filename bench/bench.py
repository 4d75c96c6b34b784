"""Engine benchmark on one GPU at the real per-layer shapes of GLM-5.3-Flash with fewer layers.

Bench config: model-spec §1.1 shapes (hidden 4096, 64 MLA heads over a 512 latent, 64×128 KDA,
indexer 32×128 top-2048 kpool 4, 288 experts top-8 of 2048, mHC 4, vocab 154880) with 8 layers:
KDA,KDA,KDA,MLA,KDA,KDA,KDA,MLA and dense×3 + MoE×5, on random bf16 weights made on the GPU
(``glm5.weights.dummy_weights``), and the same weights block-quantized to fp8 (``--weight-dtypes``: every
projection e4m3 with 128 x 128 scales, what ``quantization=fp8`` loads; decode and prefill rows carry
``weight_dtype``). The weight-memory table of the full model per GPU at TP/EP 1/2/4/8 (computed from the real
config, ``glm5.weights.memory``) goes into the results as ``memory``.

Measured in the same run: device-to-device copy bandwidth and bf16 matmul peak (the ceilings);
decode step time at batch × context (the caches are filled with random values for the context
instead of being prefilled: a decode step's work depends on the cache sizes, not their contents);
the roofline time per decode step (bytes the step must move — non-routed text-model weights (the
vision tower and the embedding table are not streamed), the routed experts actually touched by this step's
routing, KDA state read+write, selected latent rows, pooled index keys scanned — over the measured copy
bandwidth; fp8 weights count one byte per weight plus their fp32 block scales); prefill throughput and achieved
TFLOP/s; and transformers' glm5_next decode at batch 1 and at the largest batch it survives, on the same
config (HF-initialised weights; its timing does not depend on weight values beyond routing), in a child
process of the same run once the engine has released the GPU.

Usage: ``python bench/bench.py --out DIR [--quick] [--profile-prefill] [--flashinfer] [--distributed]`` on a CUDA GPU;
writes ``DIR/results.json`` (schema: ``ceilings``, ``decode`` rows with ``bytes``, ``prefill`` rows, ``hf``,
``profiles``), the profiler tables ``DIR/profile_*.txt``, ``DIR/bench.log`` (one JSON line per measurement,
so a run cut short keeps what it measured) and ``DIR/decode.png`` when matplotlib imports.
``python bench/render_results.py DIR/results.json`` renders the markdown (``bench/results/`` holds the
recorded run; ``docs/benchmarks.md`` says how to update it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
LAYER_TYPES = ["linear_attention"] * 3 + ["deepseek_sparse_attention"] + ["linear_attention"] * 3 + \
    ["deepseek_sparse_attention"]
MLP_TYPES = ["dense"] * 3 + ["sparse"] * 5


def bench_config_dict() -> dict:
    d = json.loads((ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json").read_text())
    t = d["text_config"]
    t.update(num_hidden_layers=8, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES, num_nextn_predict_layers=0)
    t["linear_attn_config"] = {**t["linear_attn_config"],
                               "kda_layers": [i for i, k in enumerate(LAYER_TYPES) if k == "linear_attention"],
                               "full_attn_layers": [i for i, k in enumerate(LAYER_TYPES) if k != "linear_attention"]}
    for key in ("index_topk_pattern",):
        t.pop(key, None)
    return d


def timed(fn, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` ones, with the heap frozen as a serving
    process freezes it (glm5.heap: no full collection of the start-up objects inside a timed call)."""
    from glm5.heap import frozen_heap

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    with frozen_heap():
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB per buffer (several times the 60 MB L2)
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = median(timed(lambda: b.copy_(a), 10, 3))
    bw = 2 * n / t
    del a, b
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    m2 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = median(timed(lambda: m @ m2, 10, 3))
    return {"copy_bw_Bps": bw, "matmul_bf16_flops": 2 * 8192 ** 3 / t}


def _base_name(name: str) -> str:
    """The weight a tensor belongs to (an fp8 scale ``x_scale_inv`` belongs to ``x``)."""
    return name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name


def _outside_text_step(name: str) -> bool:
    """Weights a text forward does not stream: the embedding table (a gather of one row per token) and the
    vision tower (it runs on images only)."""
    return name == "embed_tokens.weight" or name.startswith("visual.")


def jsonl_logger(path: Path, echo_chars: int = 300) -> Callable[[object], None]:
    """A ``log(x)`` that appends ``x`` as one JSON line to ``path`` (flushed: a run cut short keeps what it
    measured) and echoes its first ``echo_chars`` characters to stdout (the bench tools' logs)."""
    f = path.open("w")

    def log(x: object) -> None:
        line = json.dumps(x, default=str)
        print(line[:echo_chars], flush=True)
        f.write(line + "\n")
        f.flush()

    return log


class Setup:
    """``par``: a :class:`glm5.distributed.ParallelContext` (``--distributed``: the model built and run through it)."""

    def __init__(self, max_batch: int, max_ctx: int, weight_dtype: str = "bfloat16", par=None,
                 max_prefill: int = 0):
        from glm5.cache.hybrid_cache import CacheConfig, HybridCache
        from glm5.config import ModelConfig
        from glm5.layers.glm5 import Glm5ForCausalLM
        from glm5.weights import dummy_weights
        from glm5.weights.names import SCALE_SUFFIX, is_fp8_linear_weight

        self.cfg = ModelConfig.from_dict(bench_config_dict())
        self.weight_dtype = weight_dtype
        t = self.cfg.text
        # fp8: each linear quantized as it is made (the 80 GB of bf16 weights never exist at once)
        self.weights = dummy_weights(self.cfg, "cuda", torch.bfloat16, include_mtp=False,
                                     quantize=is_fp8_linear_weight if weight_dtype == "float8_e4m3fn" else None)
        self.params = {n: w.numel() for n, w in self.weights.items() if not n.endswith(SCALE_SUFFIX)}
        self.par = par
        self.model = Glm5ForCausalLM(self.cfg, self.weights, par)
        self.bs = 64
        self.blocks_per_req = (max_ctx + 2 * self.bs) // self.bs
        # a prefill runs in slot 0 over blocks 0.. of its own length, which may exceed the decode context
        self.prefill_blocks = (max(max_prefill, max_ctx) + 2 * self.bs) // self.bs
        nb = max(max_batch * self.blocks_per_req, self.prefill_blocks)
        self.cache = HybridCache(t, CacheConfig(block_size=self.bs, num_blocks=nb, num_state_slots=max_batch),
                                 "cuda", torch.bfloat16)
        for d in (self.cache.latent, self.cache.pool_keys):
            for x in d.values():
                x.normal_()
        for x in self.cache.recurrent.values():
            x.normal_(0, 0.02)
        for x in self.cache.conv.values():
            x.normal_()
        # bytes a step moves per weight: fp8 stacks count their [E, ...] scales with them
        self.routed = [n for n in self.weights if _base_name(n).endswith(("experts.gate_proj", "experts.up_proj",
                                                                           "experts.down_proj"))]
        self.expert_bytes = sum(self.weights[n][0].numel() * self.weights[n].element_size() for n in self.routed
                                if n.startswith("layers.3."))
        # a text decode step reads neither the embedding table (one row gathered) nor the vision tower
        self.nonrouted_bytes = sum(w.numel() * w.element_size() for n, w in self.weights.items()
                                   if n not in self.routed and not _outside_text_step(n))
        # parameters (dtype-independent) for the FLOP count
        self.expert_params = sum(self.params[n] // t.n_routed_experts for n in self.params
                                 if n.startswith("layers.3.") and n.endswith(("experts.gate_proj", "experts.up_proj",
                                                                              "experts.down_proj")))
        self.nonrouted_params = sum(v for n, v in self.params.items()
                                    if not n.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))
                                    and not _outside_text_step(n))
        self.touched: list[int] = []
        from glm5.layers import moe as moe_mod
        orig = moe_mod.route

        # on only inside experts_touched(): the count (torch.unique) syncs the host, so a hook left on would add
        # a sync per MoE layer to every timed eager step and prefill
        self.recording = False

        def recording_route(*a, **kw):
            r = orig(*a, **kw)
            if self.recording and not torch.cuda.is_current_stream_capturing():
                self.touched.append(int(torch.unique(r.experts).numel()))
            return r
        moe_mod.route = recording_route
        self._restore = lambda: setattr(moe_mod, "route", orig)

    def experts_touched(self, step) -> list[int]:
        """Run ``step`` (one eager forward) with the routing hook on: the experts each MoE layer's routing touched.
        The hook is off again afterwards even if ``step`` raises."""
        self.touched.clear()
        self.recording = True
        try:
            step()
            torch.cuda.synchronize()
        finally:
            self.recording = False
        return list(self.touched)

    def close(self) -> None:
        """Undo the routing hook and drop every GPU tensor (so the HF model fits afterwards)."""
        self._restore()
        self.model = self.weights = self.cache = None

    def decode_bytes(self, b: int, ctx: int, touched: list[int]) -> dict:
        t = self.cfg.text
        kda_layers, mla_layers = len(t.kda_layer_ids), len(t.mla_layer_ids)
        d = t.linear_num_heads * t.linear_head_dim
        parts = {
            "weights_nonrouted": self.nonrouted_bytes + b * t.hidden_size * 2,
            "weights_routed": sum(touched) * self.expert_bytes,
            "kda_state": kda_layers * b * (t.linear_num_heads * t.linear_head_dim ** 2 * 4 * 2
                                           + (t.linear_conv_kernel_dim - 1) * 3 * d * 2 * 2),
            "mla_latent": mla_layers * b * min(ctx + 1, t.index_topk + t.index_kpool - 1) * t.kv_lora_rank * 2,
            "index_pool_keys": mla_layers * b * ((ctx + 1) // t.index_kpool) * t.index_head_dim * 2,
        }
        parts["total"] = sum(parts.values())
        return parts

    def prefill_flops(self, n: int) -> float:
        t = self.cfg.text
        act = self.nonrouted_params - t.vocab_size * t.hidden_size  # params touched per token except lm head
        act += 5 * t.num_experts_per_tok * self.expert_params
        flops = 2 * act * n + 2 * t.vocab_size * t.hidden_size  # lm head on the last row only
        sel = t.index_topk + t.index_kpool - 1
        pairs = n * (n + 1) // 2 if n <= sel else sel * (sel + 1) // 2 + (n - sel) * sel
        flops += 2 * t.num_attention_heads * (t.qk_head_dim + t.v_head_dim) * pairs * 2  # 2 MLA layers
        flops += 2 * 2 * t.index_n_heads * t.index_head_dim * sum(
            (i + 1) // t.index_kpool for i in range(0, n, 64)) * 64  # indexer scores (approx)
        return float(flops)


def decode_rows(s: "Setup", b: int, ctx: int):
    """``b`` requests at position ``ctx``, each holding the blocks the engine grants a request of that length
    (``ctx // block_size + 1``), so the kernels and the staging see the tables a real batch has."""
    from glm5.engine.cuda_graph import DecodeRows
    g = torch.Generator().manual_seed(b * 7 + ctx)
    held = ctx // s.bs + 1
    if held > s.blocks_per_req:
        raise ValueError(f"context {ctx} needs {held} blocks per request; the Setup has {s.blocks_per_req}")
    return DecodeRows(tokens=torch.randint(0, 150000, (b,), generator=g).tolist(), positions=[ctx] * b,
                      state_slots=list(range(b)),
                      block_tables=[list(range(i * s.blocks_per_req, i * s.blocks_per_req + held)) for i in range(b)])


def captured_decode(s: "Setup", b: int, ctx: int):
    """A CUDA graph of the batch-``b`` decode step alone, captured and replayed a few times on ``b`` requests at
    ``ctx``: ``(stager, planner, runner, rows, graph)``."""
    from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeGraphRunner, DecodeStager
    stager = DecodeStager(s.cache, b, s.blocks_per_req, torch.device("cuda"))
    planner = DecodeAttentionPlanner(s.cfg.text, b, torch.bfloat16, torch.device("cuda"))
    runner = DecodeGraphRunner(s.model, s.cache, stager, [b], prepare=planner)
    runner.capture()
    rows = decode_rows(s, b, ctx)
    for _ in range(5):
        runner.run(rows)
    torch.cuda.synchronize()
    return stager, planner, runner, rows, runner.graphs[b][0]


def graph_step_anatomy(captured, reps: int) -> dict:
    """Medians over ``reps`` steps of (a) host staging alone, (b) the graph replay's GPU span by CUDA events
    (its kernels plus the gaps between them), (c) the whole step as :func:`run_decode` times it."""
    stager, planner, runner, rows, graph = captured
    stage, replay, step = [], [], []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        t0 = time.perf_counter()
        stager.stage(rows, len(rows), planner)
        stage.append(time.perf_counter() - t0)
        ev0.record()
        graph.replay()
        ev1.record()
        torch.cuda.synchronize()
        replay.append(ev0.elapsed_time(ev1) / 1e3)
        t0 = time.perf_counter()
        runner.run(rows)
        torch.cuda.synchronize()
        step.append(time.perf_counter() - t0)
    return {"host_stage_ms": median(stage) * 1e3, "graph_replay_gpu_ms": median(replay) * 1e3,
            "step_ms": median(step) * 1e3}


def run_decode(s: "Setup", batches, ctxs, reps: int, log, graphs: bool = True) -> list[dict]:
    """Decode steps through the engine's batched path: eager (one launch per kernel) and replayed as a
    CUDA graph (what the engine runs), on the same staged inputs."""
    from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeGraphRunner, DecodeStager
    stager = DecodeStager(s.cache, max(batches), s.blocks_per_req, torch.device("cuda"))
    planner = DecodeAttentionPlanner(s.cfg.text, max(batches), torch.bfloat16, torch.device("cuda"))

    def staged(rows, b):
        return stager.stage(rows, b, planner)
    runner = None
    if graphs:
        try:
            runner = DecodeGraphRunner(s.model, s.cache, stager, sorted(batches), prepare=planner)
            t0 = time.perf_counter()
            runner.capture()
            log({"graphs_captured": sorted(batches), "capture_s": time.perf_counter() - t0})
        except Exception as e:
            log({"graphs_error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-1500:]})
            runner = None
            torch.cuda.synchronize()
    rows_out = []
    for ctx in ctxs:
        for b in batches:
            try:
                rows = decode_rows(s, b, ctx)
                batch = staged(rows, b)
                calls0 = s.par.collective_calls if s.par is not None else 0
                touched = s.experts_touched(lambda: s.model.forward(batch, s.cache))
                row = {"batch": b, "ctx": ctx, "weight_dtype": s.weight_dtype}
                if s.par is not None:
                    row["collectives_per_step"] = s.par.collective_calls - calls0
                eager = timed(lambda: s.model.forward(staged(rows, b), s.cache), reps, warmup=1)
                row.update(eager_step_s=median(eager), experts_touched=touched, bytes=s.decode_bytes(b, ctx, touched))
                if runner is not None:
                    step = runner.run if s.par is None else (
                        lambda r: (s.par.broadcast_object([("decode", r)]), runner.run(r)))
                    times = timed(lambda: step(rows), max(reps, 10), warmup=2)
                    row.update(step_s=median(times), steps=times, graph=True)
                else:
                    row.update(step_s=row["eager_step_s"], steps=eager, graph=False)
                row["tok_s"] = b / row["step_s"]
            except Exception as e:  # record and continue: an OOM at one size must not hide the rest
                row = {"batch": b, "ctx": ctx, "weight_dtype": s.weight_dtype,
                       "error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-1200:]}
                torch.cuda.empty_cache()
            log(row)
            rows_out.append(row)
    return rows_out


def run_decode_flashinfer(s: "Setup", batches, ctxs, log) -> list[dict]:
    """End-to-end decode (CUDA graphs) with each sparse-MLA decode backend, same weights and cache."""
    from glm5.layers import backends
    out = []
    for backend in ("triton", "flashinfer"):
        try:
            backends.set_backends(decode_attn=backend)
            for row in run_decode(s, batches, ctxs, reps=5, log=log):
                out.append({**row, "decode_attn": backend})
        except Exception as e:
            out.append({"decode_attn": backend, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(out[-1])
        finally:
            backends.set_backends(decode_attn="auto")
        gc.collect()
        torch.cuda.empty_cache()
    return out


def profile_decode(s: "Setup", b: int, ctx: int, out: Path) -> dict:
    """Kernel count and summed GPU kernel time of one eager batched decode step (the graph replays the same
    kernels), plus the top kernels."""
    from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeStager
    stager = DecodeStager(s.cache, b, s.blocks_per_req, torch.device("cuda"))
    planner = DecodeAttentionPlanner(s.cfg.text, b, torch.bfloat16, torch.device("cuda"))
    rows = decode_rows(s, b, ctx)

    def staged():
        return stager.stage(rows, b, planner)
    return {"batch": b, "ctx": ctx, "weight_dtype": s.weight_dtype,
            **kernel_profile(s, lambda: s.model.forward(staged(), s.cache),
                             out / f"profile_decode_b{b}_ctx{ctx}{_tag(s)}.txt")}


def _tag(s: "Setup") -> str:
    """File-name tag of the weight dtype (none for bf16, so the bf16 file names stay what they were)."""
    return "" if s.weight_dtype == "bfloat16" else "_fp8"


def kernel_profile(s: "Setup", fn, path: Path, rows: int = 30) -> dict:
    """Run ``fn`` once to warm up, once under the torch profiler; write the kernel table to ``path``."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    cuda_events = [e for e in ka if e.device_type.name == "CUDA"]
    table = ka.table(sort_by="self_cuda_time_total", row_limit=rows)
    path.write_text(table)
    return {"cuda_kernels": sum(e.count for e in cuda_events),
            "kernel_time_s": sum(e.self_device_time_total for e in cuda_events) / 1e6, "table": table}


def prefill_once(s: Setup, n: int, chunk: int, slot: int = 0) -> None:
    """One ``n``-token prompt (random ids) prefilled from an empty state slot in ``chunk``-token chunks."""
    from glm5.layers.batch import ForwardBatch, SeqChunk
    if n + 2 * s.bs > s.prefill_blocks * s.bs:
        raise ValueError(f"a {n}-token prefill needs more than the {s.prefill_blocks} blocks this Setup made; "
                         f"build it with max_prefill >= {n}")
    bt = torch.arange(0, s.prefill_blocks, device="cuda")
    s.cache.reset_slot(slot)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        s.model.forward(ForwardBatch(input_ids=torch.randint(0, 150000, (m,), device="cuda"),
                                     positions=torch.arange(lo, lo + m, device="cuda"),
                                     seqs=[SeqChunk(0, m, lo, bt, slot)],
                                     logits_indices=torch.full((1,), m - 1, device="cuda")), s.cache)


def run_prefill(s: Setup, lengths, chunk: int, log) -> list[dict]:
    rows = []
    for n in lengths:
        try:
            # two warm-ups: after one, consecutive 8K prefills took 1.55, 0.25, 0.21, 0.21, 0.21 s
            # (bench/results/step_anatomy.json), and a median of three after one warm-up reported 0.35 s
            times = timed(lambda: prefill_once(s, n, chunk), 3 if n <= 8192 else 1, warmup=2)
            t = median(times)
            fl = s.prefill_flops(n)
            row = {"tokens": n, "chunk": chunk, "weight_dtype": s.weight_dtype, "time_s": t, "tok_s": n / t,
                   "flops": fl, "tflops": fl / t / 1e12}
        except Exception as e:
            row = {"tokens": n, "weight_dtype": s.weight_dtype, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        log(row)
        rows.append(row)
    return rows


def profile_prefill(s: Setup, n: int, chunk: int, out: Path) -> dict:
    """Kernel table of one whole ``n``-token prefill (after a warm-up), grouped by kernel and by the torch op
    that launched it: the profile evidence of what limits prefill."""
    return {"tokens": n, "chunk": chunk, "weight_dtype": s.weight_dtype,
            **kernel_profile(s, lambda: prefill_once(s, n, chunk), out / f"profile_prefill_{n}{_tag(s)}.txt", rows=40)}


def run_hf(ctx: int, steps: int, log, batches=(1,), deadline: float | None = None) -> dict:
    """transformers' glm5_next decode on the bench config: batch 1, then each larger batch in ``batches``
    until one fails (OOM); after a failure, halve towards the last batch that ran, so the last row without
    an error is the largest batch it survives (the issue asks for batch 1 and that one). ``deadline``
    (``time.time()``): no batch is started after it (the batch-64 prefill alone takes minutes)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    cfg = Glm5NextConfig(**bench_config_dict())
    cfg.text_config._attn_implementation = "eager"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = Glm5NextForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    rows: list[dict] = []
    todo = list(batches)
    ok_max = 0
    while todo:
        b = todo.pop(0)
        if deadline is not None and time.time() > deadline:
            rows.append({"batch": b, "ctx": ctx, "skipped": "not started: the run's time limit was near"})
            log(rows[-1])
            break
        try:
            ids = torch.randint(0, 150000, (b, ctx), device="cuda")
            with torch.no_grad():
                t0 = time.perf_counter()
                out = hf(input_ids=ids, use_cache=True)
                torch.cuda.synchronize()
                prefill = time.perf_counter() - t0
                cache = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    out = hf(input_ids=nxt, past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    nxt = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            row = {"batch": b, "ctx": ctx, "prefill_s": prefill, "steps": times, "step_s": median(times[1:] or times)}
            row["tok_s"] = b / row["step_s"]
            ok_max = max(ok_max, b)
        except Exception as e:
            row = {"batch": b, "ctx": ctx, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            todo = [(ok_max + b) // 2] if (ok_max + b) // 2 > ok_max and b - ok_max > 1 else []
        finally:
            cache = out = None
            gc.collect()
            torch.cuda.empty_cache()
        log(row)
        rows.append(row)
    first = dict(rows[0])
    first["batches"] = rows
    first["largest_batch_survived"] = ok_max
    return first


def run_hf_subprocess(args, log) -> dict:
    """:func:`run_hf` in a child process of this run, after the engine has exited the GPU: the child starts
    with an empty allocator, and expandable segments let the batch-64 prefill reuse the fragments a first
    attempt leaves (without them it died with 33 GiB reserved but unallocated)."""
    import os
    import subprocess
    path = args.out / "results_hf_worker.json"
    cmd = [sys.executable, __file__, "--hf-worker", str(path), "--hf-batches", *map(str, args.hf_batches)]
    if args.hf_deadline:
        cmd += ["--hf-deadline", str(args.hf_deadline)]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not path.exists():
        res = {"error": f"transformers worker exited with {proc.returncode}"}
        log(res)
        return res
    return json.loads(path.read_text())


def nccl_world_of_one():
    """A ParallelContext over a one-rank NCCL world (plus the gloo control group): what the distributed
    executor builds, at world size 1."""
    import datetime
    import torch.distributed as dist

    from glm5.distributed import ParallelConfig
    from glm5.distributed.parallel_state import build_context, join_world
    from glm5.engine.worker_processes import free_port

    store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 1, is_master=True,
                          timeout=datetime.timedelta(seconds=60))
    backend, control = join_world(0, 1, torch.device("cuda", torch.cuda.current_device()), store)
    return build_context(ParallelConfig(), 0, backend, control)


def run_distributed(res: dict, batches, ctxs, weight_dtype: str, log) -> dict:
    """The bench config again through the distributed path at world size 1 (NCCL), after the plain run of the
    same process: the same decode rows and an 8K prefill, each against the plain run's number. Then the decode
    rows at the first context once more with the one-rank collectives launched (``collectives_at_size_one``:
    what each NCCL call costs inside the graph, the floor a TP > 1 step pays per collective)."""
    from glm5.distributed.parallel_state import destroy_parallel_context
    par = nccl_world_of_one()
    out: dict = {"world_size": 1, "backend": par.backend, "weight_dtype": weight_dtype}
    try:
        s = Setup(max(batches), max(ctxs), weight_dtype, par=par, max_prefill=8192)
        out["prefill"] = run_prefill(s, [8192], 4096, log)
        out["decode"] = run_decode(s, batches, ctxs, reps=3, log=log)
        par.collectives_at_size_one = True
        out["decode_collectives_launched"] = run_decode(s, batches, ctxs[:1], reps=3, log=log)
        for r in out["decode_collectives_launched"]:  # the per-step message alone (pickle + gloo broadcast)
            rows = decode_rows(s, r["batch"], r["ctx"])
            r["message_s"] = median(timed(lambda: par.broadcast_object([("decode", rows)]), 20, warmup=2))
        s.close()
    finally:
        destroy_parallel_context(par)
    plain = {(r["batch"], r["ctx"]): r for r in res.get("decode", [])
             if "step_s" in r and r.get("weight_dtype") == weight_dtype}
    for r in out["decode"] + out["decode_collectives_launched"]:
        p = plain.get((r.get("batch"), r.get("ctx")))
        if p is not None and "step_s" in r:
            r["vs_plain"] = r["step_s"] / p["step_s"]
            if r.get("collectives_per_step") and "message_s" in r:
                # collectives_per_step counts the model's collectives (an eager forward), not the step message
                n = r["collectives_per_step"]
                r["us_per_collective"] = (r["step_s"] - p["step_s"] - r["message_s"]) / n * 1e6
    pre = {r["tokens"]: r for r in res.get("prefill", []) if "time_s" in r and r.get("weight_dtype", weight_dtype) ==
           weight_dtype}
    for r in out["prefill"]:
        if r.get("tokens") in pre and "time_s" in r:
            r["vs_plain"] = r["time_s"] / pre[r["tokens"]]["time_s"]
    log({"distributed_summary": [(r.get("batch"), r.get("ctx"), r.get("vs_plain")) for r in out["decode"]]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--quick", action="store_true", help="batches 1, 8 and contexts 1K, 8K only")
    ap.add_argument("--batches", type=int, nargs="+", help="decode batches (default 1 8 64 256; --quick: 1 8)")
    ap.add_argument("--contexts", type=int, nargs="+",
                    help="decode contexts in tokens (default 1024 8192 32768; --quick: 1024 8192)")
    ap.add_argument("--prefill-tokens", type=int, nargs="+",
                    help="prefill lengths (default 1024 8192 32768; --quick: 1024 8192)")
    ap.add_argument("--prefill-chunks", type=int, nargs="+",
                    help="prefill chunk sizes, each a row per prompt (default: the engine's token budget on this GPU, "
                         "glm5.engine.args.default_max_num_batched_tokens: 8192 on an H200); the first is profiled")
    ap.add_argument("--skip-hf", action="store_true", help="do not run transformers' model")
    ap.add_argument("--profile-prefill", action="store_true", help="also profile one 8K prefill (kernel table)")
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[1, 64],
                    help="decode batches (of --batches) whose eager step gets a kernel table (default 1 64)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8, 64],
                    help="transformers decode batches, tried in order until one fails (then halved)")
    ap.add_argument("--hf-deadline", type=float, help="start no transformers batch after this time.time()")
    ap.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--decode-attn", choices=("triton", "flashinfer", "torch"), help="override the auto choice")
    ap.add_argument("--flashinfer", action="store_true", help="also time decode with decode_attn_backend=flashinfer")
    ap.add_argument("--hf-only", action="store_true", help="engine b1 ctx 1K, then transformers, same run")
    ap.add_argument("--distributed", action="store_true",
                    help="then the same decode rows and an 8K prefill through the distributed path at world size 1 "
                         "(one-rank NCCL groups), each against the plain number; then the decode rows with the "
                         "one-rank collectives and the step message launched anyway (their cost)")
    ap.add_argument("--weight-dtypes", default="bfloat16,float8_e4m3fn",
                    help="comma-separated weight storage to measure, in order (bfloat16, float8_e4m3fn)")
    args = ap.parse_args()
    if args.hf_worker:
        rows_log = args.hf_worker.with_suffix(".jsonl").open("w")

        def hf_log(x):  # every row on disk at once: a run cut by its time limit keeps the rows it has
            print(json.dumps(x, default=str)[:400], flush=True)
            rows_log.write(json.dumps(x, default=str) + "\n")
            rows_log.flush()
        res = run_hf(1024, 6, hf_log, args.hf_batches, args.hf_deadline)
        args.hf_worker.write_text(json.dumps(res, indent=1, default=str))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = jsonl_logger(args.out / "bench.log", echo_chars=400)

    from glm5.layers import backends
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "config": bench_config_dict()["text_config"],
           "backends": {name: fn(torch.device("cuda")) for name, fn in (
               ("kda", lambda d: backends.kda_backend(d, torch.bfloat16)),
               ("kda_decode_step", lambda d: backends.kda_step_backend(d, torch.bfloat16, decode=True)),
               ("prefill_attn", backends.attn_backend),
               ("decode_attn", lambda d: backends.decode_attn_backend(d, torch.bfloat16, 512)),
               ("index", backends.index_backend), ("moe", backends.moe_backend),
               ("fp8_linear", backends.fp8_linear_backend))}}
    from glm5_kernels.pdl import pdl_enabled
    res["backends"]["pdl"] = pdl_enabled(torch.device("cuda"))   # programmatic launch: on by default, GLM5_PDL=0 off
    from glm5.config import ModelConfig
    from glm5.weights.memory import memory_table
    res["memory"] = memory_table(ModelConfig.from_dict(json.loads(
        (ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json").read_text())))
    res["ceilings"] = ceilings()
    log(res)
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 64, 256])
    ctxs = args.contexts or ([1024, 8192] if args.quick else [1024, 8192, 32768])
    prefill_lens = args.prefill_tokens or ([1024, 8192] if args.quick else [1024, 8192, 32768])
    from glm5.engine.args import default_max_num_batched_tokens
    chunks = args.prefill_chunks or [default_max_num_batched_tokens(torch.device("cuda"))]
    if args.hf_only:
        s = Setup(1, 1024)
        res["decode"] = run_decode(s, [1], [1024], reps=5, log=log)
        res["profiles"] = [profile_decode(s, 1, 1024, args.out)]
        s.close()
        del s
        gc.collect()
        torch.cuda.empty_cache()
        res["hf"] = run_hf_subprocess(args, log)
        (args.out / "results_hf.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.decode_attn:
        backends.set_backends(decode_attn=args.decode_attn)
        res["backends"]["decode_attn"] = backends.decode_attn_backend(torch.device("cuda"), torch.bfloat16, 512)
    dtypes = [d.strip() for d in args.weight_dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("bfloat16", "float8_e4m3fn")]
    if bad:
        raise SystemExit(f"--weight-dtypes: unknown {bad}; use bfloat16 and/or float8_e4m3fn")
    res.update(prefill=[], decode=[], profiles=[], weights_bytes={})
    for wdt in dtypes:
        s = Setup(max(batches), max(ctxs), wdt, max_prefill=max(prefill_lens))
        res["weights_bytes"][wdt] = {"nonrouted": s.nonrouted_bytes, "per_expert": s.expert_bytes}
        log({"weight_dtype": wdt, **res["weights_bytes"][wdt]})
        for chunk in chunks:
            res["prefill"] += run_prefill(s, prefill_lens, chunk, log)
        if args.profile_prefill:
            try:
                prof = profile_prefill(s, 8192, chunks[0], args.out)
            except Exception as e:
                prof = {"weight_dtype": wdt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["profile_prefill" if wdt == "bfloat16" else "profile_prefill_fp8"] = prof
            log({k: v for k, v in prof.items() if k != "table"})
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        res["decode"] += run_decode(s, batches, ctxs, reps=3, log=log)
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        for b in args.profile_batches:
            if b in batches:
                try:
                    res["profiles"].append(profile_decode(s, b, 1024, args.out))
                except Exception as e:
                    res["profiles"].append({"batch": b, "weight_dtype": wdt, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                log({k: v for k, v in res["profiles"][-1].items() if k != "table"})
        if args.flashinfer and wdt == "bfloat16":
            res["decode_flashinfer"] = run_decode_flashinfer(s, [b for b in (1, 64) if b in batches], [8192], log)
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        s.close()
        del s
        gc.collect()
        torch.cuda.empty_cache()
    if args.distributed:
        try:
            res["distributed"] = run_distributed(res, batches, ctxs, dtypes[0], log)
        except Exception as e:
            res["distributed"] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc()[-1500:]}
            log(res["distributed"])
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_hf:
        try:
            res["hf"] = run_hf_subprocess(args, log)
        except Exception as e:
            res["hf"] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc()[-1500:]}
            log(res["hf"])
    try:
        from render_results import plot_decode
        res["plot_note"] = plot_decode(res, args.out / "decode.png")
    except Exception as e:  # e.g. no decode row ran: keep the rest of the results
        res["plot_note"] = f"no plot: {type(e).__name__}: {e}"
    (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
