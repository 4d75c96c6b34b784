"""Check every fp8 kernel against its reference and time the fp8 GEMM choices at the real shapes (one GPU).

``python bench/fp8_check.py --out DIR [--budget-s 240] [--write-table]``

1. Checks (each on its own: a failure is printed and recorded, the rest still run): the activation quantiser
   bit for bit against ``per_token_group_quant_fp8_ref``; the fp8 GEMV at every real linear shape for
   M = 1 and 16, the w8a8 Triton GEMM and ``torch._scaled_mm`` (block scales) at M = 512, the per-head GEMV at
   MLA's absorbed shapes, and the fused MoE with fp8 experts (E288/H4096/I2048, T = 1, 64, 1024) against
   their references (bounds in ``tests/test_kernels_fp8.py``).
2. Timings, for each real (N, K) and M = 1, 4, 16, 64, 256, 1K, 4K, 16K: bf16 cuBLAS (``x @ w.t()``), the fp8
   GEMVs (``gemv`` and ``gemv_w8a8``, plain and swapped, at a few tile configs for M <= 256, ``gemv_fma`` for M <= 4),
   ``_scaled_mm`` and the Triton w8a8 GEMM (M >= 16); CUDA-graph replay up to M = 256 (what decode runs),
   plain ``do_bench`` above. Reported: µs, fp8 bytes/µs, speedup of the best fp8 choice over bf16. Then the
   fused MoE at ``--moe-tokens``: bf16 experts, fp8 experts widened (``A_FP8`` 0) and the two w8a8 modes
   (``A_FP8`` 1: activation tiles quantised in the kernels, 2: x and h quantised once); then the activation
   quantiser at ``--quant-rows`` x 4096.
3. ``--write-table``: the fastest fp8 implementation per (N, K, M) written to
   ``kernels/glm5_kernels/configs/fp8_linear_{device}.json`` (what ``glm5_kernels.fp8_linear.select_impl``
   reads; commit it), over the entries already there (M values this run did not time keep theirs). The same
   table is always written to ``DIR/fp8_linear_table.json``.

Writes ``DIR/fp8_check.json`` (checks, timings, choices) and prints a short table. Stops starting new timings
when ``--budget-s`` is spent (the checks always run first).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
try:
    import glm5_kernels.fp8_linear as fl
except ImportError:  # run from a checkout without the package installed
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "backend")]
    import glm5_kernels.fp8_linear as fl
import triton
import triton.testing

from glm5_kernels.fp8_ref import (
    fp8_head_linear_ref,
    fp8_linear_ref,
    per_token_group_quant_fp8_ref,
    quantize_fp8_block,
    w8a8_linear_ref,
)

#: (name, N, K) of the GLM-5.3-Flash linears that are fp8 (model-spec §10), deduplicated by shape.
#: The model runs q_a | kv_a | wk as one weight and a SwiGLU's gate | up as one (glm5.layers.linear.MultiOutputLinear).
SHAPES = [("mla.x (q_a|kv_a|wk)", 2176, 4096), ("mla.q_b", 16384, 1536), ("mla.kv_b", 32768, 512),
          ("mla.o", 4096, 16384), ("kda.in (q|k|v|f_a|g_a|b)", 24896, 4096), ("kda.f_b/g_b", 8192, 128),
          ("kda.o / mtp.eh", 4096, 8192), ("indexer.wq_b", 4096, 1536), ("dense.gate|up", 24576, 4096),
          ("dense.down", 4096, 12288), ("shared.gate|up", 4096, 4096), ("shared.down", 4096, 2048)]
MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
GRAPH_MAX_M = 256
#: GEMV tile candidates besides the default: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
GEMV_CANDIDATES = [(32, 256, 1, 4, 4), (64, 128, 1, 4, 4), (32, 256, 2, 4, 4), (16, 256, 4, 4, 4)]
#: FMA GEMV candidates at M <= 4 (BLOCK_M = M): (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
FMA_CANDIDATES = [(16, 512, 1, 4, 2), (16, 512, 2, 4, 2), (16, 512, 4, 4, 2), (8, 512, 2, 4, 2), (32, 256, 2, 8, 3),
                  (8, 1024, 1, 4, 2), (16, 1024, 1, 8, 2)]
#: w8a8 GEMV candidates (BLOCK_K is one 128-channel group): (BLOCK_N, SPLIT_K, num_warps, num_stages).
#: The 128-wide strips with a K split serve M = 16-64, where narrow strips would re-read the activation rows
#: once per strip and wide ones alone leave most SMs idle on the N = 4096 projections.
W8A8_GEMV_CANDIDATES = [(16, 1, 4, 3), (16, 1, 8, 3), (16, 4, 4, 3), (32, 2, 4, 4), (64, 1, 4, 4), (64, 4, 4, 3),
                        (128, 1, 8, 3), (128, 4, 8, 3), (128, 8, 8, 3)]
#: The same GEMV swapped (``SWAP_AB``: the weight strip on the warpgroup MMA's M side, which needs 64 rows or more):
#: (BLOCK_N, SPLIT_K, num_warps, num_stages).
SWAP_GEMV_CANDIDATES = [(64, 1, 4, 3), (64, 1, 4, 5), (64, 2, 4, 5), (128, 1, 4, 3), (128, 1, 4, 5), (128, 2, 4, 5),
                        (128, 1, 8, 5), (128, 4, 4, 5)]
W8A16_BOUND = W8A8_BOUND = 1e-2
W8A8_MOE_BOUND = 2e-2  # the MoE's w8a8 mode quantises twice (tests/test_kernels_fp8.py says why)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_us(fn: Callable[[], Any], graph: bool) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    w8, s = quantize_fp8_block(w)
    return w.to(torch.bfloat16), w8, s


# ------------------------------------------------------------------------------------------------ checks
def run_checks(log: Callable[[dict], None], shapes: list[tuple[str, int, int]] = SHAPES) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: list[dict] = []

    def check(name: str, fn: Callable[[], dict]) -> None:
        t0 = time.perf_counter()
        try:
            row = {"check": name, **fn()}
            row["ok"] = bool(row.get("ok", True))
        except Exception as e:
            row = {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                   "trace": traceback.format_exc()[-1200:]}
        row["s"] = round(time.perf_counter() - t0, 2)
        out.append(row)
        log(row)

    def quant() -> dict:
        x = torch.randn(4096, 4096, device="cuda", generator=g).to(torch.bfloat16) * 3
        q, s = fl.per_token_group_quant_fp8(x)
        rq, rs = per_token_group_quant_fp8_ref(x)
        same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        return {"ok": same, "values_differ": int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())}
    check("per_token_group_quant bit-exact", quant)

    for name, n, k in shapes:
        def gemv(n=n, k=k) -> dict:
            _, w8, s = weights(n, k, g)
            errs = {}
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                errs[m] = rel(fl.fp8_linear(x, w8, s, impl={"impl": "gemv", **fl.default_gemv_config(m, n, k)}),
                              fp8_linear_ref(x, w8, s))
                if m <= 4:
                    fma = {"impl": "gemv_fma", "BLOCK_M": m, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2,
                           "num_warps": 4, "num_stages": 3}
                    errs[f"fma {m}"] = rel(fl.fp8_linear(x, w8, s, impl=fma), fp8_linear_ref(x, w8, s))
                errs[f"w8a8 {m}"] = rel(fl.fp8_linear(x, w8, s, impl={**fl.default_gemv_config(m, n, k),
                                                                        "impl": "gemv_w8a8"}),
                                        w8a8_linear_ref(x, w8, s))
            return {"ok": max(errs.values()) < W8A16_BOUND, "rel_err": errs, "bound": W8A16_BOUND}
        check(f"gemv {name} {n}x{k}", gemv)

    for n, k in ((4096, 4096), (24896, 4096), (4096, 12288)):
        def w8a8(n=n, k=k) -> dict:
            _, w8, s = weights(n, k, g)
            x = torch.randn(512, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = w8a8_linear_ref(x, w8, s)
            errs = {"w8a8": rel(fl.fp8_linear(x, w8, s, impl={"impl": "w8a8", **fl.default_w8a8_config(512, n)}), ref)}
            if n % 128 == 0 and fl.scaled_mm_block_supported():
                errs["scaled_mm"] = rel(fl.fp8_linear(x, w8, s, impl={"impl": "scaled_mm"}), ref)
            errs["vs_w8a16_ref"] = rel(fl.fp8_linear(x, w8, s, impl={"impl": "w8a8", **fl.default_w8a8_config(512, n)}),
                                       fp8_linear_ref(x, w8, s))
            return {"ok": errs["w8a8"] < W8A8_BOUND and errs.get("scaled_mm", 0) < W8A8_BOUND, "rel_err": errs,
                    "scaled_mm_block_supported": fl.scaled_mm_block_supported()}
        check(f"w8a8/scaled_mm {n}x{k} M=512", w8a8)

    def heads() -> dict:
        kv, kvs = quantize_fp8_block(torch.randn(64, 512, 512, device="cuda", generator=g) * 512 ** -0.5)
        uk, uks = kv[:, :256].transpose(1, 2).contiguous(), kvs[:, :2].transpose(1, 2).contiguous()
        uv, uvs = kv[:, 256:], kvs[:, 2:]
        errs = {}
        for m in (1, 64):
            q = torch.randn(m, 64, 256, device="cuda", generator=g).to(torch.bfloat16)
            o = torch.randn(m, 64, 512, device="cuda", generator=g).to(torch.bfloat16)
            errs[f"w_uk_t m{m}"] = rel(fl.fp8_head_linear(q, uk, uks), fp8_head_linear_ref(q, uk, uks))
            errs[f"w_uv m{m}"] = rel(fl.fp8_head_linear(o, uv, uvs), fp8_head_linear_ref(o, uv, uvs))
        return {"ok": max(errs.values()) < W8A16_BOUND, "rel_err": errs}
    check("head gemv (MLA absorbed kv_b views)", heads)

    def moe() -> dict:
        from glm5_kernels.fused_moe import fused_moe, get_config
        from glm5_kernels.moe_ref import fused_moe_ref
        e, h, i, k = 288, 4096, 2048, 8
        ws = [quantize_fp8_block(torch.randn(e, a, b, device="cuda", generator=g) * b ** -0.5 * 3)
              for a, b in ((i, h), (i, h), (h, i))]
        sc = tuple(s for _, s in ws)
        errs = {}
        for t in (1, 64, 1024):
            x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
            ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
            w = torch.rand(t, k, device="cuda", generator=g)
            for a_fp8 in (0, 1, 2):
                cfg = {**get_config(t, k, e, h, i, torch.bfloat16, x.device, fp8_weights=True), "A_FP8": a_fp8}
                errs[f"{t} A_FP8={a_fp8}"] = rel(
                    fused_moe(x, ws[0][0], ws[1][0], ws[2][0], w, ids, 10.0, config=cfg, scales=sc),
                    fused_moe_ref(x, ws[0][0], ws[1][0], ws[2][0], w, ids, 10.0, scales=sc, quant_act=bool(a_fp8)))
        ok = all(v < (W8A16_BOUND if key.endswith("=0") else W8A8_MOE_BOUND) for key, v in errs.items())
        return {"ok": ok, "rel_err": errs, "bounds": {"A_FP8=0": W8A16_BOUND, "A_FP8=1,2": W8A8_MOE_BOUND}}
    check("fused_moe fp8 experts E288", moe)
    return out


# ------------------------------------------------------------------------------------------------ timings
def time_shape(name: str, n: int, k: int, ms: list[int], deadline: float, log) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    wb, w8, s = weights(n, k, g)
    rows = []
    for m in ms:
        if time.monotonic() > deadline:
            rows.append({"shape": name, "N": n, "K": k, "M": m, "skipped": "budget spent"})
            log(rows[-1])
            continue
        graph = m <= GRAPH_MAX_M
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        row: dict[str, Any] = {"shape": name, "N": n, "K": k, "M": m, "graph": graph, "us": {}, "errors": {}}

        def timed(label: str, fn: Callable[[], Any]) -> None:
            try:
                row["us"][label] = bench_us(fn, graph)
            except Exception as e:
                row["errors"][label] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()

        timed("bf16", lambda: x @ wb.t())
        choices: dict[str, dict] = {}
        cfgs = []
        if m <= 256:
            default = fl.default_gemv_config(m, n, k)
            cfgs += [{"impl": "gemv", **default}] + [
                {"impl": "gemv", "BLOCK_M": default["BLOCK_M"], "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp,
                 "num_warps": nw, "num_stages": st} for bn, bk, sp, nw, st in GEMV_CANDIDATES]
            cfgs += [{"impl": "gemv_w8a8", "BLOCK_M": default["BLOCK_M"], "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": sp,
                      "num_warps": nw, "num_stages": st, "SWAP_AB": swap}
                     for swap, cands in ((0, W8A8_GEMV_CANDIDATES), (1, SWAP_GEMV_CANDIDATES))
                     for bn, sp, nw, st in cands]
        if m <= 4:
            cfgs += [{"impl": "gemv_fma", "BLOCK_M": m, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw,
                      "num_stages": st} for bn, bk, sp, nw, st in FMA_CANDIDATES]
        for cfg in cfgs:
            label = cfg["impl"] + " " + "/".join(str(cfg[kk]) for kk in fl.GEMV_KEYS) + (" swap" if cfg.get("SWAP_AB") else "")
            if label in choices or cfg["BLOCK_N"] > max(16, triton.next_power_of_2(n)):
                continue
            choices[label] = cfg
            timed(label, lambda cfg=cfg: fl.fp8_linear(x, w8, s, impl=cfg))
        if m >= 16:
            if n % 128 == 0 and k % 128 == 0 and fl.scaled_mm_block_supported():
                choices["scaled_mm"] = {"impl": "scaled_mm"}
                timed("scaled_mm", lambda: fl.fp8_linear(x, w8, s, impl={"impl": "scaled_mm"}))
            for bm, split in (((64, 1), (128, 1)) if m >= 256 else ((16, 1), (64, 1), (64, 4), (64, 8))):
                cfg = {**fl.default_w8a8_config(m, n), "BLOCK_M": bm, "num_warps": 8 if bm == 128 else 4}
                if split > 1:
                    cfg["SPLIT_K"] = split
                label = f"w8a8 {bm}" + (f" split {split}" if split > 1 else "")
                choices[label] = {"impl": "w8a8", **cfg}
                timed(label, lambda cfg=cfg: fl.fp8_linear(x, w8, s, impl={"impl": "w8a8", **cfg}))
        fp8 = {lbl: us for lbl, us in row["us"].items() if lbl in choices}
        if fp8:
            best = min(fp8, key=fp8.get)
            row.update(best=best, best_us=fp8[best], choice=choices[best],
                       default=fl.default_impl(m, n, k, torch.bfloat16)["impl"])
            if "bf16" in row["us"]:
                row["speedup_vs_bf16"] = row["us"]["bf16"] / fp8[best]
            row["fp8_GBps"] = (n * k + s.numel() * 4 + m * k * 2 + m * n * 2) / (fp8[best] * 1e-6) / 1e9
        if "bf16" in row["us"]:
            row["bf16_GBps"] = (n * k * 2 + m * k * 2 + m * n * 2) / (row["us"]["bf16"] * 1e-6) / 1e9
        log(row)
        rows.append(row)
    del wb, w8, s
    torch.cuda.empty_cache()
    return rows


def time_moe(tokens: list[int], log) -> list[dict]:
    """The routed experts at E288/H4096/I2048/top-8 under CUDA-graph replay: bf16 experts, fp8 experts widened
    in registers (``A_FP8`` 0) and the w8a8 modes (``A_FP8`` 1: tiles quantised in the kernels, 2: x and h
    quantised once), each with its table's tiles; µs and the weight bytes the touched experts move per µs."""
    from glm5_kernels.fused_moe import fused_moe, get_config
    e, h, i, k = 288, 4096, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(3)
    wb = [torch.randn(e, a, b, device="cuda", generator=g, dtype=torch.bfloat16) * b ** -0.5 for a, b in
          ((i, h), (i, h), (h, i))]
    w8 = [quantize_fp8_block(w) for w in wb]
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
        w = torch.rand(t, k, device="cuda", generator=g)
        touched = int(torch.unique(ids).numel())
        row: dict[str, Any] = {"moe_tokens": t, "experts_touched": touched, "us": {}, "GBps": {}}
        runs = {"bf16": lambda: fused_moe(x, *wb, w, ids, 10.0)}
        for a_fp8 in (0, 1, 2):
            cfg = {**get_config(t, k, e, h, i, torch.bfloat16, x.device, fp8_weights=True), "A_FP8": a_fp8}
            runs[f"fp8 A_FP8={a_fp8}"] = lambda cfg=cfg: fused_moe(x, w8[0][0], w8[1][0], w8[2][0], w, ids, 10.0,
                                                                     config=cfg, scales=tuple(s for _, s in w8))
        for label, fn in runs.items():
            try:
                us = bench_us(fn, graph=True)
            except Exception as ex:
                row.setdefault("errors", {})[label] = f"{type(ex).__name__}: {str(ex)[:200]}"
                torch.cuda.synchronize()
                continue
            row["us"][label] = us
            row["GBps"][label] = touched * 3 * h * i * (2 if label == "bf16" else 1) / (us * 1e-6) / 1e9
        log(row)
        rows.append(row)
    del wb, w8
    torch.cuda.empty_cache()
    return rows


