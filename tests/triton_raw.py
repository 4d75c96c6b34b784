"""Raw requests to a test tritonserver: arbitrary tensors over one gRPC stream, JSON over HTTP, metrics.

The client library (``glm5_client``) only builds well-formed requests; the hardening and fuzz tests
need to send anything (wrong dtypes, shapes, out-of-range ids) and see exactly what comes back.
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RawResult:
    """What one streamed request got back: text pieces, the error (if any) and per-response times."""

    texts: list[str] = field(default_factory=list)
    error: str | None = None
    final: bool = False
    stamps: list[float] = field(default_factory=list)
    tensors: list[dict[str, np.ndarray]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
           np.dtype(np.float64): "FP64", np.dtype(np.float16): "FP16", np.dtype(bool): "BOOL",
           np.dtype(np.uint8): "UINT8", np.dtype(object): "BYTES"}


def tensor(value: Any, dtype: Any = None) -> np.ndarray:
    """A numpy input: strings/bytes become a BYTES tensor, everything else ``np.asarray(value, dtype)``."""
    if isinstance(value, (str, bytes)):
        return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    return np.asarray(value, dtype=dtype)


def raw_stream(url: str, model: str, inputs: dict[str, np.ndarray], request_id: str = "",
               timeout_s: float = 120.0, cancel_after: int | None = None) -> RawResult:
    """Send one request over its own gRPC stream and collect every response until the final one.

    ``cancel_after``: close the stream with ``cancel_requests=True`` after that many responses."""
    import tritonclient.grpc as grpcclient

    res = RawResult()
    client = grpcclient.InferenceServerClient(url)
    q: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    cancelled = False
    try:
        infer_inputs = []
        for name, arr in inputs.items():
            inp = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype])
            inp.set_data_from_numpy(arr)
            infer_inputs.append(inp)
        client.async_stream_infer(model, infer_inputs, request_id=request_id, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                res.error = f"TIMEOUT after {timeout_s}s"
                return res
            try:
                result, error = q.get(timeout=left)
            except queue.Empty:
                continue
            now = time.perf_counter()
            if error is not None:
                res.error = str(error)
                res.final = True
                return res
            resp = result.get_response()
            names = {o.name for o in resp.outputs}
            got = {n: result.as_numpy(n) for n in names}
            res.tensors.append(got)
            if "text_output" in got and got["text_output"] is not None:
                res.texts.append("".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                         for x in got["text_output"].reshape(-1)))
            res.stamps.append(now)
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                res.final = True
                return res
            if cancel_after is not None and len(res.stamps) >= cancel_after:
                cancelled = True
                return res
    finally:
        client.stop_stream(cancel_requests=cancelled or not res.final)
        client.close()


def post_json(url: str, body: Any, timeout_s: float = 120.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 (loopback test server)
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return status, {"raw": raw.decode("utf-8", "replace")}


def metric(metrics_text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', metrics_text, re.M)
    assert m is not None, f"metric {name} not exported"
    return float(m.group(1))


def wait_idle(srv, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until the engine reports nothing running or waiting and no cache block in use."""
    names = ("glm5:num_requests_running", "glm5:num_requests_waiting", "glm5:kv_cache_usage_ratio")
    deadline = time.monotonic() + timeout_s
    while True:
        text = srv.metrics_text()
        vals = {n: metric(text, n) for n in names}
        if all(v == 0 for v in vals.values()) or time.monotonic() > deadline:
            return vals
        time.sleep(0.1)


def stub_rss_mib(srv, model: str = "glm5") -> float:
    """Resident memory (MiB) of the stub process serving ``model`` under ``srv``'s tritonserver."""
    import os

    needle = f"/{model}/1/model.py".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        if needle in cmd and f"PPid:\t{srv.proc.pid}\n" in status:
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    raise AssertionError(f"no stub process for {model} under pid {srv.proc.pid}")
