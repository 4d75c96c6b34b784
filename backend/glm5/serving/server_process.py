"""Run tritonserver (and its HTTP front) for ``glm5 serve``, tests and scripts.

``TritonServerProcess`` prepares the backend directory and the runtime model repository, starts
tritonserver with locked-down defaults, starts the size-capping HTTP front
(:mod:`glm5.serving.http_front`) on the public HTTP port, waits until every model is ready and
stops everything (server, stubs, front) on exit. The defaults are the safe ones:

* every endpoint on 127.0.0.1 unless an address is given; metrics on 127.0.0.1 even then unless
  ``metrics_host`` says otherwise;
* model control off (``none``): ``models=`` serves a subset by copying only those models into
  the runtime repository, never by turning on explicit model control;
* the administrative APIs (:data:`glm5.serving.access.RESTRICTED_APIS`) behind an admin key, on
  HTTP and gRPC;
* tritonserver's own HTTP port on 127.0.0.1 at a private port, reachable from outside only
  through the front, which refuses bodies over ``max_http_body_bytes`` (2.51 crashes on some).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from glm5.serving.access import RESTRICTED_APIS, AdminKey, resolve_admin_key, restricted_api_args
from glm5.serving.http_front import DEFAULT_MAX_BODY_BYTES
from glm5.serving.installation import (PYTHON_PATH_ENV, LauncherError, _link, assemble_backend_dir,
                                       default_model_repository, locate_tritonserver, python_path_entries,
                                       system_python_for_stub)
from glm5.serving.repository import RepositoryError, prepare_model_repository, repository_models
from glm5.serving.server_diagnosis import model_load_line, stalled_load_report

logger = logging.getLogger(__name__)

MODEL_CONTROL_MODES = ("none", "explicit")
#: Lines of the engine's start log that ``glm5 serve`` repeats once the server is ready.
ENGINE_SUMMARY_PATTERNS = (re.compile(r"backends on .*"), re.compile(r"hybrid cache: .*"))
#: Model-load lines of tritonserver's output kept for the not-ready report.
LOAD_LINES_KEPT = 40
#: How many times a server whose model load stalls (never ready, never exits) is started; default 1. Each
#: start waits up to ``ready_timeout_s``, so a start can take that many times the timeout in all.
START_ATTEMPTS_ENV = "GLM5_SERVER_START_ATTEMPTS"


class LoadStalledError(LauncherError):
    """tritonserver ran until the readiness timeout without becoming ready or exiting."""


def start_attempts_from_env() -> int:
    raw = os.environ.get(START_ATTEMPTS_ENV, "").strip()
    try:
        attempts = int(raw) if raw else 1
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise LauncherError(f"{START_ATTEMPTS_ENV}={raw!r}: give a whole number of attempts, 1 or more (or leave "
                            "it unset for 1)")
    return attempts


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URL we built)
            return 200 <= r.status < 300
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _OutputPump:
    """Copy a child's output line by line to a sink, remembering the engine's summary lines and the
    last model-load lines (for the report on a server that never becomes ready).

    tritonserver's output (and its stubs', which share its stderr) goes through a pipe so that
    ``glm5 serve`` can report what the engine chose at start; the pump must always run, or the
    server would block on a full pipe.
    """

    def __init__(self, stream: IO[bytes], sink: IO[bytes], lock: threading.Lock, name: str) -> None:
        self.summary: list[str] = []
        self.load_lines: collections.deque[str] = collections.deque(maxlen=LOAD_LINES_KEPT)
        self._stream, self._sink, self._lock = stream, sink, lock
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for raw in iter(self._stream.readline, b""):
            with self._lock:
                try:
                    self._sink.write(raw)
                    self._sink.flush()
                except (ValueError, OSError):
                    pass            # sink closed during shutdown: keep draining the pipe
            line = raw.decode("utf-8", errors="replace")
            load = model_load_line(line)
            if load is not None:
                self.load_lines.append(load)
            for pat in ENGINE_SUMMARY_PATTERNS:
                m = pat.search(line)
                if m:
                    self.summary.append(m.group(0).strip())

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


def _stdout_bytes() -> IO[bytes]:
    """This process's stdout as a byte stream (``sys.stdout`` may be a text-only stand-in under tests)."""
    buf = getattr(sys.stdout, "buffer", None)
    if buf is not None:
        return buf
    return os.fdopen(os.dup(sys.__stdout__.fileno()), "wb")


