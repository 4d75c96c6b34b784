"""Programmatic dependent launch on and off in one process: two CUDA graphs of the same decode step, timed in turn.

``python bench/pdl_ab.py OUT.json [--batches 1 64] [--ctx 1024] [--reps 200] [--weight-dtypes bfloat16,float8_e4m3fn]``
(CUDA GPU, bench config of ``bench.py``). Runs on different leases, or minutes apart on one, differed by more
than PDL's effect on a decode step (``bench/results/limits.md``), so this script captures the step twice on one
Setup, once with ``GLM5_PDL=0`` and once with ``GLM5_PDL=1`` (the setting is read when kernels are launched,
so each graph keeps the one it was captured with), then times ``reps`` steps of each, alternating which goes
first in a pair. It writes the medians, the median of the per-pair ratios and each graph's step times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode  # noqa: E402


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def timed_step(captured) -> float:
    """Seconds of one decode step as ``bench.py`` times it: stage + replay + sync."""
    _, _, runner, rows, _ = captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.run(rows)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ab(s: Setup, batch: int, ctx: int, reps: int) -> dict:
    from glm5_kernels.pdl import ENV, pdl_enabled
    before = os.environ.get(ENV)
    graphs = {}
    try:
        for flag in ("0", "1"):
            os.environ[ENV] = flag
            if pdl_enabled(torch.device("cuda")) != (flag == "1"):
                raise SystemExit(f"{ENV}={flag} does not give PDL {'on' if flag == '1' else 'off'} here (PDL needs "
                                 "compute capability >= 9.0 and Triton >= 3.4): the two graphs would be the same")
            graphs[flag] = captured_decode(s, batch, ctx)
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    steps, ratios = paired_steps(graphs["0"], graphs["1"], reps)
    return {"batch": batch, "ctx": ctx, "weight_dtype": s.weight_dtype, "reps": reps,
            "pdl_off_ms": _median(steps[0]) * 1e3, "pdl_on_ms": _median(steps[1]) * 1e3,
            "on_over_off_median_pair": _median(ratios), "steps_off_s": steps[0], "steps_on_s": steps[1]}


def paired_steps(a, b, reps: int) -> tuple[tuple[list[float], list[float]], list[float]]:
    """``reps`` steps of each of two captured decode steps (:func:`bench.captured_decode`), timed in pairs
    whose order alternates: (step seconds of ``a``, of ``b``), and each pair's ``b / a``."""
    steps: tuple[list[float], list[float]] = ([], [])
    ratios = []
    for i in range(reps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        pair = {j: timed_step((a, b)[j]) for j in order}
        steps[0].append(pair[0])
        steps[1].append(pair[1])
        ratios.append(pair[1] / pair[0])
    return steps, ratios


def run_ab(make_ab, description: str, tool: str, default_batches: list[int], argv: list[str] | None = None,
           add_args=None) -> int:
    """The command line of an A/B tool: ``make_ab(args)`` gives ``ab(setup, batch, ctx, reps)``, run per weight
    dtype and batch, each row printed and the JSON rewritten as rows arrive (a run cut short keeps what it
    measured). ``add_args(parser)`` adds the tool's own options."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=default_batches)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200, help="steps per setting")
    ap.add_argument("--weight-dtypes", default="bfloat16,float8_e4m3fn")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    ab_fn = make_ab(args)
    if not torch.cuda.is_available():
        raise SystemExit(f"bench/{tool} needs a CUDA GPU")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv), "rows": []}
    for wdt in [d.strip() for d in args.weight_dtypes.split(",") if d.strip()]:
        s = Setup(max(args.batches), args.ctx, wdt)
        for b in args.batches:
            row = ab_fn(s, b, args.ctx, args.reps)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("steps_")}), flush=True)
            args.out.write_text(json.dumps(res, indent=1))
        s.close()
        del s
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_ab(lambda args: ab, __doc__.split("\n\n")[0], "pdl_ab.py", [1, 64], argv)


if __name__ == "__main__":
    raise SystemExit(main())
