"""Time the streaming GEMV against cuBLAS for bf16 weights at the model's linear shapes; write the table it reads.

``python bench/gemv16_table.py --out DIR [--ms 1,2,4] [--budget-s 200] [--write-table]`` (CUDA GPU).

For each (N, K) of ``fp8_check.SHAPES`` (the GLM-5.3-Flash linears, fused as the model runs them) and the LM
head, and each M: cuBLAS (``F.linear``) and :func:`glm5_kernels.gemv.gemv16` at the tile candidates below, each
in a CUDA graph that cycles through enough copies of the weight (at least 512 MB) that none is read from L2, as
in a decode step, which streams every weight once. A candidate must match the fp32 product within 1e-2
(relative Frobenius) to count. The fastest candidate becomes the entry for (N, K, M) if it beats cuBLAS by more
than ``--margin`` (default 3 %), else ``{"impl": "torch"}``.

Writes ``DIR/gemv16.json`` (every time, in µs and TB/s of weight bytes, and the copy bandwidth measured first)
and ``DIR/gemv16_table.json``; ``--write-table`` also merges it into
``kernels/glm5_kernels/configs/gemv16_{device}.json`` (what :func:`glm5_kernels.gemv.linear16` reads; commit it).
Stops starting new shapes when ``--budget-s`` is spent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "kernels"), str(ROOT / "backend")]
from fp8_check import SHAPES, merge_tables  # noqa: E402
from kernel_bench import copy_bw  # noqa: E402
from glm5_kernels import gemv  # noqa: E402

LM_HEAD = ("lm_head", 154880, 4096)
#: (BLOCK_N, BLOCK_K at one row, SPLIT_K, num_warps, num_stages); with M rows BLOCK_K shrinks M-fold (at least
#: 128) so the fp32 accumulator (BLOCK_M · BLOCK_N · BLOCK_K over the block's threads) stays in registers.
CANDIDATES = [(4, 2048, 1, 4, 4), (4, 2048, 2, 4, 4), (4, 2048, 1, 4, 2), (8, 1024, 1, 4, 2), (8, 1024, 1, 4, 4),
              (4, 1024, 1, 8, 2), (16, 1024, 1, 8, 2), (2, 4096, 1, 4, 2), (8, 2048, 1, 8, 4), (4, 1024, 2, 4, 4)]
ROTATE_BYTES = 512 << 20
BOUND = 1e-2


def graph_us(fns: list[Callable[[], Any]], rounds: int = 10) -> float:
    """Median µs per call over 5 replays of a CUDA graph that calls each of ``fns`` ``rounds`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (rounds * len(fns)))
    return sorted(times)[len(times) // 2]


def candidates(m: int) -> list[dict[str, Any]]:
    bm = 1 << (m - 1).bit_length()
    out, seen = [], set()
    for bn, bk, split, warps, stages in CANDIDATES:
        cfg = {"impl": "gemv_fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": max(128, bk // bm), "SPLIT_K": split,
               "num_warps": warps, "num_stages": stages}
        key = tuple(cfg[k] for k in gemv.GEMV_KEYS)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def label(cfg: dict[str, Any]) -> str:
    return "/".join(str(cfg[k]) for k in gemv.GEMV_KEYS)


def time_shape(name: str, n: int, k: int, ms: list[int], margin: float, log) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    copies = max(1, min(64, -(-ROTATE_BYTES // (n * k * 2))))
    ws = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16() for _ in range(copies)]
    nbytes = n * k * 2
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        ref = F.linear(x.float(), ws[0].float())
        row: dict[str, Any] = {"shape": name, "N": n, "K": k, "M": m, "copies": copies, "us": {}, "errors": {}}
        row["us"]["cublas"] = graph_us([lambda w=w: F.linear(x, w) for w in ws])
        for cfg in candidates(m):
            lbl = label(cfg)
            try:
                err = float((gemv.gemv16(x, ws[0], None, cfg).float() - ref).norm() / ref.norm())
                if err > BOUND:
                    row["errors"][lbl] = f"relative error {err:.3g} > {BOUND}"
                    continue
                row["us"][lbl] = graph_us([lambda w=w, cfg=cfg: gemv.gemv16(x, w, None, cfg) for w in ws])
            except Exception as e:  # a tile that does not compile or fit: record it, keep the others
                row["errors"][lbl] = f"{type(e).__name__}: {str(e)[:200]}"
        kernel = {lbl: us for lbl, us in row["us"].items() if lbl != "cublas"}
        best = min(kernel, key=kernel.get) if kernel else None
        row["TBps"] = {lbl: nbytes / us / 1e6 for lbl, us in row["us"].items()}
        if best is not None and kernel[best] * (1 + margin) < row["us"]["cublas"]:
            row["choice"] = next(c for c in candidates(m) if label(c) == best)
        else:
            row["choice"] = {"impl": "torch"}
        row["best"] = best
        row["speedup_vs_cublas"] = row["us"]["cublas"] / kernel[best] if best else None
        log(row)
        rows.append(row)
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--ms", default="1,2,4", help="comma-separated M values")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget; no new shape after it")
    ap.add_argument("--margin", type=float, default=0.03, help="how much faster than cuBLAS a tile must be")
    ap.add_argument("--write-table", action="store_true",
                    help="also merge the choices into kernels/glm5_kernels/configs/gemv16_{device}.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv16_table needs a CUDA GPU")
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    from bench import jsonl_logger
    log = jsonl_logger(args.out / "gemv16.log")
    res: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "command": " ".join(sys.argv), "copy_TBps": copy_bw() / 1e12, "rows": []}
    ms = [int(v) for v in args.ms.split(",") if v]
    for name, n, k in [*SHAPES, LM_HEAD]:
        if time.monotonic() - t0 > args.budget_s:
            res["rows"].append({"shape": name, "N": n, "K": k, "skipped": "budget spent"})
            continue
        res["rows"] += time_shape(name, n, k, ms, args.margin, log)
        (args.out / "gemv16.json").write_text(json.dumps(res, indent=1) + "\n")
    table: dict[str, Any] = {}
    for r in res["rows"]:
        if "choice" in r:
            table.setdefault(f"{r['N']},{r['K']}", {})[str(r["M"])] = r["choice"]
    table["_meta"] = {"device": res["gpu"], "torch": res["torch"], "date": res["date"], "command": res["command"]}
    res["seconds"] = round(time.monotonic() - t0, 1)
    (args.out / "gemv16.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "gemv16_table.json").write_text(json.dumps(table, indent=1) + "\n")
    if args.write_table:
        path = gemv.CONFIG_DIR / gemv.table16_file_name(gemv.device_name(None))
        merged = merge_tables(json.loads(path.read_text()) if path.exists() else {}, table)
        path.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"copy {res['copy_TBps']:.2f} TB/s")
    print(f"{'shape':<26} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>9} {'TB/s':>5} {'best us':>8} {'TB/s':>5}  choice")
    for r in res["rows"]:
        if r.get("best"):
            b = r["best"]
            print(f"{r['shape']:<26} {r['N']:>6} {r['K']:>6} {r['M']:>3} {r['us']['cublas']:>9.1f} "
                  f"{r['TBps']['cublas']:>5.2f} {r['us'][b]:>8.1f} {r['TBps'][b]:>5.2f}  {r['choice']['impl']} {b}")
    print(f"wrote {args.out / 'gemv16.json'} in {res['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
