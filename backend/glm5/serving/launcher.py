"""``glm5 serve``: start tritonserver with the glm5 model repository, locked down by default.

What runs (see :mod:`glm5.serving.server_process`): tritonserver with gRPC on ``--host`` (default
127.0.0.1) and its HTTP port on a private loopback port behind the size-capping HTTP front
(:mod:`glm5.serving.http_front`) on ``--host:--http-port``; metrics on 127.0.0.1 unless
``--metrics-address`` says otherwise; model control off; the administrative APIs behind an admin
key (:mod:`glm5.serving.access`). Bad settings (a missing checkpoint, malformed media caps, an
unknown engine setting) fail here in one line, before tritonserver starts.

With ``--openai-port`` it also runs the OpenAI-compatible server
(:mod:`glm5.entrypoints.openai`) as a child process talking to tritonserver over gRPC.

The pieces stay importable from here for scripts written against earlier versions
(``TritonServerProcess``, ``find_free_port``, ``locate_tritonserver``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from glm5.serving.access import (ADMIN_HEADER, ADMIN_KEY_ENV, GRPC_HEADER_PREFIX, RESTRICTED_APIS, AccessError,
                                 parse_api_list, resolve_admin_key)
from glm5.serving.http_front import DEFAULT_MAX_BODY_BYTES
from glm5.serving.installation import (DEFAULT_MODELS, NGC_BACKEND_DIR, PYTHON_PATH_ENV, LauncherError,  # noqa: F401
                                       TritonInstallation, assemble_backend_dir, backend_model_py,
                                       default_model_repository, locate_tritonserver, project_root,
                                       python_path_entries, system_python_for_stub)
from glm5.serving.repository import prepare_model_repository  # noqa: F401  (re-exported)
from glm5.serving.server_process import (MODEL_CONTROL_MODES, TritonServerProcess, find_free_port,  # noqa: F401
                                         is_loopback)

logger = logging.getLogger(__name__)

_ENGINE_FLAGS = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "num_cache_blocks", "cache_memory_gb", "num_speculative_tokens", "seed", "quantization",
                 "prefix_cache_snapshot_memory_gb", "prefix_cache_checkpoint_interval",
                 "tensor_parallel_size", "expert_parallel_size", "num_redundant_experts")
#: on/off engine settings (vLLM's flag names): present → "true"
_ENGINE_SWITCHES = ("enable_expert_parallel", "enable_eplb")


class ServeConfigError(ValueError):
    """A ``glm5 serve`` setting is unusable; reported in one line before anything starts."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: the tiny random checkpoint, "
                                        "created on first use)")
    parser.add_argument("--model-repository", type=Path, help="model repository to serve "
                        "(default: the shipped model_repository/)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address for the HTTP and gRPC endpoints (default 127.0.0.1; 0.0.0.0 = every interface)")
    parser.add_argument("--http-address", help="HTTP bind address (default: --host)")
    parser.add_argument("--grpc-address", help="gRPC bind address (default: --host)")
    parser.add_argument("--metrics-address", default="127.0.0.1",
                        help="metrics bind address (default 127.0.0.1 whatever --host is)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--triton", choices=("auto", "path", "pytriton"), default="auto",
                        help="tritonserver to use: PATH, the nvidia-pytriton wheel, or auto (PATH first)")
    parser.add_argument("--work-dir", type=Path, help="where the backend dir, runtime repository and generated "
                        "admin key go (default: a temporary directory removed on exit)")
    parser.add_argument("--text-only", action="store_true", help="serve only the glm5 model")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--log-verbose", type=int, default=0)
    sec = parser.add_argument_group("access control")
    sec.add_argument("--admin-key", help=f"key for the restricted APIs (default: ${ADMIN_KEY_ENV}, else a random "
                     "key written to --admin-key-file)")
    sec.add_argument("--admin-key-file", type=Path, help="where a generated key is written, mode 0600 "
                     "(default: WORK_DIR/admin_key)")
    sec.add_argument("--restricted-apis", default=",".join(RESTRICTED_APIS),
                     help=f"APIs that need the key (HTTP header {ADMIN_HEADER!r}, gRPC metadata "
                          f"{GRPC_HEADER_PREFIX + ADMIN_HEADER!r}); default: %(default)s; '' opens them all")
    sec.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES, default="none",
                     help="'explicit' lets key holders load/unload models through the repository API (default none)")
    sec.add_argument("--http-max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="largest HTTP request body accepted; larger ones get 413 (default %(default)s)")
    sec.add_argument("--no-http-front", action="store_true",
                     help="serve tritonserver's HTTP port directly (2.51 crashes on some ~4 MB bodies; "
                          "allowed on loopback only)")
    for name in _ENGINE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, help=f"engine {name} (config parameter)")
    for name in _ENGINE_SWITCHES:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true",
                            help=f"engine {name}=true (config parameter)")
    parser.add_argument("--media-caps", help='JSON of MediaCaps fields for every model that takes media, e.g. '
                        '\'{"max_images": 4}\'')
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="prefix caching (engine default: on)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any other glm5 config.pbtxt parameter, repeatable")
    parser.add_argument("--openai-port", type=int, help="also serve the OpenAI-compatible API (/v1) on this port, "
                        "bound to --host (docs/openai.md)")


