"""Tune the fused MoE launch configs on a GPU and write the per-token-count table.

``python bench/tune_fused_moe.py [--budget-s 150] [--out kernels/glm5_kernels/configs] [--fp8 [--a-fp8 N]]``

``--fp8`` tunes the fp8-weight path (experts e4m3 with 128 x 128 block scales, bf16 activations) and writes
``fused_moe_E288_H4096_I2048_bf16_fp8w_{device}.json``; its tiles are at most 128 wide in N (one scale row
per weight tile), so wider candidates are skipped; ``--a-fp8`` picks the activation mode it tunes (default: the
one :func:`fused_moe` uses without a table entry). The output file's entries for token counts that ``--ms`` does
not list are kept, and an entry for a listed one stays when it measures faster than what the run found.

For each token count M (1 … 16384) at E=288, H=4096, I=2048, top-8, bf16 with uniform random
routing, the two kernels are timed *separately* for every BLOCK_SIZE_M candidate (both share the
alignment, so BLOCK_SIZE_M is common, but their N/K tiles, warps and stages are chosen independently
and the down kernel's choice is stored under ``"down"``); fp8 experts in the w8a8 mode also try the dots
swapped (``SWAP_AB``). Candidates are tried in prior order until
the M's share of ``--budget-s`` is spent (unused time rolls over to later M), so the run always
finishes in about the budget; the heuristic default is always measured first, so the table is never
worse than the default as measured. Failures (compile errors, shared-memory overflow, OOM) are logged
and skipped. The chosen config is checked against the torch per-expert loop before it is kept.

Prints per M: best µs of the full ``fused_moe`` call (alignment + 2 kernels + k-sum), the default's
µs, TFLOP/s and GB/s (bytes = weights of the experts actually touched + activations).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.testing

try:
    import glm5_kernels.fused_moe as fm
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
    import glm5_kernels.fused_moe as fm
from glm5_kernels.moe_ref import fused_moe_ref

log = logging.getLogger("tune_fused_moe")

DEFAULT_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINAL_RESERVE_S = 1.5    # per-M time kept for the end-to-end measurement and the correctness check

# (BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages), most promising first.
_SMALL_GU = [(64, 128, 1, 4, 4), (32, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 4, 3), (32, 256, 1, 4, 4),
             (64, 64, 1, 4, 5), (128, 64, 1, 4, 4), (64, 128, 1, 8, 4), (16, 256, 1, 4, 4)]
_SMALL_DN = [(64, 128, 1, 4, 4), (128, 128, 1, 4, 3), (32, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 64, 1, 4, 4),
             (256, 64, 1, 8, 3), (64, 64, 1, 4, 5), (32, 256, 1, 4, 4)]
_MID_GU = [(128, 64, 8, 4, 4), (64, 64, 8, 4, 4), (128, 128, 8, 8, 3), (64, 128, 8, 4, 3), (128, 64, 1, 8, 4),
           (128, 64, 16, 4, 3)]
_MID_DN = [(128, 64, 8, 4, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (64, 128, 8, 4, 4), (128, 64, 1, 4, 4),
           (256, 64, 8, 4, 3)]
_BIG_GU = [(128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (64, 64, 8, 4, 4), (128, 32, 8, 8, 5), (64, 128, 8, 8, 3),
           (128, 64, 16, 8, 3)]
_BIG_DN = [(128, 64, 8, 8, 4), (256, 64, 8, 8, 3), (128, 128, 8, 8, 3), (128, 64, 8, 4, 4), (256, 32, 8, 8, 4),
           (128, 64, 16, 8, 4)]


def block_m_candidates(m: int, top_k: int, num_experts: int) -> list[int]:
    """BLOCK_SIZE_M values worth trying at M tokens (mean rows per expert decides), default first."""
    per_expert = m * top_k / num_experts
    if per_expert <= 2:
        cands = [16]
    elif per_expert <= 8:
        cands = [16, 32]
    elif per_expert <= 32:
        cands = [32, 16, 64]
    elif per_expert <= 128:
        cands = [64, 128, 32]
    else:
        cands = [128, 64]
    first = fm.default_config(m, top_k, num_experts)["BLOCK_SIZE_M"]
    return [first] + [b for b in cands if b != first]


#: The pre-quantised w8a8 mode (``A_FP8`` 2): e4m3 A and B tiles (one byte each) with one 128-channel group per K
#: step, and gate/up's N tile one group too, so only the row-block order, warps and stages are free.
_PRE_GU = [(128, 128, 8, 8, 4), (128, 128, 8, 4, 4), (128, 128, 8, 8, 3), (128, 128, 16, 8, 4), (128, 128, 1, 4, 4),
           (128, 128, 8, 4, 3)]
_PRE_DN = [(128, 128, 8, 8, 4), (128, 128, 8, 4, 4), (64, 128, 8, 4, 4), (128, 128, 8, 8, 3), (128, 128, 16, 8, 4),
           (64, 128, 8, 4, 5), (128, 128, 1, 4, 4)]

#: Extra tiles for the swapped w8a8 dots (``SWAP_AB``: the weight tile on the warpgroup MMA's M side), which keep
#: fp8 tiles in shared memory and so fit more stages.
_SWAP = [(64, 128, 1, 4, 5), (128, 128, 1, 8, 3), (128, 128, 1, 4, 4)]


def tile_candidates(block_m: int, kernel: str, default: dict[str, Any], elem: int,
                    swap: bool = False, pre: bool = False) -> list[dict[str, Any]]:
    """Tile configs for one kernel ("gate_up" or "down") at this BLOCK_SIZE_M, prior order, deduplicated,
    shared-memory-feasible; the default config's tiles come first when its BLOCK_SIZE_M matches. ``swap`` (the
    fp8 w8a8 mode at row blocks up to 32): every tile at least 64 wide in N also swapped, plus :data:`_SWAP`;
    each candidate then says ``SWAP_AB`` explicitly, so that a ``down`` override never inherits gate/up's.
    ``pre`` (the pre-quantised w8a8 mode): the :data:`_PRE_GU` / :data:`_PRE_DN` tiles, one byte per element."""
    table = {("gate_up", "small"): _SMALL_GU, ("down", "small"): _SMALL_DN, ("gate_up", "mid"): _MID_GU,
             ("down", "mid"): _MID_DN, ("gate_up", "big"): _BIG_GU, ("down", "big"): _BIG_DN}
    size = "small" if block_m <= 32 else "mid" if block_m <= 64 else "big"
    out: list[dict[str, Any]] = []
    if default["BLOCK_SIZE_M"] == block_m and not pre:
        src = default if kernel == "gate_up" else fm.down_config(default)
        out.append({k: src[k] for k in fm.TILE_KEYS})
    tiles = (_PRE_GU if kernel == "gate_up" else _PRE_DN) if pre else table[(kernel, size)]
    for bn, bk, gm, warps, stages in tiles:
        cfg = {"BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm, "num_warps": warps, "num_stages": stages}
        b_tiles = 2 if kernel == "gate_up" else 1
        if stages * (block_m * bk + b_tiles * bk * bn) * elem > fm.SMEM_LIMIT or cfg in out:
            continue
        out.append(cfg)
    if not (swap and block_m <= 32):
        return out
    swapped = [{**c, "SWAP_AB": 1} for c in out if c["BLOCK_SIZE_N"] >= 64]
    swapped += [{"BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm, "num_warps": warps, "num_stages": st,
                 "SWAP_AB": 1} for bn, bk, gm, warps, st in _SWAP]
    plain = [{**c, "SWAP_AB": 0} for c in out]
    return plain + [c for i, c in enumerate(swapped) if c not in swapped[:i]]


def bench_us(fn: Callable[[], Any], rep_ms: int) -> float:
    """Median µs with L2 flushed between runs (weights come from HBM, as in serving)."""
    return triton.testing.do_bench(fn, warmup=max(1, rep_ms // 5), rep=rep_ms, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    del a, b
    return 2 * (1 << 30) / (ms * 1e-3)


def tune_one_m(m: int, deadline: float, w: dict[str, torch.Tensor], top_k: int, limit: float, rep_ms: int,
               gen: torch.Generator, a_fp8: int | None = None,
               incumbent: dict[str, Any] | None = None) -> dict[str, Any]:
    """Search until ``deadline`` (monotonic seconds) for M tokens; return the chosen config + numbers.
    ``w`` may carry ``scales`` (gate, up, down): the fp8-weight path, in the mode ``a_fp8`` (None: what
    :func:`fused_moe` defaults to at M). ``incumbent`` (the output table's entry for M) is timed end to end too and
    kept when it is faster, so a run that tunes one mode never replaces a faster entry of another."""
    wg, wu, wd = w["gate"], w["up"], w["down"]
    sc = w.get("scales")
    e, inter, hidden = wg.shape
    dtype = torch.bfloat16 if sc is not None else wg.dtype
    x = torch.randn(m, hidden, device=wg.device, dtype=dtype, generator=gen)
    ids = torch.rand(m, e, device=wg.device, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(m, top_k, device=wg.device, generator=gen)
    h = torch.empty(m * top_k, inter, device=wg.device, dtype=dtype)
    y = torch.empty(m * top_k, hidden, device=wg.device, dtype=dtype)
    # fp8 experts: tune the mode asked for, else the one fused_moe runs without a table entry
    mode = {"A_FP8": fm.DEFAULT_A_FP8 if a_fp8 is None else a_fp8} if sc is not None else {}
    pre = mode.get("A_FP8") == 2
    default = {**fm.default_config(m, top_k, e, dtype), **mode}
    # smem estimate: A tiles in bf16 dominate unless they arrive as e4m3 (pre-quantised)
    elem = 1 if pre else 2 if sc is not None else wg.element_size()
    x_in = fm.QuantRows.of(x) if pre else x
    if pre:
        h = fm.QuantRows.empty(m * top_k, inter, dtype, wg.device)

    # one job list, round-robin over (BLOCK_SIZE_M, kernel) by candidate rank so every BLOCK_SIZE_M gets
    # its best-prior tiles before anyone's long tail
    lanes = []
    for bm in block_m_candidates(m, top_k, e):
        for kernel in ("gate_up", "down"):
            lanes.append([(bm, kernel, c) for c in tile_candidates(bm, kernel, default, elem,
                                                                   swap=bool(mode.get("A_FP8")), pre=pre)
                          if sc is None or c["BLOCK_SIZE_N"] <= fm.FP8_BLOCK])
    jobs = [lane[i] for i in range(max(len(lane) for lane in lanes)) for lane in lanes if i < len(lane)]

    routings: dict[int, fm.AlignedRouting] = {}
    best: dict[tuple[int, str], tuple[float, dict[str, Any]]] = {}
    tried = failed = 0
    for bm, kernel, tiles in jobs:
        complete = any((bm_, "gate_up") in best and (bm_, "down") in best for bm_ in routings)
        if complete and time.monotonic() > deadline - FINAL_RESERVE_S:
            break
        cfg = {"BLOCK_SIZE_M": bm, **tiles, **mode}
        try:
            if bm not in routings:
                routings[bm] = fm.moe_align_block_size(ids, e, bm)
            r = routings[bm]
            if kernel == "gate_up":
                us = bench_us(lambda: fm.moe_gate_up(x_in, wg, wu, r, top_k, limit, cfg, out=h,
                                                     scales=None if sc is None else sc[:2]), rep_ms)
            else:
                us = bench_us(lambda: fm.moe_down(h, wd, weights, r, cfg, out=y,
                                                  scale=None if sc is None else sc[2]), rep_ms)
        except Exception as exc:  # compile failure, out of resources, OOM: skip this candidate
            failed += 1
            log.warning("M=%d %s %s failed: %s: %s", m, kernel, cfg, type(exc).__name__, str(exc).splitlines()[:1])
            torch.cuda.empty_cache()
            continue
        tried += 1
        log.debug("M=%d %s %s: %.1f us", m, kernel, cfg, us)
        if (bm, kernel) not in best or us < best[(bm, kernel)][0]:
            best[(bm, kernel)] = (us, tiles)

    # pick BLOCK_SIZE_M by alignment + best gate_up + best down
    choice, choice_us = None, float("inf")
    for bm in routings:
        if (bm, "gate_up") not in best or (bm, "down") not in best:
            continue
        align_us = bench_us(lambda: fm.moe_align_block_size(ids, e, bm), rep_ms)
        total = align_us + best[(bm, "gate_up")][0] + best[(bm, "down")][0]
        log.info("M=%d BLOCK_SIZE_M=%d: align %.1f + gate_up %.1f + down %.1f = %.1f us", m, bm, align_us,
                 best[(bm, "gate_up")][0], best[(bm, "down")][0], total)
        if total < choice_us:
            dn = best[(bm, "down")][1]
            choice = {"BLOCK_SIZE_M": bm, **best[(bm, "gate_up")][1], **mode}
            if dn != best[(bm, "gate_up")][1]:
                choice["down"] = dict(dn)
            choice_us = total
    if choice is None:
        log.error("M=%d: no candidate ran; keeping the default %s", m, default)
        choice = default

    # end to end, vs the default, and a correctness check against the torch per-expert loop
    full_us = bench_us(lambda: fm.fused_moe(x, wg, wu, wd, weights, ids, limit, config=choice, scales=sc), rep_ms)
    default_us = bench_us(lambda: fm.fused_moe(x, wg, wu, wd, weights, ids, limit, config=default, scales=sc), rep_ms)
    got = fm.fused_moe(x, wg, wu, wd, weights, ids, limit, config=choice, scales=sc).float()
    # the w8a8 mode against the reference that quantises x and h the same way (its composite bound is 2e-2 too:
    # tests/test_kernels_fp8.py, W8A8_MOE_BOUND)
    ref = fused_moe_ref(x, wg, wu, wd, weights, ids, limit, scales=sc,
                        quant_act=bool(mode.get("A_FP8"))).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    if not rel < 2e-2:
        log.error("M=%d: tuned config %s disagrees with the reference (rel %.3g); keeping the default", m, choice, rel)
        choice, full_us = default, default_us
    elif default_us < full_us:  # separate-kernel timings can mislead by a few µs; keep the faster whole
        choice, full_us = default, default_us
    kept = False
    if incumbent is not None and incumbent != choice:
        incumbent_us = bench_us(lambda: fm.fused_moe(x, wg, wu, wd, weights, ids, limit, config=incumbent,
                                                     scales=sc), rep_ms)
        log.info("M=%d: the table's entry takes %.1f us, this run's choice %.1f us", m, incumbent_us, full_us)
        if incumbent_us < full_us:
            choice, full_us, kept = incumbent, incumbent_us, True
            ref = fused_moe_ref(x, wg, wu, wd, weights, ids, limit, scales=sc,
                                quant_act=bool(incumbent.get("A_FP8", fm.DEFAULT_A_FP8))).float()
            got = fm.fused_moe(x, wg, wu, wd, weights, ids, limit, config=choice, scales=sc).float()
            rel = ((got - ref).norm() / ref.norm()).item()
    touched = int(torch.unique(ids).numel())
    flops, nbytes = fm.moe_forward_flops_bytes(m, touched, hidden, inter, top_k, elem)
    if sc is not None:  # weights are one byte each plus their scales, activations stay bf16
        nbytes -= touched * 3 * hidden * inter * (elem - 1) - touched * 3 * (hidden // 128) * (inter // 128) * 4
    return {"config": choice, "us": full_us, "default_us": default_us, "TFLOPs": flops / (full_us * 1e-6) / 1e12,
            "GBps": nbytes / (full_us * 1e-6) / 1e9, "experts_touched": touched, "rel_err_vs_torch": rel,
            "candidates_timed": tried, "candidates_failed": failed, "kept_table_entry": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=150.0, help="total wall-clock budget (s), setup included")
    ap.add_argument("--out", type=Path, default=fm.CONFIG_DIR, help="directory (default file name) or .json path")
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--limit", type=float, default=10.0, help="swiglu_limit (does not affect speed)")
    ap.add_argument("--ms", type=str, default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--rep-ms", type=int, default=20, help="do_bench repetition time per candidate")
    ap.add_argument("--fp8", action="store_true", help="tune the fp8-weight path (e4m3 experts, block scales)")
    ap.add_argument("--a-fp8", type=int, choices=(0, 1, 2), default=None,
                    help="with --fp8: the activation mode to tune (0 W8A16, 1 w8a8 quantised in the kernels, "
                         "2 w8a8 quantised once); default: what fused_moe picks per token count")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    t0 = time.monotonic()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe needs a CUDA GPU")
    dtype = torch.bfloat16
    ms = [int(v) for v in args.ms.split(",") if v]
    e, hidden, inter, k = args.experts, args.hidden, args.inter, args.top_k
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    log.info("allocating experts E=%d H=%d I=%d bf16 (%.1f GB)", e, hidden, inter, 3 * e * hidden * inter * 2 / 1e9)
    w = {"gate": torch.empty(e, inter, hidden, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen),
         "up": torch.empty(e, inter, hidden, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen),
         "down": torch.empty(e, hidden, inter, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen)}
    if args.fp8:
        from glm5_kernels.fp8_ref import quantize_fp8_block
        scales = []
        for name in ("gate", "up", "down"):
            t = w[name]
            q = torch.empty(t.shape, dtype=fm.FP8_DTYPE, device=dev)
            s = torch.empty(e, t.shape[1] // 128, t.shape[2] // 128, device=dev)
            for lo in range(0, e, 16):
                q[lo:lo + 16], s[lo:lo + 16] = quantize_fp8_block(t[lo:lo + 16])
            w[name] = q
            scales.append(s)
            del t
        w["scales"] = tuple(scales)
        torch.cuda.empty_cache()
    bw = copy_bandwidth()
    log.info("device %s, copy bandwidth %.0f GB/s, setup took %.1f s", torch.cuda.get_device_name(),
             bw / 1e9, time.monotonic() - t0)

    out = args.out
    if out.suffix != ".json":
        out = out / fm.config_file_name(e, hidden, inter, dtype, fm.device_name(dev), fp8_weights=args.fp8)
    old = json.loads(out.read_text()) if out.exists() else {}
    start = time.monotonic()
    remaining = args.budget_s - (start - t0)
    # later M cost more per measurement: give them proportionally a little more time
    shares = [1.0 + 0.1 * i for i in range(len(ms))]
    results: dict[int, dict[str, Any]] = {}
    for i, m in enumerate(ms):
        deadline = start + remaining * sum(shares[:i + 1]) / sum(shares)
        try:
            results[m] = tune_one_m(m, deadline, w, k, args.limit, args.rep_ms, gen, a_fp8=args.a_fp8,
                                    incumbent=old.get(str(m)))
        except torch.cuda.OutOfMemoryError as exc:
            log.error("M=%d: out of memory (%s); skipped", m, str(exc).splitlines()[0])
            torch.cuda.empty_cache()
            continue
        r = results[m]
        log.info("M=%d done at %.0f s: %.1f us (default %.1f us), %.1f TFLOP/s, %.0f GB/s, config %s", m,
                 time.monotonic() - t0, r["us"], r["default_us"], r["TFLOPs"], r["GBps"], r["config"])

    out.parent.mkdir(parents=True, exist_ok=True)
    # token counts this run did not tune keep their entries (and their recorded numbers)
    table: dict[str, Any] = {m: c for m, c in old.items() if not m.startswith("_")}
    table.update({str(m): r["config"] for m, r in results.items()})
    table = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    table["_meta"] = {"top_k": k, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "budget_s": args.budget_s, "copy_GBps": bw / 1e9,
                      "tuned_ms": sorted(results),
                      "results": {**old.get("_meta", {}).get("results", {}),
                                  **{str(m): {kk: v for kk, v in r.items() if kk != "config"} for m, r in results.items()}}}
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"\nwrote {out} ({len(results)} entries tuned, {len(table) - 1 - len(results)} kept) in "
          f"{time.monotonic() - t0:.0f} s; copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'M':>6} {'best_us':>9} {'default_us':>10} {'TFLOP/s':>8} {'GB/s':>7} {'experts':>7}  config")
    for m, r in results.items():
        print(f"{m:>6} {r['us']:>9.1f} {r['default_us']:>10.1f} {r['TFLOPs']:>8.1f} {r['GBps']:>7.0f} "
              f"{r['experts_touched']:>7}  {json.dumps(r['config'])}")


if __name__ == "__main__":
    main()
