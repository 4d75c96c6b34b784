"""``glm5 serve``: start ``tritonserver`` with the glm5 model repository.

Two server installations are supported:

* a ``tritonserver`` binary on ``PATH`` (the NGC ``tritonserver`` container, where the Dockerfile
  puts our backend under ``/opt/tritonserver/backends/glm5``);
* the 2.51 binary bundled in the ``nvidia-pytriton`` wheel. That wheel ships the Python backend
  (``libtriton_python.so`` + ``triton_python_backend_utils.py``) and one stub per Python version
  but no backend directory in the layout tritonserver expects, so we assemble one in a cache
  directory: ``python/`` (library, utils, the stub for *this* interpreter's version) and
  ``glm5/model.py`` (our python-based backend). The wheel's shared libraries live in
  ``nvidia_pytriton.libs`` and are found through ``LD_LIBRARY_PATH``; the stub's own RPATH is
  relative to its wheel location and breaks once the stub is linked elsewhere.

The stub embeds the *system* libpython and ignores ``PYTHONPATH`` (see
``docs/serving.md``, engine settings), so the launcher writes a runtime copy of the model repository
whose ``config.pbtxt`` files carry a ``python_path`` parameter (this interpreter's site-packages and
the project's source folders) and also exports ``GLM5_PYTHON_PATH``; ``backend/model.py`` and
the preprocess model put those entries on ``sys.path`` before importing anything else.

``TritonServerProcess`` is the same machinery as a context manager (free ports, readiness wait,
clean stop) for tests and scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import site
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

logger = logging.getLogger(__name__)

#: Environment variable through which the launcher hands ``sys.path`` entries to the stub.
PYTHON_PATH_ENV = "GLM5_PYTHON_PATH"
#: Models of the shipped repository, in load order.
DEFAULT_MODELS = ("glm5", "preprocess", "glm5_multimodal")
#: Where the NGC image (and our Dockerfile) keep backends.
NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")


class LauncherError(RuntimeError):
    """The server could not be prepared or did not become ready; the message says why."""


# ---------------------------------------------------------------------------------------------
# Locating files
# ---------------------------------------------------------------------------------------------

def project_root() -> Path | None:
    """The source checkout holding ``backend/glm5`` (editable installs), or None for a wheel."""
    import glm5

    root = Path(glm5.__file__).resolve().parents[2]
    return root if (root / "backend" / "model.py").is_file() else None


def default_model_repository() -> Path:
    """The shipped ``model_repository/`` (source checkout, or ``/opt/glm5/model_repository``)."""
    candidates = []
    root = project_root()
    if root is not None:
        candidates.append(root / "model_repository")
    candidates.append(Path("/opt/glm5/model_repository"))
    for c in candidates:
        if (c / "glm5" / "config.pbtxt").is_file():
            return c
    raise LauncherError(
        f"no model repository found (looked in {', '.join(map(str, candidates))}); "
        "pass --model-repository DIR")


def backend_model_py() -> Path:
    """The python-based backend ``model.py`` (``backend/model.py`` of the checkout or the NGC copy)."""
    candidates = []
    root = project_root()
    if root is not None:
        candidates.append(root / "backend" / "model.py")
    candidates.append(NGC_BACKEND_DIR / "glm5" / "model.py")
    for c in candidates:
        if c.is_file():
            return c
    raise LauncherError(
        f"backend model.py not found (looked in {', '.join(map(str, candidates))}); run from a source "
        "checkout of glm5-triton or in the project's Docker image")


def python_path_entries() -> list[str]:
    """``sys.path`` entries the stub needs: this interpreter's site-packages + project sources.

    Site-packages come first so that numpy<2 from the venv shadows anything else the stub's
    system interpreter might find (numpy 2 crashes the 2.51 stub on BYTES tensors).
    """
    entries: list[str] = []
    for p in list(site.getsitepackages()) + [site.getusersitepackages()]:
        if p and os.path.isdir(p) and p not in entries:
            entries.append(p)
    root = project_root()
    if root is not None:
        for sub in ("backend", "kernels", "client"):
            p = str(root / sub)
            if os.path.isdir(p) and p not in entries:
                entries.append(p)
    return entries


@dataclass
class TritonInstallation:
    """A runnable tritonserver: binary, extra library dir, and the Python backend's files."""

    binary: Path
    lib_dir: Path | None            # nvidia_pytriton.libs for the wheel build; None for NGC
    python_backend_dir: Path        # holds libtriton_python.so + triton_python_backend_utils.py
    stub: Path | None               # stub for this Python version (wheel build); NGC ships its own
    source: str                     # "path" or "nvidia-pytriton"