def check_model_dir(path: str) -> Path:
    """The checkpoint directory, or ``ServeConfigError`` naming the path and what is wrong with it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ServeConfigError(f"--model {p}: no such directory")
    if not p.is_dir():
        raise ServeConfigError(f"--model {p}: is a file; give the checkpoint directory (the one holding "
                               "config.json and the *.safetensors files)")
    if not (p / "config.json").is_file():
        raise ServeConfigError(f"--model {p}: no config.json in it, so it is not a checkpoint directory "
                               f"(`glm5 check {p}` validates one)")
    return p.resolve()


def engine_overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides = {k: str(getattr(args, k)) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    overrides.update({k: "true" for k in _ENGINE_SWITCHES if getattr(args, k, False)})
    if getattr(args, "enable_prefix_caching", None) is not None:
        overrides["enable_prefix_caching"] = "true" if args.enable_prefix_caching else "false"
    for kv in args.engine_arg:
        if "=" not in kv:
            raise ServeConfigError(f"--engine-arg expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        overrides[k.strip()] = v
    return overrides


def check_engine_settings(model: Path, overrides: dict[str, str], media_caps: str | None) -> None:
    """Validate what the engine will be given now (the same parsers the engine and preprocess use)."""
    from glm5.multimodal.caps import MediaCaps

    for text in (media_caps, overrides.get("media_caps")):
        try:
            MediaCaps.from_json(text)
        except ValueError as exc:
            raise ServeConfigError(str(exc)) from None
    from glm5.engine.args import EngineArgs

    backend_only = {"python_path", "report_metrics", "metrics_interval_ms", "cancellation_check_period_ms",
                    "engine_module", "log_level"}
    settings = {k: v for k, v in overrides.items() if k not in backend_only and k != "media_caps" and v != ""}
    try:
        EngineArgs.from_dict({**settings, "model": str(model)})
    except (TypeError, ValueError) as exc:
        raise ServeConfigError(f"engine setting: {exc}") from None


def build_server(args: argparse.Namespace) -> TritonServerProcess:
    """Check every setting and build the (not yet started) server; ``ServeConfigError`` on a bad one."""
    if args.model:
        model = check_model_dir(args.model)
    else:
        from glm5.tiny_checkpoint import ensure_default_checkpoint

        model = Path(ensure_default_checkpoint())
    if args.model_repository is not None and not Path(args.model_repository).is_dir():
        raise ServeConfigError(f"--model-repository {args.model_repository}: no such directory")
    overrides = engine_overrides(args)
    check_engine_settings(model, overrides, args.media_caps)
    if args.http_max_body_bytes < 1:
        raise ServeConfigError(f"--http-max-body-bytes {args.http_max_body_bytes}: must be >= 1")
    try:
        apis = parse_api_list(args.restricted_apis)
        key = None
        if apis and (args.admin_key or os.environ.get(ADMIN_KEY_ENV)):
            key = resolve_admin_key(args.admin_key, Path(os.devnull))     # given: nothing is written
        elif apis and args.admin_key_file is not None:
            key = resolve_admin_key(None, args.admin_key_file)
        # else: TritonServerProcess generates one into WORK_DIR/admin_key
    except AccessError as exc:
        raise ServeConfigError(str(exc)) from None
    except OSError as exc:
        raise ServeConfigError(f"--admin-key-file {args.admin_key_file}: {exc.strerror}") from None
    http_host = args.http_address or args.host
    if args.no_http_front and not is_loopback(http_host):
        raise ServeConfigError(f"--no-http-front with HTTP on {http_host}: tritonserver 2.51 can be crashed by one "
                               "large HTTP request; keep the front or bind HTTP to 127.0.0.1")
    if not apis:
        logger.warning("--restricted-apis '': model repository, logging, shared memory and config APIs are open "
                       "to every client")
    srv = TritonServerProcess(
        model_dir=str(model), model_repository=args.model_repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, http_host=args.http_address,
        grpc_host=args.grpc_address, metrics_host=args.metrics_address, engine_overrides=overrides,
        media_caps=args.media_caps, models=("glm5",) if args.text_only else None, work_dir=args.work_dir,
        triton=args.triton, ready_timeout_s=args.ready_timeout, log_verbose=args.log_verbose,
        admin_key=key, restricted_apis=apis, model_control=args.model_control_mode,
        http_front=not args.no_http_front, max_http_body_bytes=args.http_max_body_bytes)
    return srv


def _log_start(srv: TritonServerProcess, overrides: dict[str, str]) -> None:
    key = srv.admin_key
    if key is not None:
        where = f"written to {key.file}" if key.file else f"from the {key.source}"
        logger.info("restricted APIs %s need header %r (gRPC metadata %r); admin key %s (fingerprint %s)",
                    ",".join(srv.restricted_apis), ADMIN_HEADER, GRPC_HEADER_PREFIX + ADMIN_HEADER, where,
                    key.fingerprint)
    if srv.http_front:
        logger.info("HTTP front on %s -> tritonserver HTTP %s; bodies over %d bytes get 413", srv.http_url,
                    srv.triton_http_url, srv.max_http_body_bytes)
    logger.info("engine settings: %s", ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "defaults")
    backend_env = {k: v for k, v in os.environ.items() if k.startswith("GLM5_") and k.endswith("_BACKEND")}
    if backend_env:
        logger.info("kernel backend overrides: %s", ", ".join(f"{k}={v}" for k, v in sorted(backend_env.items())))
    for line in srv.engine_summary:
        logger.info("engine: %s", line)
    if not srv.engine_summary:
        logger.info("engine: its start log (backends, cache size) is in the server output above")


def run(args: argparse.Namespace) -> int:
    try:
        srv = build_server(args)
        overrides = engine_overrides(args)
    except (ServeConfigError, LauncherError) as exc:
        print(f"glm5 serve: error: {exc}", file=sys.stderr)
        return 2
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
    _log_start(srv, overrides)
    key = srv.admin_key
    openai = None
    if args.openai_port is not None:
        from glm5.entrypoints.openai.process import OpenAIServerError, OpenAIServerProcess

        grpc_host = args.grpc_address or args.host
        # the OpenAI server reads the model config (a restricted API): it gets the key in its environment
        openai = OpenAIServerProcess(triton_url=f"127.0.0.1:{srv.grpc_port}" if grpc_host in ("0.0.0.0", "::")
                                     else srv.grpc_url, model_dir=srv.model_dir or "", port=args.openai_port,
                                     host=args.host, extra_env={ADMIN_KEY_ENV: key.value} if key else {})
        try:
            openai.start()
        except OpenAIServerError as exc:
            srv.stop()
            print(f"glm5 serve: {exc}", file=sys.stderr)
            return 1
    endpoints = {"model": srv.model_dir, "grpc": srv.grpc_url, "http": f"http://{srv.http_url}",
                 "metrics": srv.metrics_url, "pid": srv.proc.pid if srv.proc else None,
                 "restricted_apis": list(srv.restricted_apis),
                 "admin_key_file": str(key.file) if key and key.file else None,
                 "admin_key_fingerprint": key.fingerprint if key else None,
                 "engine": srv.engine_summary}
    if openai is not None:
        endpoints["openai"] = openai.base_url
    print(json.dumps(endpoints), flush=True)
    print(f"glm5 serving: gRPC {srv.grpc_url}  HTTP http://{srv.http_url}  metrics {srv.metrics_url}  "
          f"(Ctrl-C stops)", flush=True)
    try:
        while not stop.is_set():
            gone = srv.exited()
            if gone is None and openai is not None and openai.proc is not None and openai.proc.poll() is not None:
                gone = ("the OpenAI server", int(openai.proc.returncode))
            if gone is not None:
                what, rc = gone
                print(f"glm5 serve: {what} exited with code {rc}", file=sys.stderr)
                return rc if rc > 0 else 128 - rc if rc < 0 else 1     # a signal -N becomes 128+N, as in a shell
            stop.wait(0.5)
    finally:
        if openai is not None:
            openai.stop()
        srv.stop()
    return 0
