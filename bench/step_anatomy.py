"""Where a batch-1 decode step's time goes beyond its kernels, and how much an 8K prefill varies run to run.

``python bench/step_anatomy.py OUT.json`` (CUDA GPU, bench config of ``bench.py``): for the b1 ctx-1K decode
graph it times, over 50 steps each, (a) host staging alone (``DecodeStager.stage``, pinned writes + H2D
enqueue), (b) ``graph.replay()`` measured by CUDA events on the stream (the graph's GPU span: kernels plus
the gaps between them), (c) the whole step as ``bench.py`` times it (stage + replay + sync), and the summed
kernel time of one step from the profiler, the host time of the ``graph.replay()`` call alone (the launch),
and a ``cProfile`` table of 500 staging calls (which host calls the staging time goes to); then, unless
``--decode-only``, five single 8K prefills (each synced) to show the spread that a median of three hides.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode, graph_step_anatomy, kernel_profile, prefill_once  # noqa: E402


def replay_launch_us(graph, reps: int = 50) -> float:
    """Median host µs of the ``graph.replay()`` call itself (each replay synced before the next)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def stage_profile(stager, planner, rows, calls: int = 500, top: int = 15) -> list[dict]:
    """``cProfile`` of ``calls`` staging calls (synced between calls, as in a step): per function, µs per
    staging call of its own time and with its callees, largest own time first. cProfile adds its own cost per
    Python call, so the sum exceeds the unprofiled staging time; the split is what it is for."""
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        stager.stage(rows, len(rows), planner)
        prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    out = [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_stage": cc / calls, "own_us": tt / calls * 1e6,
            "cum_us": ct / calls * 1e6}
           for (f, line, name), (cc, _, tt, ct, _) in st.stats.items()]
    return sorted(out, key=lambda r: -r["own_us"])[:top]


def main(out_path: Path, decode_only: bool = False) -> None:
    out: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    s = Setup(1, 32768)
    captured = captured_decode(s, 1, 1024)
    stager, planner, _, rows, _ = captured
    anatomy = graph_step_anatomy(captured, reps=50)
    prof = kernel_profile(s, lambda: s.model.forward(stager.stage(rows, 1, planner), s.cache),
                          Path("/tmp/step_anatomy_profile.txt"))
    out["decode_b1_ctx1024"] = {**anatomy, "kernels": prof["cuda_kernels"], "kernel_time_ms": prof["kernel_time_s"] * 1e3,
                                "replay_launch_us": replay_launch_us(captured[4]),
                                "stage_profile": stage_profile(stager, planner, rows)}
    print(json.dumps(out), flush=True)
    if decode_only:
        out_path.write_text(json.dumps(out, indent=1))
        return
    prefill_once(s, 8192, 4096)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        prefill_once(s, 8192, 4096)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["prefill_8192_s"] = times
    out["prefill_8192_tflops"] = [s.prefill_flops(8192) / t / 1e12 for t in times]
    print(json.dumps(out), flush=True)
    out_path.write_text(json.dumps(out, indent=1))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill spread")
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = _args()
    main(a.out, a.decode_only)
