"""Worker processes a machine starts for its ranks of a distributed engine, and what they need from the host.

:class:`LocalWorkers` starts ``python -m glm5.engine.worker`` once per rank with torch.distributed's env://
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), one log file each, and
stops them (terminate, then kill, then reap). The driver uses it for the other ranks of its machine
(:mod:`glm5.engine.executor`), ``glm5 worker`` for the ranks of another machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class WorkerLaunchError(RuntimeError):
    """No interpreter to start worker processes with; the message says which variable to set."""


def cpu_threads(ranks_on_machine: int) -> int:
    """torch threads per rank when ``ranks_on_machine`` ranks share this machine's CPUs (``OMP_NUM_THREADS``
    wins when set)."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // ranks_on_machine)


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def worker_python() -> str:
    """The interpreter for worker processes: ``$GLM5_WORKER_PYTHON``, else this one when it is a Python (inside
    Triton's python-backend stub ``sys.executable`` is the stub, which ``glm5 serve`` covers by setting
    ``GLM5_WORKER_PYTHON``)."""
    exe = os.environ.get("GLM5_WORKER_PYTHON") or sys.executable
    if exe and "python" in Path(exe).name:
        return exe
    found = shutil.which("python3")
    if found is None:
        raise WorkerLaunchError(f"cannot find a Python for the worker processes (sys.executable={sys.executable!r}); "
                            "set GLM5_WORKER_PYTHON to the interpreter that has this project installed")
    return found


# ---------------------------------------------------------------------------------------------------------------
# worker processes started by this process
# ---------------------------------------------------------------------------------------------------------------
class LocalWorkers:
    """Worker processes for some ranks of the world, started here (``python -m glm5.engine.worker``), each with
    its own log file; used by the driver for its node's other ranks and by ``glm5 worker`` on the other nodes."""

    def __init__(self, ranks: list[int], local_ranks: list[int], world_size: int, addr: str, port: int,
                 log_dir: Path | None = None):
        self.ranks, self.local_ranks = list(ranks), list(local_ranks)
        self.world_size, self.addr, self.port = world_size, addr, port
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="glm5-workers-"))
        self.procs: dict[int, subprocess.Popen] = {}
        self._logs: dict[int, Any] = {}

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def start(self) -> "LocalWorkers":
        exe = worker_python()
        path = os.pathsep.join(p for p in sys.path if p)
        for rank, local in zip(self.ranks, self.local_ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local),
                       GLM5_LOCAL_WORLD_SIZE=str(len(self.ranks) + (1 if 0 not in self.local_ranks else 0)),
                       MASTER_ADDR=self.addr, MASTER_PORT=str(self.port), GLM5_PARENT_PID=str(os.getpid()),
                       PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))
            if self.addr in ("127.0.0.1", "localhost"):
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep a one-machine world on the loopback
            log = open(self.log_path(rank), "ab")
            self._logs[rank] = log
            self.procs[rank] = subprocess.Popen([exe, "-m", "glm5.engine.worker"], env=env, stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            logger.info("started worker rank %d (pid %d, log %s)", rank, self.procs[rank].pid, self.log_path(rank))
        return self

    def dead(self) -> tuple[int, int, int] | None:
        """``(rank, pid, exit code)`` of the first worker that has exited, if any."""
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return rank, p.pid, code
        return None

    def log_tail(self, rank: int, lines: int = 25) -> str:
        try:
            text = self.log_path(rank).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def stop(self, timeout: float = 10.0) -> None:
        """Ask politely (SIGTERM), then kill what is left; reap everything."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs.values():
            log.close()
