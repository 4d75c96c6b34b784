"""`glm5 serve` started by a test: the endpoints line it prints once the server is ready."""

from __future__ import annotations

import json
import subprocess
import time


def read_endpoints(proc: subprocess.Popen, timeout_s: float = 240.0) -> dict:
    """The JSON endpoints line of a ``glm5 serve`` process started with ``stdout=PIPE, text=True``
    (tritonserver's own output shares stdout; the endpoints line is its one JSON line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"glm5 serve exited ({proc.poll()}) without printing its endpoints")
