"""Run the OpenAI-compatible server as a child process (``glm5 serve --openai-port``, tests)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


class OpenAIServerError(RuntimeError):
    """The OpenAI server did not start; the message says why (with its log tail when there is one)."""


@dataclass
class OpenAIServerProcess:
    """``python -m glm5.entrypoints.openai`` on ``host:port``, in front of Triton's gRPC ``triton_url``."""

    triton_url: str
    model_dir: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "glm5"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)   # e.g. the admin key (kept out of the command line)
    log_file: Path | None = None
    ready_timeout_s: float = 120.0
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "glm5.entrypoints.openai", "--triton-url", self.triton_url, "--model",
                str(self.model_dir), "--host", self.host, "--port", str(self.port), "--served-model-name",
                self.served_model_name, *self.extra_args]

    def start(self) -> "OpenAIServerProcess":
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (closed in stop)
        self._log = out
        # without a log file the server logs to our stderr: uvicorn's access log would otherwise land
        # on stdout, where `glm5 serve` prints its endpoints as one JSON line
        self.proc = subprocess.Popen(self.command(), stdout=out if out else sys.stderr,
                                     stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                     env={**os.environ, **self.extra_env})
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise OpenAIServerError(f"the OpenAI server exited with code {self.proc.returncode if self.proc else '?'}"
                                        f"{self._tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=2) as r:  # noqa: S310
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        tail = self._tail()
        self.stop()
        raise OpenAIServerError(f"the OpenAI server was not ready after {self.ready_timeout_s:.0f}s{tail}")

    def _tail(self) -> str:
        if self.log_file and Path(self.log_file).is_file():
            return "; log tail:\n" + Path(self.log_file).read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc = None
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None

    def __enter__(self) -> "OpenAIServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