def locate_tritonserver(prefer: str = "auto") -> TritonInstallation:
    """Find tritonserver: ``PATH`` first (NGC container), else the nvidia-pytriton wheel's binary.

    ``prefer`` is ``auto``, ``path`` or ``pytriton``; an explicit choice that is unavailable raises
    (no silent fallback).
    """
    if prefer not in ("auto", "path", "pytriton"):
        raise LauncherError(f"unknown tritonserver source {prefer!r}; use auto, path or pytriton")
    if prefer in ("auto", "path"):
        found = shutil.which("tritonserver")
        if found:
            binary = Path(found).resolve()
            backend_dir = binary.parent.parent / "backends" / "python"
            if not backend_dir.is_dir():
                backend_dir = NGC_BACKEND_DIR / "python"
            if (backend_dir / "libtriton_python.so").is_file():
                return TritonInstallation(binary, None, backend_dir, None, "path")
            if prefer == "path":
                raise LauncherError(f"tritonserver at {binary} has no python backend at {backend_dir}")
        elif prefer == "path":
            raise LauncherError("no tritonserver on PATH; install it or use --triton pytriton")
    try:
        import pytriton  # noqa: F401  (only to find the wheel)
    except ImportError as exc:
        raise LauncherError(
            "no tritonserver on PATH and nvidia-pytriton is not installed; "
            "pip install 'glm5-triton[serve]' or run in the NGC tritonserver container") from exc
    pkg = Path(pytriton.__file__).resolve().parent
    triton_dir = pkg / "tritonserver"
    binary = triton_dir / "bin" / "tritonserver"
    lib_dir = pkg.parent / "nvidia_pytriton.libs"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton_dir / "python_backend_stubs" / ver / "triton_python_backend_stub"
    py_backend = triton_dir / "backends" / "python"
    for p in (binary, lib_dir, py_backend / "libtriton_python.so", stub):
        if not p.exists():
            raise LauncherError(f"nvidia-pytriton install is incomplete: {p} is missing "
                                f"(Python {ver} stub needed; reinstall nvidia-pytriton==0.7.0)")
    return TritonInstallation(binary, lib_dir, py_backend, stub, "nvidia-pytriton")


def system_python_for_stub() -> Path | None:
    """The interpreter whose prefix matches the system libpython the wheel's stub embeds.

    The embedded interpreter derives ``sys.prefix`` (and so its stdlib) from the first ``python3``
    on ``PATH``. Inside a venv built on another CPython (pyenv, conda) that stdlib does not match
    the system libpython: its C modules fail with undefined symbols (seen: ``_ssl`` needing
    ``_PyModule_Add``). Pointing ``PATH`` at the system interpreter of the same minor version
    keeps stdlib and libpython consistent; site-packages still come from ``python_path``.
    """
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (Path(f"/usr/bin/python{ver}"), Path(f"/usr/local/bin/python{ver}")):
        if cand.is_file():
            return cand
    return None


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    dst.symlink_to(src)


def _copy(src: Path, dst: Path) -> None:
    """Copy (not link): tritonserver resolves symlinks and rejects a backend library that
    "escapes" the backend directory."""
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    shutil.copy2(src, dst)


