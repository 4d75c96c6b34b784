"""Check and time the prefill / batch-1-decode kernels on a CUDA GPU, in one command (a few minutes on the H200).

Usage: ``python bench/kernel_check.py OUTDIR [--skip-step] [--skip-prefill]``. Every section runs in its own try
block (a failure is recorded and the rest still runs); a short table goes to stdout, everything to
``OUTDIR/kernel_check.json``. Exit status 1 when a check failed.

* ``sparse_mla_prefill`` at the real shape (64 heads × 512 latent, kpool 4, top 2048) on rows chosen by the real
  index kernels over an 8K context: error vs the fp64 reference, µs, TFLOP/s, and a small launch-config sweep.
* ``router_topk`` (288 experts × 4096, top-8) at 1 / 64 / 4096 tokens: the epilogue bit-exact against the
  reference on the kernel's logits, expert agreement with the fp32 router (random inputs), µs vs the torch
  router; and agreement on the MoE inputs of the trained tiny checkpoint (``GLM5_TRAINED_CKPT``, else one is
  trained here).
* RMSNorm, KDA gated norm, clamped SwiGLU, KDA conv step, sparse-MLA decode (split + combine kernel) and the
  one-launch MoE alignment at decode shapes: agreement with the torch references and µs (CUDA-graph replay).
* The bench config (``bench/bench.py``): kernels per batch-1 decode step and the step time (CUDA graphs) with
  the fusions off (``fuse=torch router=torch``) and on, from the profiler; the batch-256 step's kernel table
  (``profile_decode_b256_ctx1024.txt``); an 8K prefill with ``attn=sdpa`` (masked dense) and ``attn=triton``
  (sparse).
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def graph_us(fn: Callable[[], object], reps: int = 100) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph (``kernel_bench.graph_us``)."""
    from kernel_bench import graph_us as replayed
    return replayed(fn, reps)


def eager_us(fn: Callable[[], object], reps: int = 50) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, rep=reps, return_mode="median") * 1000.0


def ulp_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    ia, ib = a.contiguous().view(torch.int16).int(), b.contiguous().view(torch.int16).int()
    return {"equal_frac": (ia == ib).float().mean().item(), "max_ulp": int((ia - ib).abs().max())}


# ---------------------------------------------------------------------------------------------- sections
def check_sparse_prefill(rows: list, quick: bool) -> None:
    from glm5_kernels.sparse_mla_decode import AttnConfig
    from glm5_kernels.sparse_mla_prefill import prefill_flops, sparse_mla_prefill
    from glm5_kernels.sparse_mla_ref import sparse_mla_prefill_ref
    from test_kernels_sparse_mla_prefill import _prefill_case
    q, lat, idx, counts = _prefill_case(2048, 6144, torch.bfloat16, seed=7)       # positions 6144 .. 8191
    pairs = int(counts.sum())
    got = sparse_mla_prefill(q, lat, idx, counts, 0.0625)
    sub = torch.arange(0, 2048, 37, device="cuda")
    ref = sparse_mla_prefill_ref(q[sub].double(), lat.double(), idx[sub], counts[sub], 0.0625, rows_per_chunk=8)
    err = ((got[sub].double() - ref).norm() / ref.norm()).item()
    configs = [AttnConfig()] if quick else [AttnConfig(), AttnConfig(64, 64, 8, 3), AttnConfig(64, 128, 8, 1),
                                            AttnConfig(64, 32, 8, 2), AttnConfig(32, 64, 4, 2)]
    sweep = {}
    for cfg in configs:
        key = f"h{cfg.block_h}_k{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
        try:
            sweep[key] = eager_us(lambda: sparse_mla_prefill(q, lat, idx, counts, 0.0625, config=cfg))
        except Exception as e:  # out of resources for that tile
            sweep[key] = f"{type(e).__name__}: {str(e)[:80]}"
    t = sweep[next(iter(sweep))]
    rows.append({"kernel": "sparse_mla_prefill", "shape": "2048 q @ ctx 8K, 64h x 512", "ok": err < 1e-2,
                 "metric": f"rel err {err:.2e}", "us": t, "ref_us": None,
                 "tflops": prefill_flops(pairs, 64, 512) / (t * 1e-6) / 1e12, "pairs": pairs, "sweep_us": sweep})


