"""Is the distributed path at world size 1 slower than the plain path, or is the second Setup of a process slower?

``python bench/distributed_order_check.py OUT.json [BATCH ...]`` (one CUDA GPU; ~2 min for batches 1 64 256). ``bench.py --distributed`` compares
the world-size-1 step with the plain step measured *first* in the same process, on a Setup built first. This
check separates the two effects: it times the bench config's 1K-context decode step at each batch (default 1;
CUDA-graph replay, 20 steps, and eager) on

A. a plain Setup, before any process group exists;
B. the same Setup again after a one-rank NCCL world (and the gloo control group) is initialised;
C. a Setup built through that ParallelContext (what ``--distributed`` runs), after A/B's Setup is freed;
D. a fresh plain Setup after C's is freed (same position in the process as C, no ParallelContext).

C / D is the distributed path's own cost; C / A is what ``bench.py --distributed`` reports. Also recorded: the
host's time per tiny kernel launch before and after the NCCL init and which threads use CPU while idle.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, nccl_world_of_one, run_decode  # noqa: E402


def launch_us(n: int = 2000) -> float:
    """Host time per launch of a tiny elementwise kernel (the eager step is bound by this)."""
    x = torch.zeros(16, device="cuda")
    for _ in range(50):
        x.add_(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def steps(s: Setup, batches: list[int]) -> dict:
    rows = run_decode(s, batches, [1024], reps=20, log=lambda _: None)
    return {r["batch"]: {k: r.get(k) for k in ("step_s", "eager_step_s", "error")} for r in rows}


def busy_threads(seconds: float = 1.0) -> dict:
    """Threads of this process that used CPU time (clock ticks) while it slept for ``seconds``."""
    def cpu() -> dict:
        d = {}
        for t in os.listdir("/proc/self/task"):
            try:
                f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
                d[t] = (open(f"/proc/self/task/{t}/comm").read().strip(), int(f[11]) + int(f[12]))
            except OSError:
                pass
        return d
    a = cpu()
    time.sleep(seconds)
    b = cpu()
    return {f"{a[t][0]}:{t}": b[t][1] - a[t][1] for t in a if t in b and b[t][1] - a[t][1] > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON file written after every measurement")
    ap.add_argument("batches", type=int, nargs="*", default=[1], help="decode batches (default 1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("distributed_order_check needs a CUDA GPU")
    path, batches = args.out, args.batches
    big = max(batches)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "affinity0": len(os.sched_getaffinity(0)), "launch_us0": launch_us()}

    def save(**kw) -> None:
        out.update(kw)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(kw), flush=True)

    s = Setup(big, 1024)
    save(A_plain=steps(s, batches), threads0=len(os.listdir("/proc/self/task")))
    par = nccl_world_of_one()
    save(affinity1=len(os.sched_getaffinity(0)), threads1=len(os.listdir("/proc/self/task")), launch_us1=launch_us())
    save(B_plain_after_init=steps(s, batches))
    s.close()
    del s
    gc.collect()
    torch.cuda.empty_cache()
    s = Setup(big, 1024, par=par)
    save(C_par=steps(s, batches))
    s.close()
    del s
    gc.collect()
    torch.cuda.empty_cache()
    s = Setup(big, 1024)
    save(D_plain_new_setup=steps(s, batches), launch_us2=launch_us())
    save(busy_threads_idle_1s=busy_threads())
    save(ratios={b: {"C_over_D": out["C_par"][b]["step_s"] / out["D_plain_new_setup"][b]["step_s"],
                     "C_over_A": out["C_par"][b]["step_s"] / out["A_plain"][b]["step_s"]}
                 for b in batches if all(out[k][b].get("step_s") for k in ("A_plain", "C_par", "D_plain_new_setup"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
