"""``glm5 worker``: this machine's ranks of a distributed engine whose driver runs on another machine.

The driver (``glm5 generate`` / ``glm5 serve`` / the Triton model with ``nnodes > 1``) is rank 0 and starts the
workers of its own machine; every other machine runs::

    glm5 worker --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr <driver host> --master-port 29500

which starts ``--nproc-per-node`` worker processes (ranks ``node_rank * nproc_per_node + i``, local rank ``i``)
with torch.distributed's env:// variables, then waits. The machine's process tree ends with the engine: when one
worker fails, the others are stopped and the command exits with its code; SIGTERM / Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, required=True, help="machines in the world (the driver's included)")
    p.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1 .. nnodes-1 (0 = driver)")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks (devices) per machine")
    p.add_argument("--master-addr", required=True, help="the driver machine's address")
    p.add_argument("--master-port", type=int, required=True, help="the driver's rendezvous port (its --master-port)")
    p.add_argument("--log-dir", default=None, help="worker logs (default: a temporary directory)")


def run(args: argparse.Namespace) -> int:
    from glm5.engine.worker_processes import LocalWorkers

    if not 1 <= args.node_rank < args.nnodes:
        raise SystemExit(f"glm5 worker: --node-rank {args.node_rank} must be in 1..{args.nnodes - 1} (node 0 is the "
                         "driver, which starts its own workers)")
    n = args.nproc_per_node
    first = args.node_rank * n
    workers = LocalWorkers(list(range(first, first + n)), list(range(n)), args.nnodes * n, args.master_addr,
                           args.master_port, log_dir=args.log_dir).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"glm5 worker: ranks {first}..{first + n - 1} of {args.nnodes * n}, logs in {workers.log_dir}", flush=True)
    code = 0
    try:
        while not stop.wait(0.2):
            codes = [p.poll() for p in workers.procs.values()]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                rank = next(r for r, p in workers.procs.items() if p.poll() not in (None, 0))
                logger.error("worker rank %d exited with code %d:\n%s", rank, failed[0], workers.log_tail(rank))
                code = failed[0] if failed[0] > 0 else 1
                break
            if all(c == 0 for c in codes):
                break
    finally:
        workers.stop()
    return code