def check_router(rows: list) -> None:
    from glm5_kernels.router import RouterWorkspace, router_topk
    from glm5_kernels.router_ref import route_ref, select_experts_ref
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(288, 4096, generator=g) * 4096 ** -0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(288, generator=g) * 0.01).cuda()
    for t in (1, 64, 4096):
        x = torch.randn(t, 4096, generator=g).to("cuda", torch.bfloat16)
        ws = RouterWorkspace()
        logits = torch.empty(t, 288, device="cuda")
        gw, gi = router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws, logits_out=logits)
        rw, ri = select_experts_ref(logits, bias, 8, 1, 1, True, 2.5)
        exact = torch.equal(gi, ri) and torch.allclose(gw, rw, rtol=2e-7, atol=0)
        _, fi = route_ref(x, w, bias, 8, 1, 1, True, 2.5)
        agree = (gi.sort(1).values == fi.sort(1).values).all(1).float().mean().item()
        wf, bf = w.float(), bias
        rows.append({"kernel": "router_topk", "shape": f"T={t} E=288 H=4096 top8", "ok": exact,
                     "metric": f"epilogue exact {exact}, fp32 agreement {agree:.4%}",
                     "us": graph_us(lambda: router_topk(x, w, bias, 8, 1, 1, True, 2.5, ws)),
                     "ref_us": graph_us(lambda: route_ref(x, wf, bf, 8, 1, 1, True, 2.5))})


def check_router_trained(rows: list, out: Path) -> None:
    """Expert agreement of the bf16 router kernel with the fp32 router on the MoE inputs of the trained tiny
    checkpoint (bf16 engine on this GPU, greedy decoding of the agreement prompts)."""
    import os

    from glm5 import trained_tiny_checkpoint as trained
    from glm5.layers import moe as moe_mod
    from glm5_kernels.router import RouterWorkspace, router_topk
    from glm5_kernels.router_ref import route_ref
    from oracle import engine, engine_greedy
    ckpt = Path(os.environ["GLM5_TRAINED_CKPT"]) if os.environ.get("GLM5_TRAINED_CKPT") else None
    if ckpt is None or not ckpt.exists():
        ckpt = trained.train_tiny_checkpoint(out / "trained_tiny", device="cuda")
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    orig = moe_mod.route

    def capture(x, gate_w, bias, cfg, *a, **kw):
        inputs.append((x.detach().clone(), gate_w, bias))
        return orig(x, gate_w, bias, cfg, *a, **kw)
    moe_mod.route = capture
    try:
        eng = engine(ckpt, device="cuda", dtype="bfloat16", max_model_len=512, enforce_eager=True)
        cfg = eng.model_config.text
        engine_greedy(eng, trained.agreement_prompts(cfg.vocab_size)[:8], 16)
    finally:
        moe_mod.route = orig
    same = total = 0
    ws = RouterWorkspace()
    for x, gate_w, bias in inputs:
        args = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        _, ki = router_topk(x, gate_w.to(x.dtype), bias, *args, workspace=ws)
        _, fi = route_ref(x, gate_w, bias, *args)
        same += int((ki.sort(1).values == fi.sort(1).values).all(1).sum())
        total += x.shape[0]
    rows.append({"kernel": "router_topk (trained tiny)", "shape": f"{total} MoE inputs", "ok": same >= 0.99 * total,
                 "metric": f"fp32 agreement {same / max(total, 1):.4%}", "us": None, "ref_us": None})


