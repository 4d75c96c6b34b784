"""Triton python-based backend ``glm5``: the GLM-5.3-Flash engine behind a decoupled model.

Installed as ``<backend-directory>/glm5/model.py``; a model whose ``config.pbtxt`` says
``backend: "glm5"`` runs this file in a Python-backend stub process.

Threads inside the stub (one model instance serves every request; ``execute`` never blocks):

* the engine's own loop thread (``AsyncLLMEngine``) schedules and runs the model;
* an asyncio loop thread runs one coroutine per request: parse tensors, ``add_request``, iterate
  the request's output stream and queue responses;
* a response thread drains that queue and calls ``response_sender.send`` (IPC to the server), so
  neither the engine nor the asyncio loop ever waits on the server; after each sent delta it
  checks ``is_cancelled()``, i.e. cancellation is seen every engine step;
* a cancellation thread polls ``is_cancelled()`` for requests that produce no output yet
  (queued, long prefill) every ``cancellation_check_period_ms``;
* a metrics thread copies engine statistics into Triton custom metrics every
  ``metrics_interval_ms`` and records per-request latency histograms.

A request is cancelled → ``engine.abort(id)`` → the stream ends with ``finish_reason="abort"`` →
a final ``CANCELLED`` error response. A ``stop=true`` request aborts a running request when it names
the same request id *and* presents the ``stop_key`` that request was sent with (ownership: Triton
2.51 gives a model no client identity, so the key is the proof); that is the only way to stop a
request that came through the ``glm5_multimodal`` ensemble, because Triton 2.51 does not pass client
cancellation on to an ensemble step that is already running. A request id is live from admission
until its final response: a second request with a live id gets ``ALREADY_EXISTS``.

Parsing, tokenization and media decoding never run on the asyncio loop or the engine loop (an
executor thread parses; the engine's bounded worker pool prepares the prompt). A request that fails
inside an engine step gets ``INTERNAL`` and the others go on. When the engine dies of an
unrecoverable (device) error the model answers ``UNAVAILABLE`` and takes the server down: Triton
2.51 has no way for a Python model to report "not ready" (the stub may even die while
``/v2/health/ready`` says 200), so the backend sends SIGTERM to its tritonserver parent and does not
finish ``finalize`` while the dead engine cannot be released; tritonserver then exits with code 1
("Exit timeout expired") after ``--exit-timeout-secs``, which tells a supervisor to restart it.
(``on_engine_failure: "unload"`` instead unloads just this model, for explicit model control.)

The stub embeds the system libpython and ignores ``PYTHONPATH``: ``sys.path`` is extended from
``$GLM5_PYTHON_PATH`` (set by ``glm5 serve``) at import time and from the ``python_path`` config
parameter in ``initialize`` before anything from the project (or numpy) is imported.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

# A launcher that gives up on a stalled load sends SIGUSR1 for every thread's stack
# (glm5.serving.server_diagnosis); registered before the imports below so a stall inside them shows too.
try:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
except (AttributeError, ValueError, OSError, RuntimeError):  # no usable stderr: no stacks, still load
    pass


def _extend_sys_path(value: str | None) -> None:
    """Prepend ``os.pathsep``-separated entries to ``sys.path`` (first entry wins)."""
    for entry in reversed([p for p in (value or "").split(os.pathsep) if p]):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)


_extend_sys_path(os.environ.get("GLM5_PYTHON_PATH"))

import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

logger = logging.getLogger("glm5.backend")

# Config parameters consumed by this backend; every other non-empty parameter goes to EngineArgs.
BACKEND_PARAMETERS = frozenset({"python_path", "report_metrics", "metrics_interval_ms",
                                "cancellation_check_period_ms", "engine_module", "EXECUTION_ENV_PATH",
                                "log_level", "on_engine_failure"})

_OPT = {"optional": True}
INPUTS: list[dict[str, Any]] = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], **_OPT},
    {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], **_OPT},
    {"name": "video", "data_type": "TYPE_STRING", "dims": [-1], **_OPT},
    {"name": "messages", "data_type": "TYPE_STRING", "dims": [1], **_OPT},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], **_OPT},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_cumulative_logprob", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "return_num_cached_tokens", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    {"name": "stop", "data_type": "TYPE_BOOL", "dims": [1], **_OPT},
    # vllm_backend reserves it for the OpenAI frontend's embedding requests; answered with a clear error
    {"name": "embedding_request", "data_type": "TYPE_STRING", "dims": [1], **_OPT},
    {"name": "stop_key", "data_type": "TYPE_STRING", "dims": [1], **_OPT},
    # Preprocessed tensors from the `preprocess` model (ensemble path); empty = absent.
    {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], **_OPT},
    {"name": "pixel_values", "data_type": "TYPE_FP32", "dims": [-1, -1], **_OPT},
    {"name": "image_grid_thw", "data_type": "TYPE_INT64", "dims": [-1, 3], **_OPT},
    {"name": "pixel_values_videos", "data_type": "TYPE_FP32", "dims": [-1, -1], **_OPT},
    {"name": "video_grid_thw", "data_type": "TYPE_INT64", "dims": [-1, 3], **_OPT},
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    # prompt tokens reused from the prefix cache (vLLM's num_cached_tokens; OpenAI usage.cached_tokens)
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_cached_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
]
MM_TENSORS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class _RequestState:
    """Book-keeping for one in-flight request."""

    request: Any
    sender: Any
    client_id: str
    engine_id: str = ""            # the request's id in the engine; sequence i of n runs as f"{engine_id}.{i}"
    engine_ids: list[str] = field(default_factory=list)
    cancelled: bool = False        # the client cancelled (gRPC stop_stream / disconnect)
    done: bool = False             # final response queued
    closed: bool = False           # final response sent: the sender's response factory is released; under
                                   # _send_lock, nothing may call sender.is_cancelled() after this (2.51
                                   # dereferences the freed factory: SIGSEGV in ResponseFactoryIsCancelled)
    arrival: float = field(default_factory=time.monotonic)


class _Metrics:
    """Triton custom metrics fed from a background thread (never from the engine or send path)."""

    TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0]
    ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                   0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
    E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0]

    def __init__(self, labels: dict[str, str], engine: Any, interval_s: float, max_model_len: int = 4096) -> None:
        MF = pb_utils.MetricFamily
        self._engine = engine
        self._interval = interval_s
        self._events: "queue.Queue[Any]" = queue.Queue()
        self._stop = threading.Event()

        # The families must outlive their metrics (the stub rejects updates otherwise): keep them.
        self._families: list[Any] = []

        def fam(name: str, desc: str, kind: Any) -> Any:
            family = MF(name=name, description=desc, kind=kind)
            self._families.append(family)
            return family

        self.prompt_tokens = fam("glm5:prompt_tokens_total", "Prompt tokens processed", MF.COUNTER).Metric(labels)
        self.gen_tokens = fam("glm5:generation_tokens_total", "Tokens generated", MF.COUNTER).Metric(labels)
        self.aborted = fam("glm5:request_aborted_total", "Requests aborted (cancel/stop/shutdown)",
                           MF.COUNTER).Metric(labels)
        self.finished = fam("glm5:request_finished_total", "Requests finished by the engine",
                            MF.COUNTER).Metric(labels)
        self.preempted = fam("glm5:request_preempted_total", "Preemptions", MF.COUNTER).Metric(labels)
        self.prefix_queries = fam("glm5:prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache (vLLM prefix_cache_queries)",
                                  MF.COUNTER).Metric(labels)
        self.prefix_hits = fam("glm5:prefix_cache_hits_total",
                               "Prompt tokens found in the prefix cache (vLLM prefix_cache_hits)",
                               MF.COUNTER).Metric(labels)
        self.errors = fam("glm5:request_error_total", "Requests answered with an error", MF.COUNTER).Metric(labels)
        self.running = fam("glm5:num_requests_running", "Requests in the running batch", MF.GAUGE).Metric(labels)
        self.waiting = fam("glm5:num_requests_waiting", "Requests waiting to be scheduled", MF.GAUGE).Metric(labels)
        self.cache_usage = fam("glm5:kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)",
                               MF.GAUGE).Metric(labels)
        self.ttft = fam("glm5:time_to_first_token_seconds", "Time to first token", MF.HISTOGRAM).Metric(
            labels, buckets=self.TTFT_BUCKETS)
        self.itl = fam("glm5:inter_token_latency_seconds", "Time between output tokens",
                       MF.HISTOGRAM).Metric(labels, buckets=self.ITL_BUCKETS)
        self.e2e = fam("glm5:e2e_request_latency_seconds", "Request latency (arrival to finish)",
                       MF.HISTOGRAM).Metric(labels, buckets=self.E2E_BUCKETS)
        self.spec_drafts = fam("glm5:spec_decode_num_draft_tokens_total", "MTP draft tokens proposed",
                               MF.COUNTER).Metric(labels)
        self.spec_accepted = fam("glm5:spec_decode_num_accepted_tokens_total", "MTP draft tokens accepted",
                                 MF.COUNTER).Metric(labels)
        self.spec_mean_len = fam("glm5:spec_decode_mean_accepted_length",
                                 "Tokens emitted per verification step (1 = no draft accepted)", MF.GAUGE).Metric(labels)
        self._spec_rate_family = fam("glm5:spec_decode_acceptance_rate",
                                     "Acceptance rate per draft position", MF.GAUGE)
        self._spec_rate: dict[int, Any] = {}
        # vLLM's names beside the glm5: families (docs/serving.md, "Metrics")
        from glm5.serving.vllm_metrics import FinishedRequest, VllmMetrics

        self._finished_type = FinishedRequest
        self.vllm = VllmMetrics(fam, MF, labels, max_model_len)
        self._labels = labels
        self._last: dict[str, float] = {}
        self._thread = threading.Thread(target=self._loop, name="glm5-metrics", daemon=True)
        self._thread.start()

    def record_request(self, metrics: Any, num_prompt_tokens: int = 0, num_generation_tokens: int = 0,
                       finish_reason: str | None = None) -> None:
        """Queue a finished engine request's ``RequestMetrics`` and counts (non-blocking)."""
        if metrics is not None:
            self._events.put(self._finished_type(metrics, num_prompt_tokens, num_generation_tokens, finish_reason))

    def record_params(self, n: int, best_of: int) -> None:
        self._events.put(("params", n, best_of))

    def record_error(self) -> None:
        self._events.put("error")

    def _counter_from_total(self, metric: Any, key: str, total: float) -> None:
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            metric.increment(delta)
        self._last[key] = total

    def _update_from_stats(self) -> None:
        st = self._engine.stats()
        self.running.set(float(st.running))
        self.waiting.set(float(st.waiting))
        self.cache_usage.set(float(st.cache_usage))
        self._counter_from_total(self.prompt_tokens, "prompt", float(st.prompt_tokens_total))
        self._counter_from_total(self.gen_tokens, "gen", float(st.generation_tokens_total))
        self._counter_from_total(self.aborted, "aborted", float(st.aborted_total))
        self._counter_from_total(self.finished, "finished", float(st.finished_total))
        self._counter_from_total(self.preempted, "preempted", float(st.preempted_total))
        self.vllm.update_stats(st)
        self._counter_from_total(self.prefix_queries, "prefix_queries", float(getattr(st, "prefix_cache_queries", 0)))
        self._counter_from_total(self.prefix_hits, "prefix_hits", float(getattr(st, "prefix_cache_hits", 0)))
        spec = getattr(st, "speculative", None)
        if spec:
            self._counter_from_total(self.spec_drafts, "spec_drafts", float(sum(spec["proposed"])))
            self._counter_from_total(self.spec_accepted, "spec_accepted", float(sum(spec["accepted"])))
            self.spec_mean_len.set(float(spec["mean_accepted_length"]))
            for pos, rate in enumerate(spec["acceptance_rate_per_position"]):
                if pos not in self._spec_rate:
                    self._spec_rate[pos] = self._spec_rate_family.Metric({**self._labels, "position": str(pos)})
                self._spec_rate[pos].set(float(rate))

    def _drain_events(self) -> None:
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                return
            if ev == "error":
                self.errors.increment(1)
                continue
            if isinstance(ev, tuple):
                self.vllm.observe_params(ev[1], ev[2])
                continue
            self.vllm.observe_finished(ev)
            ev = ev.metrics
            arrival = getattr(ev, "arrival_time", None)
            first = getattr(ev, "first_token_time", None)
            fin = getattr(ev, "finished_time", None)
            if arrival is not None and first is not None:
                self.ttft.observe(max(0.0, first - arrival))
            if arrival is not None and fin is not None:
                self.e2e.observe(max(0.0, fin - arrival))
            for gap in getattr(ev, "inter_token_latencies", None) or ():
                self.itl.observe(max(0.0, float(gap)))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._update_from_stats()
                self._drain_events()
            except Exception:  # noqa: BLE001 (metrics must never take the model down)
                logger.exception("metrics update failed")
            self._stop.wait(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._update_from_stats()
            self._drain_events()
        except Exception:  # noqa: BLE001
            pass


def _scalar(request: Any, name: str) -> Any:
    """First element of an optional input, or None when absent."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy()
    return arr.reshape(-1)[0] if arr.size else None


def _bool(request: Any, name: str) -> bool | None:
    v = _scalar(request, name)
    return None if v is None else bool(v)


def _str(request: Any, name: str) -> str | None:
    v = _scalar(request, name)
    if v is None:
        return None
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def _array(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    """The glm5 decoupled model (see the module docstring for the threading model)."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """Make a bare ``backend: "glm5"`` config complete: decoupled, no batch dim, all tensors."""
        cfg = auto_complete_model_config
        have_in = {i["name"] for i in cfg.as_dict().get("input", [])}
        have_out = {o["name"] for o in cfg.as_dict().get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                cfg.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                cfg.add_output(spec)
        cfg.set_max_batch_size(0)
        cfg.set_model_transaction_policy({"decoupled": True})
        return cfg

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        _extend_sys_path(config.get("parameters", {}).get("python_path", {}).get("string_value"))
        from glm5.serving.stub_logging import stacks_if_slow

        with stacks_if_slow():  # a load that never finishes leaves its stacks in the server log
            self._initialize(args, config)

    def _initialize(self, args: dict[str, str], config: dict) -> None:
        self.model_config = config
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "the glm5 model must be decoupled: set model_transaction_policy { decoupled: true }")

        import importlib

        from glm5.serving import request as rq
        from glm5.serving import vllm_outputs
        from glm5.serving.stub_logging import configure_stub_logging

        configure_stub_logging(params.get("log_level") or "INFO")   # the engine's start log reaches the server log
        self._rq = rq
        self._vo = vllm_outputs
        # The module providing EngineArgs / AsyncLLMEngine / PromptInput (an alternative engine with
        # the same API can be plugged in here).
        self._engine_mod = importlib.import_module(params.get("engine_module") or "glm5.engine")
        EngineArgs, AsyncLLMEngine = self._engine_mod.EngineArgs, self._engine_mod.AsyncLLMEngine
        engine_params = {k: v for k, v in params.items() if k not in BACKEND_PARAMETERS and v != ""}
        if args.get("model_instance_kind") == "GPU" and "device" not in engine_params:
            engine_params["device"] = f"cuda:{args.get('model_instance_device_id', '0')}"
        if "model" not in engine_params:
            raise pb_utils.TritonModelException(
                "config.pbtxt of the glm5 model needs parameters { key: \"model\" value: { string_value: "
                "\"/path/to/checkpoint\" } } (glm5 serve --model DIR fills it in)")
        self._model_name = args.get("model_name", "glm5")
        self._on_failure = (params.get("on_engine_failure") or "exit").strip().lower()
        if self._on_failure not in ("exit", "unload"):
            raise pb_utils.TritonModelException(
                f"on_engine_failure={self._on_failure!r}: use exit (stop tritonserver, default) or unload "
                "(unload this model; needs --model-control-mode=explicit)")
        self.engine_args = EngineArgs.from_dict(engine_params)
        logger.info("glm5: starting engine with %s", self.engine_args)
        self.engine = AsyncLLMEngine(self.engine_args)
        self._load_error_types()

        self._states: dict[str, _RequestState] = {}
        self._states_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._live = rq.LiveRequests()
        self._shutdown = threading.Event()
        self._dead: BaseException | None = None
        self._server_pid: int | None = None    # the tritonserver this stub was asked to stop
        if hasattr(self.engine, "on_dead"):
            self.engine.on_dead(self._on_engine_dead)

        self._loop = asyncio.new_event_loop()
        # RequestStream's ``async for`` waits in an executor thread per in-flight request; the
        # default pool (cpu+4 threads) would serialise streams, so size it for the engine's batch.
        max_seqs = int(getattr(self.engine_args, "max_num_seqs", 64))
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=2 * max_seqs + 16,
                                                               thread_name_prefix="glm5-io")
        self._loop.set_default_executor(self._executor)
        self._loop_thread = threading.Thread(target=self._run_loop, name="glm5-asyncio", daemon=True)
        self._loop_thread.start()
        self._responses: "queue.Queue[tuple[_RequestState, Any, int] | None]" = queue.Queue()
        self._response_thread = threading.Thread(target=self._response_loop, name="glm5-responses",
                                                 daemon=True)
        self._response_thread.start()
        self._cancel_period = float(params.get("cancellation_check_period_ms") or 20) / 1000.0
        self._cancel_thread = threading.Thread(target=self._cancellation_loop, name="glm5-cancel", daemon=True)
        self._cancel_thread.start()

        self._metrics = None
        if (params.get("report_metrics") or "true").lower() in ("1", "true", "yes"):
            labels = {"model": args["model_name"], "version": args["model_version"]}
            interval = float(params.get("metrics_interval_ms") or 200) / 1000.0
            self._metrics = _Metrics(labels, self.engine, interval,
                                     int(getattr(self.engine_args, "max_model_len", 4096)))
        from glm5.heap import freeze_startup_heap

        freeze_startup_heap()   # what start-up made stays out of every full garbage collection (glm5.heap)

    def _load_error_types(self) -> None:
        """Exception types that mean "bad request" (INVALID_ARG) rather than a server fault, and the
        engine's failure types (UNAVAILABLE for a dead engine, INTERNAL for one failed request)."""
        from glm5.engine.errors import EngineDeadError, RequestFailedError

        self._dead_types: tuple[type, ...] = (EngineDeadError,)
        self._failed_types: tuple[type, ...] = (RequestFailedError,)
        types: list[type] = [self._rq.RequestError, ValueError]
        try:
            from glm5.sampling_params import SamplingParamsError

            types.append(SamplingParamsError)
        except ImportError:
            pass
        try:
            from glm5.multimodal import MediaError

            types.append(MediaError)
        except ImportError:
            pass
        self._bad_request_types = tuple(types)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    # ------------------------------------------------------------------ engine death
    def _on_engine_dead(self, error: BaseException) -> None:
        """Called from the engine thread when the engine died of an unrecoverable error."""
        self._dead = error
        logger.critical("glm5: the engine died (%s); answering UNAVAILABLE and taking the model down (%s)",
                        error, self._on_failure)
        if self._on_failure == "unload":
            try:
                pb_utils.unload_model(self._model_name)
            except Exception:  # noqa: BLE001
                logger.exception("could not unload %s (needs --model-control-mode=explicit); it stays loaded "
                                 "and answers UNAVAILABLE", self._model_name)
            return
        ppid = os.getppid()
        try:
            with open(f"/proc/{ppid}/comm", encoding="utf-8") as f:
                parent = f.read().strip()
        except OSError:
            parent = "?"
        if parent != "tritonserver":
            logger.error("the stub's parent (pid %d, %r) is not tritonserver: not signalling it; the model "
                         "answers UNAVAILABLE until the server is restarted", ppid, parent)
            return
        self._server_pid = ppid
        threading.Thread(target=self._stop_server, name="glm5-stop-server", daemon=True).start()

    def _stop_server(self, grace_s: float = 10.0) -> None:
        """SIGTERM tritonserver once the in-flight requests have their error responses (tritonserver
        closes its endpoints at once on SIGTERM, which would cut those responses off)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._states_lock:
                busy = bool(self._states)
            if not busy and self._responses.empty():
                break
            time.sleep(0.05)
        time.sleep(0.2)  # the response thread's last send
        logger.critical("glm5: stopping tritonserver (pid %d) after the engine died", self._server_pid)
        os.kill(self._server_pid, signal.SIGTERM)

    def _wait_for_server_exit(self, limit_s: float = 600.0) -> None:
        """Hold ``finalize`` until the server we asked to stop is gone (see the module docstring): a clean
        unload would let tritonserver exit 0 although it stopped because the engine died."""
        deadline = time.monotonic() + limit_s
        while os.getppid() == self._server_pid and time.monotonic() < deadline:
            time.sleep(0.2)

    def finalize(self) -> None:
        """Abort everything, stop the engine, then every thread (in dependency order)."""
        self._shutdown.set()
        if self._dead is not None and self._server_pid is not None:
            logger.error("glm5: finalize after the engine died: not reporting a clean unload")
            self._wait_for_server_exit()
        with self._states_lock:
            ids = sorted({eid for s in self._states.values() for eid in s.engine_ids})
        for eid in ids:
            try:
                self.engine.abort(eid)
            except Exception:  # noqa: BLE001
                logger.exception("abort %s during finalize failed", eid)
        # Let the request coroutines turn their aborts into final responses.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with self._states_lock:
                if not self._states:
                    break
            time.sleep(0.02)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("engine shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self._responses.put(None)
        self._response_thread.join(timeout=10)
        self._cancel_thread.join(timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._metrics is not None:
            self._metrics.close()
        from glm5.heap import unfreeze_heap

        unfreeze_heap()

    # ------------------------------------------------------------------ request path
    def execute(self, requests: list[Any]) -> None:
        """Hand each request to the asyncio loop and return at once (decoupled)."""
        for request in requests:
            state = _RequestState(request=request, sender=request.get_response_sender(),
                                  client_id=request.request_id() or "")
            if self._dead is not None:
                self._queue_error(state, f"the glm5 engine is dead ({self._dead}); the server is going down",
                                  pb_utils.TritonError.UNAVAILABLE)
                continue
            if self._shutdown.is_set():
                self._queue_error(state, "the glm5 model is shutting down", pb_utils.TritonError.UNAVAILABLE)
                continue
            asyncio.run_coroutine_threadsafe(self._handle(state), self._loop)
        return None

    async def _handle(self, state: _RequestState) -> None:
        """Run one request from parsing to its final response; never raises."""
        try:
            await self._generate(state)
        except Exception as exc:  # noqa: BLE001 (the model keeps serving; the client gets the reason)
            self._answer_error(state, exc)
            # An exception raised on an executor thread is also held by that hop's futures, which can
            # outlive this handler until a garbage collection; its traceback's frames hold the
            # request's inputs (a rejected 10 MB prompt): drop them now, not at the next collection.
            exc.__traceback__ = None
        finally:
            if state.engine_id:
                self._forget(state)

    def _answer_error(self, state: _RequestState, exc: Exception) -> None:
        TE = pb_utils.TritonError
        if isinstance(exc, self._rq.DuplicateRequestIdError):
            self._queue_error(state, str(exc), TE.ALREADY_EXISTS)
        elif isinstance(exc, self._dead_types):
            self._queue_error(state, str(exc), TE.UNAVAILABLE)
        elif isinstance(exc, self._failed_types):
            self._queue_error(state, str(exc), TE.INTERNAL)
        elif isinstance(exc, self._bad_request_types):
            self._queue_error(state, str(exc), TE.INVALID_ARG)
        else:
            logger.exception("request %s failed", state.client_id or state.engine_id, exc_info=exc)
            self._queue_error(state, f"internal error: {type(exc).__name__}: {exc}", TE.INTERNAL)

    def _parse(self, request: Any) -> tuple[Any, Any, Any, str | None]:
        """Tensors → (PromptInput, SamplingParams, OutputFlags, stop_key); raises on bad input."""
        from glm5.sampling_params import SamplingParams

        PromptInput = self._engine_mod.PromptInput

        rq = self._rq
        if _str(request, "embedding_request") is not None:
            raise rq.RequestError(f"model {self.model_config.get('name', 'glm5')} does not support 'embed' "
                                  "requests (embedding_request): it is a generative model; send text_input")
        text = _str(request, "text_input")
        messages = rq.parse_messages(_str(request, "messages"))
        media: dict[str, list[bytes]] = {}
        for name in ("image", "video"):
            arr = _array(request, name)
            items = [] if arr is None else arr.reshape(-1)
            media[name] = [rq.decode_media_item(b, name=name, index=i) for i, b in enumerate(items)]
        images, videos = media["image"], media["video"]
        mm: dict[str, np.ndarray] = {}
        for name in MM_TENSORS:
            arr = _array(request, name)
            if arr is not None and arr.size:
                mm[name] = arr
        if mm and "input_ids" not in mm:
            raise rq.RequestError("preprocessed pixel tensors need input_ids from the preprocess model")
        if mm and (images or videos):
            raise rq.RequestError("send either raw image/video bytes or preprocessed tensors, not both")
        if messages is None and text is None and not mm:
            raise rq.RequestError("text_input is required (or messages for chat requests)")
        if messages is None and not mm and not text:
            raise rq.RequestError("text_input is empty; send a prompt")

        sp_json = _str(request, "sampling_parameters")
        if sp_json is not None:
            sp = rq.parse_json_object(sp_json, name="sampling_parameters")
        else:
            sp = rq.request_parameters(request.parameters())
        rq.check_finite_numbers(sp)
        flags = rq.output_flags(_bool(request, "stream"), _bool(request, "exclude_input_in_output"),
                                return_finish_reason=_bool(request, "return_finish_reason"),
                                return_num_input_tokens=_bool(request, "return_num_input_tokens"),
                                return_num_output_tokens=_bool(request, "return_num_output_tokens"),
                                return_logprobs=_bool(request, "return_logprobs"),
                                return_cumulative_logprob=_bool(request, "return_cumulative_logprob"),
                                return_num_cached_tokens=_bool(request, "return_num_cached_tokens"))
        flags.prompt_prefix = text or None
        params = SamplingParams.from_dict(sp)
        rq.check_sequences(params, flags)
        if params.logprobs is None and (flags.return_logprobs or flags.return_cumulative_logprob
                                        or params.num_sequences > params.n):
            params.logprobs = 0     # the sampled token's logprob only (best_of ranks by its sum)
        if mm:
            if text and "prompt_text" not in mm:
                mm["prompt_text"] = text
            prompt = PromptInput(token_ids=[int(x) for x in mm["input_ids"].reshape(-1)], mm_inputs=mm)
        elif messages is not None:
            prompt = PromptInput(messages=messages, images=images, videos=videos)
        else:
            prompt = PromptInput(text=text, images=images, videos=videos)
        return prompt, params, flags, rq.check_stop_key(_str(request, "stop_key"))

    def _handle_stop(self, state: _RequestState) -> None:
        """``stop=true``: abort the running request with this request id if ``stop_key`` matches its key.

        Answers ``num_output_tokens`` = requests stopped (0 or 1); an unknown id, a request sent
        without a key and a wrong key all answer 0, so a stop cannot probe which ids exist."""
        rq = self._rq
        if not state.client_id:
            raise rq.RequestError("a stop request needs the request id of the request to stop "
                                  "(set request_id on the stop request)")
        key = rq.check_stop_key(_str(state.request, "stop_key"))
        if key is None:
            raise rq.RequestError("a stop request needs the stop_key its target request was sent with "
                                  "(only the sender of a request may stop it)")
        with self._states_lock:
            target = self._live.authorize_stop(state.client_id, key)
            owner = next((s for s in self._states.values() if s.engine_id == target), None) if target else None
        for eid in owner.engine_ids if owner is not None else ():
            self.engine.abort(eid)   # every sequence of the request (n / best_of)
        out = pb_utils.Tensor("text_output", np.array([b""], dtype=np.object_))
        n = pb_utils.Tensor("num_output_tokens", np.array([0 if owner is None else 1], dtype=np.uint32))
        self._queue(state, pb_utils.InferenceResponse(output_tensors=[out, n]), _FINAL)

    def _forget(self, state: _RequestState) -> None:
        """Drop the request's book-keeping; its id may be reused from now on."""
        with self._states_lock:
            for eid in state.engine_ids:
                self._states.pop(eid, None)
            self._live.release(state.client_id, state.engine_id)

    async def _generate(self, state: _RequestState) -> None:
        request = state.request
        if _bool(request, "stop"):
            self._handle_stop(state)
            return
        loop = asyncio.get_running_loop()
        # parsing copies and base64-decodes inputs: off the asyncio loop, which delivers other streams
        prompt, params, flags, stop_key = await loop.run_in_executor(None, self._parse, request)
        n_seq = params.num_sequences
        state.engine_id = f"{state.client_id or 'req'}-{uuid.uuid4().hex[:12]}"
        state.engine_ids = [state.engine_id] if n_seq == 1 else [f"{state.engine_id}.{i}" for i in range(n_seq)]
        with self._states_lock:
            self._live.register(state.client_id, state.engine_id, stop_key)
            for eid in state.engine_ids:
                self._states[eid] = state
        if self._metrics is not None:
            self._metrics.record_params(params.n, n_seq)
        # add_request prepares the prompt on the engine's worker pool and waits: keep it off the loop thread
        streams = []
        for i, eid in enumerate(state.engine_ids):
            child = params if n_seq == 1 else params.for_sequence(i)
            try:
                streams.append(await loop.run_in_executor(None, self.engine.add_request, eid, prompt, child))
            except BaseException:
                for started in state.engine_ids[:i]:
                    self.engine.abort(started)
                raise
        if state.cancelled:
            for eid in state.engine_ids:
                self.engine.abort(eid)

        seqs = self._vo.SequenceSet(n_seq)
        await self._collect(state, streams, seqs, params, flags)
        if self._metrics is not None:
            for m, n_prompt, n_gen, reason in seqs.metrics:
                self._metrics.record_request(m, n_prompt, n_gen, reason)
        if state.cancelled:
            self._queue_error(state, "request was cancelled", pb_utils.TritonError.CANCELLED)
        elif not seqs.finished:
            self._queue_error(state, "the engine ended the request without a final output",
                              pb_utils.TritonError.INTERNAL)

    async def _collect(self, state: _RequestState, streams: list[Any], seqs: Any, params: Any, flags: Any) -> None:
        """Feed every sequence's engine outputs into ``seqs`` and queue the responses: one per
        batch of new output when streaming (every sequence's delta in it), one at the end otherwise."""
        queue_: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: Any) -> None:
            try:
                async for out in stream:
                    queue_.put_nowait((index, out, None))
                    if out.finished:
                        break
            except Exception as exc:  # noqa: BLE001 (handed to the consumer below)
                queue_.put_nowait((index, None, exc))
            queue_.put_nowait((index, None, None))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        open_streams = len(streams)
        try:
            while open_streams:
                items = [await queue_.get()]
                while not queue_.empty():
                    items.append(queue_.get_nowait())
                for index, out, exc in items:
                    if exc is not None:
                        raise exc
                    if out is None:
                        open_streams -= 1
                        continue
                    seqs.add(index, out)
                if state.cancelled or not flags.stream:
                    continue
                if seqs.finished or seqs.has_news:
                    self._queue(state, self._response(seqs, params, flags), _FINAL if seqs.finished else 0)
        finally:
            for t in tasks:
                t.cancel()
            if not seqs.finished:    # an engine error or shutdown: stop the other sequences too
                for eid in state.engine_ids:
                    self.engine.abort(eid)
        if flags.stream or state.cancelled or not seqs.finished:
            return
        self._queue(state, self._response(seqs, params, flags, whole=True), _FINAL)

    def _response(self, seqs: Any, params: Any, flags: Any, *, whole: bool = False) -> Any:
        """One response in vllm_backend's layout: one element per returned sequence (``n`` of them;
        ``best_of`` candidates are ranked by cumulative logprob at the end)."""
        vo = self._vo
        order = seqs.best(params.n) if seqs.size > params.n else None
        rows = seqs.take(order, whole=whole)
        send_prompt_logprobs = params.prompt_logprobs is not None and seqs.take_prompt_logprobs()
        texts = []
        for r in rows:
            t = r["text"] if params.detokenize else ""
            if whole and flags.prepend_input:
                prefix = flags.prompt_prefix if flags.prompt_prefix is not None else seqs.prompt_text
                t = (prefix or "") + t
            texts.append(t.encode("utf-8"))
        obj = np.array(texts, dtype=np.object_)
        tensors = [pb_utils.Tensor("text_output", obj)]
        if flags.return_finish_reason:
            reasons = [vo.finish_reason_text(r["finish_reason"]).encode() for r in rows]
            tensors.append(pb_utils.Tensor("finish_reason", np.array(reasons, dtype=np.object_)))
        if flags.return_cumulative_logprob:
            tensors.append(pb_utils.Tensor("cumulative_logprob",
                                           np.array([r["cumulative_logprob"] for r in rows], dtype=np.float32)))
        if flags.return_logprobs:
            decode = self._decode_token
            lps = [vo.logprobs_json(None if r["logprobs"] is None else vo.vllm_logprob_entries(r["logprobs"], decode))
                   .encode() for r in rows]
            tensors.append(pb_utils.Tensor("logprobs", np.array(lps, dtype=np.object_)))
        if send_prompt_logprobs:
            plp = json.dumps(vo.vllm_prompt_logprobs(seqs.prompt_logprobs, self._decode_token))
            tensors.append(pb_utils.Tensor("prompt_logprobs", np.array([plp.encode()], dtype=np.object_)))
        if flags.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([seqs.num_prompt_tokens], dtype=np.uint32)))
        if flags.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens",
                                           np.array([r["num_tokens"] for r in rows], dtype=np.uint32)))
        if flags.return_num_cached_tokens:
            tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([seqs.num_cached_tokens], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _decode_token(self, token_id: int) -> str:
        """One token on its own, as vLLM's ``decoded_token`` (empty without a tokenizer)."""
        tok = getattr(getattr(self.engine, "engine", None), "tokenizer", None)
        return "" if tok is None else tok.decode([int(token_id)])

    # ------------------------------------------------------------------ sending
    def _queue(self, state: _RequestState, response: Any, flags: int) -> None:
        if state.done:
            return
        if flags & _FINAL:
            state.done = True
            if state.engine_id:  # release the id before the client can see the final response and reuse it
                self._forget(state)
        self._responses.put((state, response, flags))

    def _queue_error(self, state: _RequestState, message: str, code: Any) -> None:
        if state.done:
            return
        if self._metrics is not None and code != pb_utils.TritonError.CANCELLED:
            self._metrics.record_error()
        err = pb_utils.TritonError(message, code)
        out = pb_utils.Tensor("text_output", np.array([b""], dtype=np.object_))
        self._queue(state, pb_utils.InferenceResponse(output_tensors=[out], error=err), _FINAL)

    def _response_loop(self) -> None:
        while True:
            item = self._responses.get()
            if item is None:
                return
            state, response, flags = item
            try:
                with self._send_lock:
                    if flags & _FINAL:
                        state.closed = True
                    state.sender.send(response, flags=flags)
                    if not flags & _FINAL and not state.cancelled and state.sender.is_cancelled():
                        self._mark_cancelled(state)
            except Exception:  # noqa: BLE001 (a vanished client must not stop other responses)
                logger.exception("sending a response for %s failed", state.engine_id or state.client_id)
                if not flags & _FINAL:
                    self._mark_cancelled(state)

    def _mark_cancelled(self, state: _RequestState) -> None:
        state.cancelled = True
        for eid in state.engine_ids:
            self.engine.abort(eid)

    def _cancellation_loop(self) -> None:
        while not self._shutdown.wait(self._cancel_period):
            with self._states_lock:
                states = list({id(s): s for s in self._states.values() if not s.cancelled and not s.done}.values())
            for s in states:
                try:
                    with self._send_lock:
                        # the snapshot above can be stale: the final response may have gone out since
                        cancelled = not s.closed and s.sender.is_cancelled()
                except Exception:  # noqa: BLE001
                    cancelled = False
                if cancelled:
                    self._mark_cancelled(s)