def assemble_backend_dir(inst: TritonInstallation, dest: Path, model_py: Path | None = None) -> Path:
    """Build ``dest`` as a ``--backend-directory``: ``python/`` and ``glm5/model.py``.

    The Python backend files and ``model.py`` are copied (about 3 MB; tritonserver refuses a
    library whose real path is outside the backend directory). For a PATH install every other
    backend of the installation is symlinked as a whole folder, so nothing is lost.
    """
    dest.mkdir(parents=True, exist_ok=True)
    py = dest / "python"
    py.mkdir(exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy(inst.python_backend_dir / name, py / name)
    stub = inst.stub or inst.python_backend_dir / "triton_python_backend_stub"
    if not stub.is_file():
        raise LauncherError(f"python backend stub not found at {stub}")
    _copy(stub, py / "triton_python_backend_stub")
    if inst.source == "path":
        for other in inst.python_backend_dir.parent.iterdir():
            if other.name not in ("python", "glm5") and not (dest / other.name).exists():
                _link(other, dest / other.name)
    g = dest / "glm5"
    g.mkdir(exist_ok=True)
    _copy((model_py or backend_model_py()).resolve(), g / "model.py")
    return dest


# ---------------------------------------------------------------------------------------------
# Model repository
# ---------------------------------------------------------------------------------------------

_PARAM_RE_TMPL = r'(key:\s*"{key}"\s*\n?\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'


def set_config_parameter(pbtxt: str, key: str, value: str) -> str:
    """Set ``parameters { key: .. value: { string_value: .. } }`` in a config.pbtxt text."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    pattern = re.compile(_PARAM_RE_TMPL.format(key=re.escape(key)))
    if pattern.search(pbtxt):
        return pattern.sub(lambda m: m.group(1) + f'"{escaped}"', pbtxt, count=1)
    return pbtxt.rstrip() + (f'\nparameters {{\n  key: "{key}"\n  value: {{ string_value: "{escaped}" }}\n}}\n')


def prepare_model_repository(src: Path, dest: Path, *, model_dir: str | None,
                             python_path: list[str], engine_overrides: dict[str, str] | None = None,
                             models: tuple[str, ...] | None = None) -> Path:
    """Copy ``src`` to ``dest`` and fill in the checkpoint path, ``python_path`` and overrides.

    Every model whose config uses the ``glm5`` or ``python`` backend gets ``python_path``; models
    with a ``model`` parameter (the LLM and the preprocess model) get the checkpoint directory.
    """
    src = Path(src)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for model in sorted(p for p in src.iterdir() if (p / "config.pbtxt").is_file()):
        if models is not None and model.name not in models:
            continue
        shutil.copytree(model, dest / model.name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        cfg_path = dest / model.name / "config.pbtxt"
        text = cfg_path.read_text()
        if re.search(r'backend:\s*"(glm5|python)"', text):
            text = set_config_parameter(text, "python_path", os.pathsep.join(python_path))
            if model_dir is not None and re.search(r'key:\s*"model"', text):
                text = set_config_parameter(text, "model", str(Path(model_dir).resolve()))
            if model.name == "glm5":
                for k, v in (engine_overrides or {}).items():
                    text = set_config_parameter(text, k, str(v))
        cfg_path.write_text(text)
        # A model folder needs a version folder even when the code lives in the backend.
        (dest / model.name / "1").mkdir(exist_ok=True)
    return dest


# ---------------------------------------------------------------------------------------------
# Process management
# ---------------------------------------------------------------------------------------------

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


@dataclass
class TritonServerProcess:
    """Run tritonserver on chosen (or free) ports; a context manager that always stops it.

    >>> with TritonServerProcess(model_dir=ckpt) as srv:   # doctest: +SKIP
    ...     print(srv.grpc_url, srv.http_url)
    """

    model_dir: str | None = None
    model_repository: Path | None = None
    host: str = "127.0.0.1"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    engine_overrides: dict[str, str] = field(default_factory=dict)
    models: tuple[str, ...] | None = None
    work_dir: Path | None = None
    triton: str = "auto"
    ready_timeout_s: float = 300.0
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_file: Path | None = None
    prepare_repository: bool = True

    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    # --- endpoints ---
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """Prepare backend dir + runtime repository and return (argv, env) of the server."""
        if self.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="glm5-serve-")
            self.work_dir = Path(self._tmp.name)
        self.work_dir = Path(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for attr in ("http_port", "grpc_port", "metrics_port"):
            if getattr(self, attr) is None:
                setattr(self, attr, find_free_port(self.host))
        inst = locate_tritonserver(self.triton)
        backend_dir = assemble_backend_dir(inst, self.work_dir / "backends")
        py_path = python_path_entries()
        src_repo = Path(self.model_repository) if self.model_repository else default_model_repository()
        if self.prepare_repository:
            repo = prepare_model_repository(src_repo, self.work_dir / "model_repository",
                                            model_dir=self.model_dir, python_path=py_path,
                                            engine_overrides=self.engine_overrides, models=self.models)
        else:
            repo = src_repo
        argv = [str(inst.binary), f"--model-repository={repo}", f"--backend-directory={backend_dir}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=true",
                f"--log-verbose={self.log_verbose}",
                *self.extra_args]
        if self.models is not None:
            argv.append("--model-control-mode=explicit")
            argv += [f"--load-model={m}" for m in self.models]
        env = dict(os.environ)
        if inst.lib_dir is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [str(inst.lib_dir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
        env[PYTHON_PATH_ENV] = os.pathsep.join(py_path)
        # a tensor-parallel engine starts one worker process per extra device; inside the stub sys.executable
        # is the stub, so name the interpreter that has this project installed
        env.setdefault("GLM5_WORKER_PYTHON", sys.executable)
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

    def start(self) -> "TritonServerProcess":
        argv, env = self.command()
        logger.info("starting %s", " ".join(argv))
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (closed in stop)
        self._log_handle = out
        self.proc = subprocess.Popen(argv, env=env, stdout=out if out else None,
                                     stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)
        try:
            self.wait_ready()
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
        return tuple(sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file()))

    def wait_ready(self) -> None:
        """Poll ``/v2/health/ready`` and each model's ready endpoint; raise if the server dies."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise LauncherError(f"tritonserver exited with code {self.proc.returncode} before it was "
                                    f"ready{self._log_hint()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise LauncherError(f"tritonserver not ready after {self.ready_timeout_s:.0f}s{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log_file and Path(self.log_file).is_file():
            tail = Path(self.log_file).read_text(errors="replace")[-4000:]
            return f"; log tail ({self.log_file}):\n{tail}"
        return " (see the server output above)"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group (server + stubs), SIGKILL after ``timeout_s``."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("tritonserver did not stop in %.0fs; killing it", timeout_s)
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self.proc.wait()
            # Stubs live in the same process group; make sure none outlives the server.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            rc = self.proc.returncode
            self.proc = None
        handle = getattr(self, "_log_handle", None)
        if handle is not None:
            handle.close()
            self._log_handle = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.work_dir = None
        return rc

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:  # noqa: S310
            return r.read().decode()

    def __enter__(self) -> "TritonServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

_ENGINE_FLAGS = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "num_cache_blocks", "cache_memory_gb", "num_speculative_tokens", "seed",
                 "tensor_parallel_size", "expert_parallel_size", "num_redundant_experts")
#: on/off engine settings (vLLM's flag names): present → "true"
_ENGINE_SWITCHES = ("enable_expert_parallel", "enable_eplb")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: the tiny random checkpoint, "
                                        "created on first use)")
    parser.add_argument("--model-repository", type=Path, help="model repository to serve "
                        "(default: the shipped model_repository/)")
    parser.add_argument("--host", default="127.0.0.1", help="address for all endpoints (default 127.0.0.1)")
    parser.add_argument("--http-address", help="HTTP bind address (default: --host)")
    parser.add_argument("--grpc-address", help="gRPC bind address (default: --host)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--triton", choices=("auto", "path", "pytriton"), default="auto",
                        help="tritonserver to use: PATH, the nvidia-pytriton wheel, or auto (PATH first)")
    parser.add_argument("--work-dir", type=Path, help="where the backend dir and runtime repository go "
                        "(default: a temporary directory removed on exit)")
    parser.add_argument("--text-only", action="store_true", help="load only the glm5 model")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--log-verbose", type=int, default=0)
    for name in _ENGINE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, help=f"engine {name} (config parameter)")
    for name in _ENGINE_SWITCHES:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true",
                            help=f"engine {name}=true (config parameter)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any other glm5 config.pbtxt parameter, repeatable")