def check_elementwise(rows: list) -> None:
    from glm5_kernels import norms_ref
    from glm5_kernels.kda_decode import kda_conv_step
    from glm5_kernels.kda_decode_ref import kda_conv_step_ref
    from glm5_kernels.moe_ref import clamped_swiglu_ref
    from glm5_kernels.norms import gated_rms_norm, rms_norm
    from glm5_kernels.swiglu import clamped_swiglu
    g = torch.Generator(device="cpu").manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)

    for n in (1, 64):
        x, w = rnd(n, 4096, scale=3.0), 1 + rnd(4096, scale=0.1)
        rows.append({"kernel": "rms_norm", "shape": f"{n} x 4096", **_agree(rms_norm(x, w, 1e-5),
                     norms_ref.rms_norm(x, w, 1e-5)), "us": graph_us(lambda: rms_norm(x, w, 1e-5)),
                     "ref_us": graph_us(lambda: norms_ref.rms_norm(x, w, 1e-5))})
        xg, gate, wn = rnd(n, 64, 128), rnd(n, 64, 128, scale=2.0), 1 + rnd(128, scale=0.1)
        rows.append({"kernel": "gated_rms_norm", "shape": f"{n} x 64 x 128",
                     **_agree(gated_rms_norm(xg, gate, wn, 1e-5), norms_ref.gated_rms_norm(xg, gate, wn, 1e-5)),
                     "us": graph_us(lambda: gated_rms_norm(xg, gate, wn, 1e-5)),
                     "ref_us": graph_us(lambda: norms_ref.gated_rms_norm(xg, gate, wn, 1e-5))})
        gt, up = rnd(n, 2048, scale=6.0), rnd(n, 2048, scale=6.0)
        rows.append({"kernel": "clamped_swiglu", "shape": f"{n} x 2048",
                     **_agree(clamped_swiglu(gt, up, 10.0), clamped_swiglu_ref(gt, up, 10.0)),
                     "us": graph_us(lambda: clamped_swiglu(gt, up, 10.0)),
                     "ref_us": graph_us(lambda: clamped_swiglu_ref(gt, up, 10.0))})
        c = 3 * 8192
        state, proj, wconv = rnd(n + 2, 3, c), rnd(n, c + 320), rnd(c, 4, scale=0.5)
        mixed, beta = proj[:, :c], proj[:, c + 256:]
        slots = torch.randperm(n + 2, generator=g)[:n].cuda()
        s_ref = state.clone()
        want = kda_conv_step_ref(mixed, s_ref, slots, wconv)
        s_got = state.clone()
        qkv, _ = kda_conv_step(mixed, s_got, slots, wconv, extra=beta)
        res = _agree(qkv.permute(1, 0, 2).reshape(n, c), want)
        res["ok"] = res["ok"] and torch.equal(s_got, s_ref)
        rows.append({"kernel": "kda_conv_step", "shape": f"{n} x 3x8192", **res,
                     "us": graph_us(lambda: kda_conv_step(mixed, state, slots, wconv, extra=beta)),
                     "ref_us": graph_us(lambda: (kda_conv_step_ref(mixed, state, slots, wconv), beta.contiguous()))})


def _agree(got: torch.Tensor, want: torch.Tensor) -> dict:
    a = ulp_agreement(got, want)
    return {"ok": a["equal_frac"] > 0.999 and a["max_ulp"] <= 1,
            "metric": f"bf16 equal {a['equal_frac']:.4%}, max {a['max_ulp']} ulp"}


def check_decode_attention_and_align(rows: list) -> None:
    from glm5_kernels.fused_moe import max_padded_rows, moe_align_block_size
    from glm5_kernels.moe_align import moe_align_small
    from glm5_kernels.sparse_mla_decode import sparse_mla_decode
    from glm5_kernels.sparse_mla_ref import sparse_mla_decode_ref
    g = torch.Generator(device="cpu").manual_seed(2)
    lat = torch.randn(1 << 20, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).bfloat16()
    for n in (1, 64):
        q = torch.randn(n, 64, 512, generator=g).to("cuda", torch.bfloat16)
        idx = torch.randint(0, lat.shape[0], (n, 2051), generator=g).to("cuda", torch.int32)
        cnt = torch.full((n,), 2051, device="cuda", dtype=torch.int32)
        got = sparse_mla_decode(q, lat, idx, 0.0625, counts=cnt, out_dtype=torch.bfloat16)
        ref = sparse_mla_decode_ref(q, lat, idx, 0.0625)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        rows.append({"kernel": "sparse_mla_decode (+combine)", "shape": f"{n} x 64h x 2051", "ok": err < 1e-2,
                     "metric": f"rel err {err:.2e}",
                     "us": graph_us(lambda: sparse_mla_decode(q, lat, idx, 0.0625, counts=cnt, out_dtype=torch.bfloat16)),
                     "ref_us": None})
    for t, bm in ((1, 16), (64, 64)):
        ids = torch.stack([torch.randperm(288, generator=g)[:8] for _ in range(t)]).cuda()
        ref = moe_align_block_size(ids, 288, bm)
        mr = max_padded_rows(t * 8, 288, bm)
        s, b, tot = moe_align_small(ids, 288, bm, mr)
        ok = torch.equal(s, ref.sorted_ids) and torch.equal(b, ref.block_expert) and torch.equal(tot, ref.total_rows)
        rows.append({"kernel": "moe_align_small", "shape": f"T={t} top8 E=288 BM={bm}", "ok": ok,
                     "metric": f"exact {ok}", "us": graph_us(lambda: moe_align_small(ids, 288, bm, mr)),
                     "ref_us": graph_us(lambda: moe_align_block_size(ids, 288, bm))})


