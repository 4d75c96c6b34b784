"""Run kernel checks under the Triton interpreter in a fresh process (``TRITON_INTERPRET`` must be set before
triton is imported, so it cannot be turned on inside the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(body: str, timeout: int = 300) -> str:
    """Run ``body`` with ``TRITON_INTERPRET=1`` and the project's sources on the path; it must print nothing
    that ends its output but the ``ok`` appended here. Returns its stdout; fails with its output's tail."""
    code = textwrap.dedent(body) + "\nprint('ok')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "backend"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout
