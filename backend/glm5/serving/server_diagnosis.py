"""What a tritonserver that never becomes ready is doing: its processes, its models, its stubs' stacks.

A load can stall without any process exiting: tritonserver 2.51 then neither answers ready nor exits
(``--exit-on-error`` only acts on a load that fails). The launcher's readiness wait ends with a
timeout, and this module turns that timeout into something one can act on:

* :func:`group_processes` lists the server's process group from ``/proc`` (state, kernel wait
  channel): a stub in ``D`` or waiting in ``futex_wait`` looks different from one still computing;
* :func:`model_load_line` recognises tritonserver's model-lifecycle lines (which model began
  loading, which instance initialised, which finished; the launcher's output pump keeps the last
  few), so the stuck model is named;
* :func:`request_stub_stacks` sends the Python-backend stubs :data:`STACK_SIGNAL`; our models
  register it with :mod:`faulthandler` at import, so every thread's Python stack lands in the log.

Linux only (``/proc``); elsewhere the process list is empty and the rest still works.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The signal a Python-backend stub of ours answers with every thread's stack (``faulthandler.register``
#: in ``backend/model.py`` and ``preprocess/1/model.py``).
STACK_SIGNAL = signal.SIGUSR1
#: tritonserver's name for a Python-backend stub process, as ``/proc/PID/comm`` shows it (15 characters).
STUB_COMM = "triton_python_b"
_LOAD_LINE = re.compile(r"model_lifecycle\.cc.*\"(loading|successfully loaded|failed to load)"
                        r"|TRITONBACKEND_ModelInstanceInitialize|Stub process .* not healthy|Started \w+Service")


@dataclass(frozen=True)
class ProcessState:
    """One process of the server's group, as ``/proc`` shows it."""

    pid: int
    comm: str
    state: str          # R running, S sleeping, D uninterruptible, Z exited and not reaped, ...
    wchan: str          # the kernel function it sleeps in ("0" when running)
    cpu_s: float        # user + system CPU seconds so far

    def describe(self) -> str:
        return f"pid {self.pid} {self.comm} state {self.state} wchan {self.wchan or '?'} cpu {self.cpu_s:.1f}s"

    @property
    def is_stub(self) -> bool:
        return self.comm.startswith(STUB_COMM)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def group_processes(pgid: int, proc_root: Path = Path("/proc")) -> list[ProcessState]:
    """Every live (or unreaped) process whose process group is ``pgid``, by pid."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found = []
    for entry in proc_root.glob("[0-9]*"):
        stat = _read(entry / "stat")
        if not stat or ")" not in stat:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()   # fields[0] is stat(5)'s field 3, the state
        try:
            if int(fields[2]) != pgid:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / ticks
        except (IndexError, ValueError):
            continue
        found.append(ProcessState(int(entry.name), comm, fields[0], _read(entry / "wchan"), cpu))
    return sorted(found, key=lambda p: p.pid)


def model_load_line(line: str) -> str | None:
    """A model-load progress line of tritonserver's without its log prefix, or None for any other line."""
    if not _LOAD_LINE.search(line):
        return None
    return line.split("] ", 1)[-1].strip()


def request_stub_stacks(processes: list[ProcessState], wait_s: float = 0.3) -> int:
    """Ask every stub among ``processes`` for its threads' stacks (they go to the server log); how many asked.

    One stub at a time, ``wait_s`` apart, since they share the server's stderr and would interleave. A
    stub that has not imported our ``model.py`` yet has no handler, and the signal ends it: only call
    this once the server is given up on (or, in tests, on a server whose models are all loaded)."""
    asked = 0
    for p in processes:
        if p.is_stub and p.state != "Z":
            try:
                os.kill(p.pid, STACK_SIGNAL)
            except OSError as e:
                logger.debug("cannot signal stub %d: %s", p.pid, e)
                continue
            asked += 1
            time.sleep(wait_s)   # faulthandler writes from its signal handler; let it finish
    return asked


def stalled_load_report(pgid: int, load_lines: list[str]) -> str:
    """The processes of a server that is not ready, its model-load lines, and (having asked) where stubs wait."""
    processes = group_processes(pgid)
    asked = request_stub_stacks(processes)
    parts = ["processes of the server's group:"]
    parts += [f"  {p.describe()}" for p in processes] or ["  (none found: no /proc here)"]
    parts.append("model load progress (tritonserver's log):")
    parts += [f"  {ln}" for ln in load_lines] or ["  (no model-lifecycle lines yet)"]
    if asked:
        parts.append(f"asked {asked} Python-backend stub(s) for their threads' stacks "
                     f"({STACK_SIGNAL.name}): they follow in the server log")
    return "\n".join(parts)