def check_bench_step(rows: list, out: Path, skip_prefill: bool) -> dict:
    """Kernels and time of the bench config's b1 decode step, fusions off vs on; 8K prefill sdpa vs triton."""
    from bench import Setup, profile_decode, prefill_once, run_decode, timed, median
    from glm5.layers import backends
    s = Setup(256, 8192)
    res: dict = {}
    try:
        for name, kw in (("fusions off", dict(fuse="torch", router="torch")), ("fusions on", {})):
            backends.set_backends(**{"fuse": "auto", "router": "auto", **kw})
            prof = profile_decode(s, 1, 1024, out)
            (out / f"profile_decode_b1_ctx1024_{name.replace(' ', '_')}.txt").write_text(prof.pop("table"))
            step = run_decode(s, [1], [1024], reps=20, log=lambda r: None)[0]
            res[name] = {"cuda_kernels": prof["cuda_kernels"], "kernel_time_s": prof["kernel_time_s"],
                         "step_s": step.get("step_s"), "graph": step.get("graph"), "error": step.get("error")}
            rows.append({"kernel": f"b1 decode step ({name})", "shape": "bench config, ctx 1K", "ok": "error" not in step,
                         "metric": f"{prof['cuda_kernels']} kernels, {prof['kernel_time_s'] * 1e3:.2f} ms kernel time",
                         "us": (step.get("step_s") or 0) * 1e6, "ref_us": None})
        backends.set_backends(fuse="auto", router="auto")
        # batch 256 (65 % of its roofline in the recorded run): the kernel table is the evidence of what limits it
        prof = profile_decode(s, 256, 1024, out)
        step = run_decode(s, [256], [1024], reps=10, log=lambda r: None)[0]
        res["b256"] = {"cuda_kernels": prof["cuda_kernels"], "kernel_time_s": prof["kernel_time_s"],
                       "step_s": step.get("step_s"), "bytes": step.get("bytes"), "error": step.get("error")}
        rows.append({"kernel": "b256 decode step (fusions on)", "shape": "bench config, ctx 1K", "ok": "error" not in step,
                     "metric": f"{prof['cuda_kernels']} kernels, {prof['kernel_time_s'] * 1e3:.2f} ms kernel time; "
                               f"table in profile_decode_b256_ctx1024.txt", "us": (step.get("step_s") or 0) * 1e6,
                     "ref_us": None})
        if not skip_prefill:
            for attn in ("sdpa", "triton"):
                backends.set_backends(attn=attn)
                t = median(timed(lambda: prefill_once(s, 8192, 4096), 3, warmup=2))
                fl = s.prefill_flops(8192)
                res[f"prefill_8k_{attn}"] = {"time_s": t, "tflops": fl / t / 1e12}
                rows.append({"kernel": f"prefill 8K (attn={attn})", "shape": "bench config, 4K chunks", "ok": True,
                             "metric": f"{fl / t / 1e12:.0f} TFLOP/s", "us": t * 1e6, "ref_us": None})
    finally:
        backends.reset_backends()
        s.close()
        gc.collect()
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------- main
def _table(rows: list) -> str:
    lines = [f"{'kernel':34s} {'shape':28s} {'ok':4s} {'kernel µs':>10s} {'torch µs':>10s}  metric"]
    for r in rows:
        us = "" if r.get("us") is None else f"{r['us']:10.1f}"
        ref = "" if r.get("ref_us") is None else f"{r['ref_us']:10.1f}"
        ok = "ok" if r.get("ok") else "FAIL"
        lines.append(f"{r['kernel'][:34]:34s} {r.get('shape', '')[:28]:28s} {ok:4s} {us:>10s} {ref:>10s}  "
                     f"{r.get('metric', r.get('error', ''))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output directory (created)")
    ap.add_argument("--quick", action="store_true", help="no launch-config sweep")
    ap.add_argument("--skip-step", action="store_true", help="skip the bench-config decode step and prefill")
    ap.add_argument("--skip-prefill", action="store_true", help="skip the 8K prefill comparison")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
                 "rows": [], "errors": {}}
    rows = res["rows"]
    sections = [("sparse_prefill", lambda: check_sparse_prefill(rows, args.quick)),
                ("router", lambda: check_router(rows)),
                ("router_trained", lambda: check_router_trained(rows, args.out)),
                ("elementwise", lambda: check_elementwise(rows)),
                ("decode_attention_align", lambda: check_decode_attention_and_align(rows))]
    if not args.skip_step:
        sections.append(("bench_step", lambda: res.__setitem__("bench_step",
                                                               check_bench_step(rows, args.out, args.skip_prefill))))
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            res["errors"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc()[-2000:]}
            rows.append({"kernel": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            torch.cuda.synchronize()
        res.setdefault("section_s", {})[name] = time.perf_counter() - t0
        (args.out / "kernel_check.json").write_text(json.dumps(res, indent=1, default=str))
        gc.collect()
        torch.cuda.empty_cache()
    table = _table(rows)
    print(table)
    (args.out / "kernel_check.txt").write_text(table + "\n")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
