"""Where a CUDA-graph decode step's time goes: its kernels as the graph runs them, and the gaps between them.

``bench.py`` profiles the *eager* step, so "graph step minus kernel time" mixes three things: the host
staging before the replay, the idle time between the graph's nodes, and any difference between a kernel's
duration in the graph and eagerly. This tool separates them for one (weight dtype, batch) of the bench
config: host staging alone, the replay's GPU span by CUDA events, and a profiler trace of replays (kernels,
memsets and copies with their start times), from which it sums the kernel time inside the graph and each
idle gap, and ranks the gaps by the kernel before and after them.

``--prefill N`` traces one eager ``N``-token prefill (4096-token chunks, after two warm-ups) instead: its wall
time, the kernels' busy time, and the idle gaps split by who was late. A gap is *host-late* when the call that
launched the next kernel returned after the previous kernel had finished (the GPU waited for the CPU); the
rest of the idle time passed with the next kernel already queued (launch latency, stream dependencies).

Usage: ``python bench/graph_gaps.py OUT.json [--weight-dtype float8_e4m3fn] [--batch 1] [--ctx 1024]
[--gemv-impl table|gemv|gemv_w8a8|gemv_fma] [--prefill N]`` on a CUDA GPU. ``--gemv-impl`` sends every fp8 linear with at
most 64 rows (the FMA GEMV: at most 4) to one GEMV implementation with its default tiles instead of the
measured table's choice (a diagnostic: does mixing implementations cost idle time between them?).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode, graph_step_anatomy, prefill_once, timed  # noqa: E402


def force_gemv_impl(impl: str) -> None:
    """Route fp8 linears of <= 64 rows to ``impl`` with default tiles (``table``: leave the choice alone)."""
    if impl == "table":
        return
    from glm5_kernels import fp8_linear as fl
    orig = fl.select_impl

    def select(m, n, k, dtype, device):
        if m > fl.GEMV_MAX_M or dtype == torch.float32 or (impl == "gemv_fma" and m > 4):
            return orig(m, n, k, dtype, device)  # the FMA GEMV's 3D accumulator holds a few rows only
        cfg = fl.default_gemv_config(m, n, k)
        if impl == "gemv_fma":
            cfg.update(BLOCK_M=max(1, m), BLOCK_N=16, BLOCK_K=256, num_stages=2)
        return {**cfg, "impl": impl}
    fl.select_impl = select


def chrome_events(prof) -> list[dict]:
    """Every event of a profiler run, as its chrome trace holds them."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]


def trace_events(raw: list[dict]) -> list[dict]:
    """GPU activity of a profiler run (kernels, memsets, memcpys), sorted by start: name, cat, ts, dur (µs) and
    the correlation id that ties each to the host call that launched it."""
    gpu = [e for e in raw if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(({"name": e["name"], "cat": e["cat"], "ts": float(e["ts"]), "dur": float(e["dur"]),
                    "corr": e.get("args", {}).get("correlation")} for e in gpu), key=lambda e: e["ts"])


def launch_ends(raw: list[dict]) -> dict:
    """Correlation id -> the time (µs) the runtime/driver call that launched it returned."""
    return {e["args"]["correlation"]: float(e["ts"]) + float(e["dur"]) for e in raw
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
            and "correlation" in e.get("args", {})}


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:60]


def split_steps(events: list[dict], per_step: int) -> list[list[dict]]:
    return [events[i:i + per_step] for i in range(0, len(events) - per_step + 1, per_step)]


def analyse(step: list[dict], launched: dict | None = None) -> dict:
    """Kernel time, idle gaps and their ranking by (previous, next) activity within one replay (or one eager
    run); with ``launched`` (``launch_ends``) the idle time is split into host-late and queued gaps."""
    gaps = collections.defaultdict(lambda: [0, 0.0])
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    idle = host_late = 0.0
    for prev, nxt in zip(step, step[1:]):
        prev_end = prev["ts"] + prev["dur"]
        gap = max(0.0, nxt["ts"] - prev_end)
        idle += gap
        if launched is not None and launched.get(nxt["corr"], -1.0) > prev_end:
            host_late += gap
        key = f"{short(prev['name'])} -> {short(nxt['name'])}"
        gaps[key][0] += 1
        gaps[key][1] += gap
    for e in step:
        per_kernel[short(e["name"])][0] += 1
        per_kernel[short(e["name"])][1] += e["dur"]
    span = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
    split = {} if launched is None else {"host_late_idle_us": host_late, "queued_idle_us": idle - host_late}
    return {"activities": len(step), "span_us": span, "busy_us": sum(e["dur"] for e in step), "idle_us": idle,
            **split,
            "non_kernel": collections.Counter(e["cat"] for e in step if e["cat"] != "kernel"),
            "gaps_by_pair": sorted(([k, n, round(t, 2), round(t / n, 2)] for k, (n, t) in gaps.items()),
                                   key=lambda r: -r[2])[:25],
            "kernels": sorted(([k, n, round(t, 2), round(t / n, 2)] for k, (n, t) in per_kernel.items()),
                              key=lambda r: -r[2])[:25]}


def prefill_timeline(args: argparse.Namespace, out: dict) -> None:
    """One eager ``args.prefill``-token prefill: wall time, then a trace of it with the host's launch calls."""
    n, chunk = args.prefill, 4096
    s = Setup(1, 1024, args.weight_dtype, max_prefill=n)
    out["prefill_tokens"], out["chunk"] = n, chunk
    out["wall_s"] = timed(lambda: prefill_once(s, n, chunk), 3, warmup=2)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        prefill_once(s, n, chunk)
        torch.cuda.synchronize()
    raw = chrome_events(prof)
    out["profile"] = analyse(trace_events(raw), launch_ends(raw))


def replay_timeline(args: argparse.Namespace, out: dict) -> None:
    """The CUDA-graph decode step: host staging and the replay's span, then a trace of replays."""
    b = args.batch
    s = Setup(b, args.ctx, args.weight_dtype)
    captured = captured_decode(s, b, args.ctx)
    graph = captured[-1]
    out.update(graph_step_anatomy(captured, reps=30))
    # one replay alone to count its activities, then several back to back (steady state)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    per_step = len(trace_events(chrome_events(prof)))
    reps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    events = trace_events(chrome_events(prof))
    out["activities_per_replay"] = per_step
    steps = [analyse(st) for st in split_steps(events, per_step)] if per_step > 1 else []
    if steps:
        out["replays"] = [{k: r[k] for k in ("span_us", "busy_us", "idle_us")} for r in steps]
        out["profile"] = min(steps, key=lambda r: r["span_us"])


def main(args: argparse.Namespace) -> None:
    force_gemv_impl(args.gemv_impl)
    out: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
                 "weight_dtype": args.weight_dtype, "batch": args.batch, "ctx": args.ctx, "gemv_impl": args.gemv_impl}
    (prefill_timeline if args.prefill else replay_timeline)(args, out)
    print(json.dumps({k: v for k, v in out.items() if k != "profile"}, default=str), flush=True)
    if "profile" in out:
        print(json.dumps(out["profile"], default=str), flush=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--weight-dtype", default="float8_e4m3fn", choices=("bfloat16", "float8_e4m3fn"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--gemv-impl", default="table", choices=("table", "gemv", "gemv_w8a8", "gemv_fma"))
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="trace an N-token prefill instead")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main(_args())
