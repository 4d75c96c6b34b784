"""Where a batch-1 decode step's time goes beyond its kernels, and how much an 8K prefill varies run to run.

``python bench/step_anatomy.py OUT.json`` (CUDA GPU, bench config of ``bench.py``): for the b1 ctx-1K decode
graph it times, over 50 steps each, (a) host staging alone (``DecodeStager.stage``, pinned writes + H2D
enqueue), (b) ``graph.replay()`` measured by CUDA events on the stream (the graph's GPU span: kernels plus
the gaps between them), (c) the whole step as ``bench.py`` times it (stage + replay + sync), and the summed
kernel time of one step from the profiler; then five single 8K prefills (each synced) to show the spread
that a median of three hides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode, graph_step_anatomy, kernel_profile, prefill_once  # noqa: E402


def main(out_path: Path) -> None:
    out: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    s = Setup(1, 32768)
    captured = captured_decode(s, 1, 1024)
    stager, planner, _, rows, _ = captured
    anatomy = graph_step_anatomy(captured, reps=50)
    prof = kernel_profile(s, lambda: s.model.forward(stager.stage(rows, 1, planner), s.cache),
                          Path("/tmp/step_anatomy_profile.txt"))
    out["decode_b1_ctx1024"] = {**anatomy, "kernels": prof["cuda_kernels"], "kernel_time_ms": prof["kernel_time_s"] * 1e3}
    print(json.dumps(out), flush=True)
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
    return ap.parse_args(argv)


if __name__ == "__main__":
    main(_args().out)