def run(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    overrides.update({k: "true" for k in _ENGINE_SWITCHES if getattr(args, k, False)})
    for kv in args.engine_arg:
        if "=" not in kv:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        overrides[k.strip()] = v
    from glm5.tiny_checkpoint import ensure_default_checkpoint

    model = args.model or str(ensure_default_checkpoint())
    extra = []
    if args.http_address:
        extra.append(f"--http-address={args.http_address}")
    if args.grpc_address:
        extra.append(f"--grpc-address={args.grpc_address}")
    srv = TritonServerProcess(model_dir=model, model_repository=args.model_repository, host=args.host,
                              http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, engine_overrides=overrides,
                              models=("glm5",) if args.text_only else None, work_dir=args.work_dir,
                              triton=args.triton, ready_timeout_s=args.ready_timeout,
                              log_verbose=args.log_verbose, extra_args=extra)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: stopping tritonserver", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        srv.start()
    except LauncherError as exc:
        print(f"glm5 serve: {exc}", file=sys.stderr)
        return 1
    http_host = args.http_address or args.host
    grpc_host = args.grpc_address or args.host
    print(json.dumps({"model": model, "grpc": f"{grpc_host}:{srv.grpc_port}",
                      "http": f"http://{http_host}:{srv.http_port}", "metrics": srv.metrics_url,
                      "pid": srv.proc.pid if srv.proc else None}), flush=True)
    print(f"glm5 serving: gRPC {grpc_host}:{srv.grpc_port}  HTTP http://{http_host}:{srv.http_port}  "
          f"metrics {srv.metrics_url}  (Ctrl-C stops)", flush=True)
    try:
        while not stop.is_set():
            if srv.proc is not None and srv.proc.poll() is not None:
                print(f"glm5 serve: tritonserver exited with code {srv.proc.returncode}", file=sys.stderr)
                return int(srv.proc.returncode or 1)
            stop.wait(0.5)
    finally:
        srv.stop()
    return 0