def _stop_group(proc: subprocess.Popen, timeout_s: float, what: str) -> int | None:
    """SIGTERM ``proc``'s process group, SIGKILL after ``timeout_s``; then make sure none of it is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs; killing it", what, timeout_s)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    # Stubs live in the server's process group; make sure none outlives it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


@dataclass
class TritonServerProcess:
    """Run tritonserver on chosen (or free) ports; a context manager that always stops it.

    >>> with TritonServerProcess(model_dir=ckpt) as srv:   # doctest: +SKIP
    ...     print(srv.grpc_url, srv.http_url, srv.admin_key.file)
    """

    model_dir: str | None = None
    model_repository: Path | None = None
    host: str = "127.0.0.1"                  # HTTP and gRPC unless http_host / grpc_host say otherwise
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    http_host: str | None = None
    grpc_host: str | None = None
    metrics_host: str = "127.0.0.1"          # not --host: metrics stay on loopback unless asked for
    engine_overrides: dict[str, str] = field(default_factory=dict)
    media_caps: str | None = None            # JSON of MediaCaps fields, for glm5 and preprocess alike
    models: tuple[str, ...] | None = None    # serve only these (copied into the runtime repository)
    work_dir: Path | None = None
    triton: str = "auto"
    ready_timeout_s: float = 300.0
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_file: Path | None = None             # None: the server's output goes to this process's stdout
    prepare_repository: bool = True
    admin_key: AdminKey | None = None        # None: $GLM5_ADMIN_KEY or a random key in work_dir/admin_key
    restricted_apis: tuple[str, ...] = RESTRICTED_APIS
    model_control: str = "none"
    http_front: bool = True
    max_http_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    triton_http_port: int | None = None      # tritonserver's own (loopback) HTTP port behind the front
    # A load that stalls (the server neither ready nor exiting by ready_timeout_s) is reported, stopped and
    # started again up to this many times in all; exits and failed loads are never retried.
    start_attempts: int = field(default_factory=start_attempts_from_env)

    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    front_proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    _pumps: list[_OutputPump] = field(default_factory=list, init=False, repr=False)
    _sink: IO[bytes] | None = field(default=None, init=False, repr=False)
    _sink_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    # --- endpoints ---
    @property
    def http_url(self) -> str:
        """What clients use for HTTP: the front when there is one."""
        return f"{self.http_host or self.host}:{self.http_port}"

    @property
    def triton_http_url(self) -> str:
        """tritonserver's own HTTP endpoint (behind the front: loopback, private port)."""
        return f"127.0.0.1:{self.triton_http_port}" if self.http_front else self.http_url

    @property
    def grpc_url(self) -> str:
        return f"{self.grpc_host or self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics_host}:{self.metrics_port}/metrics"

    @property
    def engine_summary(self) -> list[str]:
        """The engine's start log lines about its kernel backends and cache (once it has started)."""
        return [line for p in self._pumps for line in p.summary]

    def _check_settings(self) -> None:
        if self.model_control not in MODEL_CONTROL_MODES:
            raise LauncherError(f"model_control={self.model_control!r}: use one of {', '.join(MODEL_CONTROL_MODES)}")
        if self.model_control == "explicit" and "model-repository" not in self.restricted_apis:
            raise LauncherError("explicit model control lets any client upload a model and run its code; keep "
                                "'model-repository' among the restricted APIs (it is by default)")

    def command(self) -> tuple[list[str], dict[str, str]]:
        """Prepare backend dir + runtime repository and return (argv, env) of the server."""
        self._check_settings()
        if self.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="glm5-serve-")
            self.work_dir = Path(self._tmp.name)
        self.work_dir = Path(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for attr, host in (("http_port", self.http_host or self.host), ("grpc_port", self.grpc_host or self.host),
                           ("metrics_port", self.metrics_host)):
            if getattr(self, attr) is None:
                setattr(self, attr, find_free_port(host))
        if self.http_front and self.triton_http_port is None:
            self.triton_http_port = find_free_port("127.0.0.1")
        if self.admin_key is None and self.restricted_apis:
            self.admin_key = resolve_admin_key(None, self.work_dir / "admin_key")
        inst = locate_tritonserver(self.triton)
        backend_dir = assemble_backend_dir(inst, self.work_dir / "backends")
        py_path = python_path_entries()
        src_repo = Path(self.model_repository) if self.model_repository else default_model_repository()
        repo = self.work_dir / "model_repository"
        try:
            if self.prepare_repository:
                prepare_model_repository(src_repo, repo, model_dir=self.model_dir, python_path=py_path,
                                         engine_overrides=self.engine_overrides, media_caps=self.media_caps,
                                         models=self.models)
            elif self.models is not None:
                # Only the chosen models, unchanged: tritonserver loads what it finds, no model control.
                prepare_model_repository(src_repo, repo, model_dir=None, python_path=py_path, models=self.models)
            else:
                repo = src_repo
        except (RepositoryError, ValueError) as exc:
            raise LauncherError(str(exc)) from exc
        http_addr, http_port = ("127.0.0.1", self.triton_http_port) if self.http_front else \
            (self.http_host or self.host, self.http_port)
        argv = [str(inst.binary), f"--model-repository={repo}", f"--backend-directory={backend_dir}",
                f"--http-address={http_addr}", f"--http-port={http_port}",
                f"--grpc-address={self.grpc_host or self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.metrics_host}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=true",
                f"--model-control-mode={self.model_control}", f"--log-verbose={self.log_verbose}"]
        if self.model_control == "explicit":
            argv += [f"--load-model={m}" for m in (self.models or ("*",))]
        if self.admin_key is not None:
            argv += restricted_api_args(self.admin_key, self.restricted_apis)
        argv += self.extra_args
        env = dict(os.environ)
        if inst.lib_dir is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [str(inst.lib_dir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
        env[PYTHON_PATH_ENV] = os.pathsep.join(py_path)
        # a tensor-parallel engine starts one worker process per extra device; inside the stub sys.executable
        # is the stub, so name the interpreter that has this project installed
        env.setdefault("GLM5_WORKER_PYTHON", sys.executable)
        env.setdefault("PYTHONIOENCODING", "utf-8")      # the stubs' log lines keep their non-ASCII characters
        # glibc malloc: two arenas instead of eight per core, and a fixed mmap threshold so that buffers of a
        # MiB and more (large prompts, media, tensors crossing the stub's shared memory) go back to the system
        # when freed instead of fragmenting the heap (the CPU soak's RSS drift: +24 % with glibc's defaults)
        env.setdefault("MALLOC_ARENA_MAX", "2")
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        if inst.source == "nvidia-pytriton":
            system_python = system_python_for_stub()
            if system_python is None:
                logger.warning("no system python%d.%d found for the stub's embedded interpreter; its "
                               "stdlib is then taken from the first python3 on PATH",
                               sys.version_info.major, sys.version_info.minor)
            else:
                bin_dir = self.work_dir / "bin"
                bin_dir.mkdir(exist_ok=True)
                for name in ("python3", system_python.name):
                    _link(system_python, bin_dir / name)
                env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
            env.pop("PYTHONHOME", None)
        return argv, env

    def front_command(self) -> list[str]:
        return [sys.executable, "-m", "glm5.serving.http_front", "--host", self.http_host or self.host,
                "--port", str(self.http_port), "--upstream", f"http://127.0.0.1:{self.triton_http_port}",
                "--max-body-bytes", str(self.max_http_body_bytes)]

    def _redacted(self, argv: list[str]) -> str:
        text = " ".join(argv)
        if self.admin_key is not None:
            text = text.replace(self.admin_key.value, f"<admin key {self.admin_key.fingerprint}>")
        return text

    def _spawn(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None and self._sink is not None
        self._pumps.append(_OutputPump(proc.stdout, self._sink, self._sink_lock, name))
        return proc

    def start(self) -> "TritonServerProcess":
        argv, env = self.command()
        logger.info("starting %s", self._redacted(argv))
        self._sink = open(self.log_file, "ab") if self.log_file else _stdout_bytes()  # noqa: SIM115 (stop closes it)
        try:
            for attempt in range(1, self.start_attempts + 1):
                self.proc = self._spawn(argv, env, "tritonserver-output")
                if self.http_front:
                    self.front_proc = self._spawn(self.front_command(), dict(os.environ), "http-front-output")
                try:
                    self.wait_ready()
                    break
                except LoadStalledError as exc:
                    if attempt == self.start_attempts:
                        raise
                    logger.warning("%s\nstarting it again (attempt %d of %d)", exc, attempt + 1, self.start_attempts)
                    self._stop_processes(timeout_s=10.0)
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        if not _http_ok(f"http://{self.http_url}/v2/health/ready"):
            return False
        names = self.models or self._repository_models()
        return all(_http_ok(f"http://{self.http_url}/v2/models/{m}/ready") for m in names)

    def _repository_models(self) -> tuple[str, ...]:
        repo = self.work_dir / "model_repository" if self.work_dir else None
        if repo is None or not repo.is_dir():
            return ()
        return tuple(repository_models(repo))

    def wait_ready(self) -> None:
        """Poll ``/v2/health/ready`` and each model's ready endpoint; raise if a process dies."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            # the exit check comes after the deadline too: a server that exits (or gets ready) while the last
            # readiness probe runs is an exit (or ready), never a stall to retry
            for proc, what in ((self.proc, "tritonserver"), (self.front_proc, "the HTTP front")):
                if proc is not None and proc.poll() is not None:
                    raise LauncherError(f"{what} exited with code {proc.returncode} before the server was "
                                        f"ready{self._log_hint()}")
            if self.is_ready():
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        assert self.proc is not None
        report = stalled_load_report(self.proc.pid, [ln for p in self._pumps for ln in p.load_lines])
        raise LoadStalledError(f"tritonserver did not finish loading its models within {self.ready_timeout_s:.0f}s "
                               f"and has not exited\n{report}{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log_file and Path(self.log_file).is_file():
            tail = Path(self.log_file).read_text(errors="replace")[-4000:]
            return f"; log tail ({self.log_file}):\n{tail}"
        return " (see the server output above)"

    def exited(self) -> tuple[str, int] | None:
        """(which, return code) of a process that has exited on its own, else None."""
        for proc, what in ((self.proc, "tritonserver"), (self.front_proc, "the HTTP front")):
            if proc is not None and proc.poll() is not None:
                return what, int(proc.returncode)
        return None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the front, then tritonserver's process group (server + stubs); returns the server's code."""
        rc = self._stop_processes(timeout_s)
        if self._sink is not None and self._sink is not getattr(sys.stdout, "buffer", None):
            self._sink.close()
        self._sink = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.work_dir = None
        return rc

    def _stop_processes(self, timeout_s: float) -> int | None:
        """Stop the front and tritonserver's group, drain their output; the server's return code."""
        rc = None
        if self.front_proc is not None:
            _stop_group(self.front_proc, 10.0, "the HTTP front")
            self.front_proc = None
        if self.proc is not None:
            rc = _stop_group(self.proc, timeout_s, "tritonserver")
            self.proc = None
        for pump in self._pumps:
            pump.join()
        self._pumps = []
        return rc

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:  # noqa: S310
            return r.read().decode()

    def __enter__(self) -> "TritonServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
