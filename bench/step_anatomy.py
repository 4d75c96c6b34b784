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
from bench import Setup, decode_rows, kernel_profile, median, prefill_once  # noqa: E402


def main(out_path: Path) -> None:
    from glm5.engine.cuda_graph import DecodeAttentionPlanner, DecodeGraphRunner, DecodeStager

    out: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    s = Setup(1, 32768)
    s.recording = False
    stager = DecodeStager(s.cache, 1, s.blocks_per_req, torch.device("cuda"))
    planner = DecodeAttentionPlanner(s.cfg.text, 1, torch.bfloat16, torch.device("cuda"))
    runner = DecodeGraphRunner(s.model, s.cache, stager, [1], prepare=planner)
    runner.capture()
    rows = decode_rows(s, 1, 1024)
    graph, _ = runner.graphs[1]
    for _ in range(5):
        runner.run(rows)
    torch.cuda.synchronize()
    stage, replay, step = [], [], []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(50):
        t0 = time.perf_counter()
        stager.stage(rows, 1, planner)
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
    prof = kernel_profile(s, lambda: s.model.forward(stager.stage(rows, 1, planner), s.cache),
                          Path("/tmp/step_anatomy_profile.txt"))
    out["decode_b1_ctx1024"] = {"host_stage_ms": median(stage) * 1e3, "graph_replay_gpu_ms": median(replay) * 1e3,
                                "step_ms": median(step) * 1e3, "kernels": prof["cuda_kernels"],
                                "kernel_time_ms": prof["kernel_time_s"] * 1e3}
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