def time_quant(rows: list[int], log, k: int = 4096) -> list[dict]:
    """The activation quantiser (:func:`per_token_group_quant_fp8`, row-major and ``_scaled_mm``'s column-major
    scales) on ``[M, k]`` bf16 under CUDA-graph replay: µs and GB/s (bf16 read + e4m3 and scales written)."""
    g = torch.Generator(device="cuda").manual_seed(4)
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        nbytes = m * k * 3 + m * (k // 128) * 4
        row: dict[str, Any] = {"quant_rows": m, "K": k, "us": {}, "GBps": {}}
        for label, col in (("row-major", False), ("column-major", True)):
            us = bench_us(lambda col=col: fl.per_token_group_quant_fp8(x, column_major=col), graph=True)
            row["us"][label], row["GBps"][label] = us, nbytes / (us * 1e-6) / 1e9
        log(row)
        out.append(row)
    return out


def merge_tables(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The committed table with this run's choices laid over it: a run over a few M values (``--ms 1,4``)
    replaces those entries and keeps the others; ``_meta`` lists every run that contributed."""
    merged = {shape: dict(per_m) for shape, per_m in old.items() if not shape.startswith("_")}
    for shape, per_m in new.items():
        if not shape.startswith("_"):
            merged.setdefault(shape, {}).update(per_m)
    runs = old.get("_meta", {}).get("runs") or ([old["_meta"]] if "_meta" in old else [])
    merged["_meta"] = {**new["_meta"], "runs": [*runs, new["_meta"]]}
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget; timings stop when spent")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    ap.add_argument("--no-checks", action="store_true", help="timings only (the GPU tests check the same kernels)")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (prefixes of SHAPES' names) to check "
                    "and time; empty: all")
    ap.add_argument("--moe-tokens", default="1,8,64,256",
                    help="comma-separated token counts for the fused-MoE timings (empty: none)")
    ap.add_argument("--quant-rows", default="1,64,4096",
                    help="comma-separated row counts for the activation-quantiser timings (empty: none)")
    ap.add_argument("--write-table", action="store_true",
                    help="also write kernels/glm5_kernels/configs/fp8_linear_{device}.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_check needs a CUDA GPU")
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    from bench import jsonl_logger
    log = jsonl_logger(args.out / "fp8_check.log")

    res: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "command": " ".join(sys.argv),
                           "scaled_mm_block_supported": fl.scaled_mm_block_supported()}
    wanted = [v for v in args.shapes.split(",") if v]
    shapes = [sh for sh in SHAPES if not wanted or any(sh[0].startswith(w) for w in wanted)]
    if not shapes:
        raise SystemExit(f"--shapes {args.shapes!r} names none of {[sh[0] for sh in SHAPES]}")
    res["checks"] = [] if args.no_checks else run_checks(log, shapes)
    deadline = t0 + args.budget_s
    ms = [int(v) for v in args.ms.split(",") if v]
    res["timings"] = []
    for name, n, k in shapes:
        try:
            res["timings"] += time_shape(name, n, k, ms, deadline, log)
        except Exception as e:  # OOM at 16384 x 32768 etc.: keep the other shapes
            res["timings"].append({"shape": name, "N": n, "K": k, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(res["timings"][-1])
            torch.cuda.empty_cache()
    try:
        res["moe"] = time_moe([int(v) for v in args.moe_tokens.split(",") if v], log)
    except Exception as e:
        res["moe"] = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
        log(res["moe"][0])
    res["quant"] = time_quant([int(v) for v in args.quant_rows.split(",") if v], log)
    table: dict[str, Any] = {}
    for r in res["timings"]:
        if "choice" in r:
            table.setdefault(f"{r['N']},{r['K']}", {})[str(r["M"])] = r["choice"]
    table["_meta"] = {"device": res["gpu"], "torch": res["torch"], "triton": res["triton"], "date": res["date"],
                      "command": res["command"]}
    res["seconds"] = round(time.monotonic() - t0, 1)
    (args.out / "fp8_check.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (args.out / "fp8_linear_table.json").write_text(json.dumps(table, indent=1) + "\n")
    if args.write_table:
        path = fl.CONFIG_DIR / fl.table_file_name(torch.cuda.get_device_name().replace(" ", "_"))
        merged = merge_tables(json.loads(path.read_text()) if path.exists() else {}, table)
        path.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {path}")

    print(f"\nchecks: {sum(c['ok'] for c in res['checks'])}/{len(res['checks'])} ok "
          f"(_scaled_mm block scaling {'available' if res['scaled_mm_block_supported'] else 'NOT available'})")
    for c in res["checks"]:
        if not c["ok"]:
            print(f"  FAIL {c['check']}: {c.get('error') or c.get('rel_err')}")
    print(f"\n{'shape':<26} {'N':>6} {'K':>6} {'M':>6} {'bf16 us':>8} {'fp8 us':>8} {'x bf16':>6} {'fp8 GB/s':>8}  best")
    for r in res["timings"]:
        if "best" in r and r["M"] in (1, 16, 64, 256, 4096, 16384):
            print(f"{r['shape']:<26} {r['N']:>6} {r['K']:>6} {r['M']:>6} {r['us'].get('bf16', float('nan')):>8.1f} "
                  f"{r['best_us']:>8.1f} {r.get('speedup_vs_bf16', float('nan')):>6.2f} {r['fp8_GBps']:>8.0f}  {r['best']}")
    for r in res["moe"]:
        if "us" in r:
            print(f"fused MoE T={r['moe_tokens']:<5} experts {r['experts_touched']:>3}: " + ", ".join(
                f"{lbl} {us:.1f} us ({r['GBps'][lbl]:.0f} GB/s)" for lbl, us in r["us"].items()))
    for r in res["quant"]:
        print(f"quantiser M={r['quant_rows']:<6} K={r['K']}: " + ", ".join(
            f"{lbl} {us:.1f} us ({r['GBps'][lbl]:.0f} GB/s)" for lbl, us in r["us"].items()))
    print(f"\nwrote {args.out / 'fp8_check.json'} in {res['seconds']} s")
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
