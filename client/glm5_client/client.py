"""Python client for the ``glm5`` Triton models (gRPC streaming, HTTP generate/SSE, asyncio).

The tensor interface is vllm_backend's (``text_input``, ``image``, ``stream``,
``sampling_parameters``, ``return_*``), plus ``video``, ``messages`` and ``stop``. Responses are
deltas: concatenating ``text`` of every chunk gives the full output. The end of a gRPC stream is
the ``triton_final_response`` response parameter; the server puts it on the last data response.

Over gRPC images and videos travel as raw bytes; over HTTP ``/generate`` JSON cannot carry raw
bytes, so they are base64 encoded (the server accepts both).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import queue
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"


class Glm5ClientError(RuntimeError):
    """The server answered with an error (the message is the server's reason)."""


@dataclass
class GenerationChunk:
    """One streamed response: a text delta and whatever extra outputs were requested."""

    text: str
    final: bool
    finish_reason: str | None = None
    num_output_tokens: int | None = None      # tokens in this delta (when requested)
    num_input_tokens: int | None = None
    logprobs: list | None = None
    received_at: float = field(default_factory=time.perf_counter)


@dataclass
class GenerationResult:
    """A whole generation with client-side timings (perf_counter seconds)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int | None
    chunks: list[GenerationChunk]
    started_at: float
    first_chunk_at: float | None
    finished_at: float

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.started_at

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second over the whole request (None when the count is unknown)."""
        if not self.num_output_tokens or self.latency_s <= 0:
            return None
        return self.num_output_tokens / self.latency_s

    @property
    def inter_token_latencies_s(self) -> list[float]:
        """Gaps between consecutive non-empty chunks, each divided by that chunk's token count."""
        out: list[float] = []
        prev = None
        for c in self.chunks:
            if not c.text and not c.num_output_tokens:
                continue
            if prev is not None:
                n = max(int(c.num_output_tokens or 1), 1)
                out.extend([(c.received_at - prev) / n] * n)
            prev = c.received_at
        return out


def collect(chunks: Sequence[GenerationChunk], started_at: float) -> GenerationResult:
    """Fold streamed chunks into a ``GenerationResult``."""
    text = "".join(c.text for c in chunks)
    reason = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None)
    n_in = next((c.num_input_tokens for c in chunks if c.num_input_tokens is not None), None)
    counts = [c.num_output_tokens for c in chunks if c.num_output_tokens is not None]
    first = next((c.received_at for c in chunks if c.text or c.num_output_tokens), None)
    end = chunks[-1].received_at if chunks else time.perf_counter()
    return GenerationResult(text, reason, n_in, sum(counts) if counts else None, list(chunks),
                            started_at, first, end)


@dataclass
class GenerateRequest:
    """Everything one generation request can carry; shared by the sync, async and HTTP paths."""

    prompt: str = ""
    images: Sequence[bytes] = ()
    videos: Sequence[bytes] = ()
    messages: list[dict] | None = None
    sampling: dict[str, Any] | None = None
    stream: bool = True
    exclude_input_in_output: bool | None = None
    return_finish_reason: bool = True
    return_num_input_tokens: bool = True
    return_num_output_tokens: bool = True
    return_logprobs: bool = False
    request_id: str = ""
    stop: bool = False
    # secret that proves ownership of ``request_id`` to a later stop request (16-256 characters)
    stop_key: str = ""

    def tensors(self) -> list[tuple[str, np.ndarray, str]]:
        """(name, array, triton dtype) for each input to send."""
        t: list[tuple[str, np.ndarray, str]] = [
            ("text_input", np.array([self.prompt.encode()], dtype=np.object_), "BYTES"),
            ("stream", np.array([self.stream], dtype=bool), "BOOL"),
        ]
        if self.images:
            t.append(("image", np.array([bytes(b) for b in self.images], dtype=np.object_), "BYTES"))
        if self.videos:
            t.append(("video", np.array([bytes(b) for b in self.videos], dtype=np.object_), "BYTES"))
        if self.messages is not None:
            t.append(("messages", np.array([json.dumps(self.messages).encode()], dtype=np.object_), "BYTES"))
        if self.sampling:
            t.append(("sampling_parameters", np.array([json.dumps(self.sampling).encode()], dtype=np.object_),
                      "BYTES"))
        if self.exclude_input_in_output is not None:
            t.append(("exclude_input_in_output", np.array([self.exclude_input_in_output], dtype=bool), "BOOL"))
        for name in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                     "return_logprobs", "stop"):
            if getattr(self, name):
                t.append((name, np.array([True], dtype=bool), "BOOL"))
        if self.stop_key:
            t.append(("stop_key", np.array([self.stop_key.encode()], dtype=np.object_), "BYTES"))
        return t

    def http_body(self) -> dict[str, Any]:
        """JSON body for ``/generate`` and ``/generate_stream`` (media base64 encoded)."""
        body: dict[str, Any] = {"text_input": self.prompt, "stream": self.stream}
        if self.images:
            body["image"] = [base64.b64encode(b).decode() for b in self.images]
        if self.videos:
            body["video"] = [base64.b64encode(b).decode() for b in self.videos]
        if self.messages is not None:
            body["messages"] = json.dumps(self.messages)
        if self.sampling:
            body["sampling_parameters"] = json.dumps(self.sampling)
        if self.exclude_input_in_output is not None:
            body["exclude_input_in_output"] = self.exclude_input_in_output
        for name in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                     "return_logprobs", "stop"):
            if getattr(self, name):
                body[name] = True
        if self.stop_key:
            body["stop_key"] = self.stop_key
        return body


def _first(arr: np.ndarray | None) -> Any:
    if arr is None or arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v


def _finish_reason(value: Any) -> str | None:
    """The server sends vllm_backend's ``"None"`` for a sequence that has not finished."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return None if value in (None, "", "None") else str(value)


def chunk_from_infer_result(result: Any) -> GenerationChunk:
    """Build a chunk from a tritonclient gRPC ``InferResult``."""
    now = time.perf_counter()
    resp = result.get_response()
    final = bool(resp.parameters["triton_final_response"].bool_param) \
        if "triton_final_response" in resp.parameters else False
    names = {o.name for o in resp.outputs}
    text_arr = result.as_numpy("text_output") if "text_output" in names else None
    text = "".join(v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                   for v in (text_arr.reshape(-1) if text_arr is not None else []))
    reason = _first(result.as_numpy("finish_reason")) if "finish_reason" in names else None
    n_out = result.as_numpy("num_output_tokens") if "num_output_tokens" in names else None
    n_in = _first(result.as_numpy("num_input_tokens")) if "num_input_tokens" in names else None
    lp = _first(result.as_numpy("logprobs")) if "logprobs" in names else None
    return GenerationChunk(text=text, final=final, finish_reason=_finish_reason(reason),
                           num_output_tokens=int(n_out.sum()) if n_out is not None else None,
                           num_input_tokens=int(n_in) if n_in is not None else None,
                           logprobs=json.loads(lp) if lp else None, received_at=now)


def chunk_from_json(obj: dict[str, Any], final: bool) -> GenerationChunk:
    """Build a chunk from one ``/generate`` JSON object or ``/generate_stream`` SSE event."""
    if "error" in obj:
        raise Glm5ClientError(str(obj["error"]))

    def scalar(key: str) -> Any:
        v = obj.get(key)
        return v[0] if isinstance(v, list) and v else (None if isinstance(v, list) else v)

    text = obj.get("text_output", "")
    if isinstance(text, list):
        text = "".join(map(str, text))
    n_out = obj.get("num_output_tokens")
    if isinstance(n_out, list):
        n_out = sum(int(x) for x in n_out)
    lp = scalar("logprobs")
    n_in = scalar("num_input_tokens")
    return GenerationChunk(text=str(text), final=final, finish_reason=_finish_reason(scalar("finish_reason")),
                           num_output_tokens=None if n_out is None else int(n_out),
                           num_input_tokens=None if n_in is None else int(n_in),
                           logprobs=json.loads(lp) if lp else None)


class Glm5Client:
    """Blocking client. ``protocol`` is ``grpc`` (streams via ``ModelStreamInfer``) or ``http``."""

    def __init__(self, url: str | None = None, model: str = "glm5", protocol: str = "grpc",
                 timeout_s: float | None = None) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.protocol = protocol
        self.model = model
        self.timeout_s = timeout_s
        self.url = url or (DEFAULT_GRPC_URL if protocol == "grpc" else DEFAULT_HTTP_URL)
        self._grpc = None
        if protocol == "grpc":
            import tritonclient.grpc as grpcclient

            self._grpc = grpcclient.InferenceServerClient(self.url)

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def __enter__(self) -> "Glm5Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API --
    def generate_stream(self, prompt: str = "", **kwargs: Any) -> Iterator[GenerationChunk]:
        """Yield chunks as they arrive. Closing the generator early cancels the request (gRPC)."""
        req = GenerateRequest(prompt=prompt, **kwargs)
        if self.protocol == "grpc":
            yield from self._grpc_stream(req)
        else:
            yield from self._http_stream(req)

    def generate(self, prompt: str = "", **kwargs: Any) -> GenerationResult:
        """Run one request to completion (``stream`` defaults to False: one response)."""
        kwargs.setdefault("stream", False)
        start = time.perf_counter()
        return collect(list(self.generate_stream(prompt, **kwargs)), start)

    def stop(self, request_id: str, stop_key: str) -> bool:
        """Ask the glm5 model to abort the running request sent with ``request_id`` and ``stop_key``
        (works for ensembles). True if a request was stopped; False if none matched (unknown id,
        finished, or sent without / with another key)."""
        chunks = list(self.generate_stream("", request_id=request_id, stop=True, stream=False, stop_key=stop_key,
                                           return_finish_reason=False, return_num_input_tokens=False,
                                           return_num_output_tokens=False))
        return any((c.num_output_tokens or 0) > 0 for c in chunks)

    # -- gRPC --
    def _grpc_stream(self, req: GenerateRequest) -> Iterator[GenerationChunk]:
        import tritonclient.grpc as grpcclient

        assert self._grpc is not None
        inputs = []
        for name, arr, dtype in req.tensors():
            inp = grpcclient.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        q: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        self._grpc.start_stream(callback=lambda result, error: q.put((result, error)),
                                stream_timeout=self.timeout_s)
        finished = False
        try:
            self._grpc.async_stream_infer(self.model, inputs, request_id=req.request_id or str(uuid.uuid4()),
                                          enable_empty_final_response=True)
            while True:
                result, error = q.get(timeout=self.timeout_s)
                if error is not None:
                    finished = True
                    raise Glm5ClientError(str(error))
                chunk = chunk_from_infer_result(result)
                if chunk.final:
                    finished = True
                yield chunk
                if chunk.final:
                    return
        except queue.Empty as exc:
            raise Glm5ClientError(f"no response within {self.timeout_s}s") from exc
        finally:
            self._grpc.stop_stream(cancel_requests=not finished)

    # -- HTTP --
    def _http_conn(self) -> http.client.HTTPConnection:
        host = self.url.split("://", 1)[-1].rstrip("/")
        return http.client.HTTPConnection(host, timeout=self.timeout_s)

    def _http_stream(self, req: GenerateRequest) -> Iterator[GenerationChunk]:
        conn = self._http_conn()
        try:
            path = f"/v2/models/{self.model}/{'generate_stream' if req.stream else 'generate'}"
            conn.request("POST", path, body=json.dumps(req.http_body()),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if not req.stream:
                body = resp.read().decode()
                obj = json.loads(body) if body else {}
                if resp.status != 200:
                    raise Glm5ClientError(obj.get("error", body) if isinstance(obj, dict) else body)
                yield chunk_from_json(obj, final=True)
                return
            if resp.status != 200:
                body = resp.read().decode()
                try:
                    raise Glm5ClientError(json.loads(body).get("error", body))
                except json.JSONDecodeError:
                    raise Glm5ClientError(body) from None
            # SSE: one "data: {json}" line per response, blank line between events. The stream
            # ends when the server closes it after the final response.
            pending: GenerationChunk | None = None
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                chunk = chunk_from_json(json.loads(line[5:].strip()), final=False)
                if pending is not None:
                    yield pending
                pending = chunk
            if pending is not None:
                pending.final = True
                yield pending
        finally:
            conn.close()


class AsyncGlm5Client:
    """asyncio gRPC client (``tritonclient.grpc.aio``); one stream per request, cancellable."""

    def __init__(self, url: str | None = None, model: str = "glm5", timeout_s: float | None = None) -> None:
        import tritonclient.grpc.aio as aio

        self.url = url or DEFAULT_GRPC_URL
        self.model = model
        self.timeout_s = timeout_s
        self._client = aio.InferenceServerClient(self.url)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "AsyncGlm5Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate_stream(self, prompt: str = "", **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        """Yield chunks as they arrive; cancelling the consuming task cancels the request."""
        import tritonclient.grpc.aio as aio

        req = GenerateRequest(prompt=prompt, **kwargs)
        inputs = []
        for name, arr, dtype in req.tensors():
            inp = aio.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs,
                   "request_id": req.request_id or str(uuid.uuid4()), "enable_empty_final_response": True}
            await done.wait()   # keep the request side open until the final response

        call = self._client.stream_infer(requests(), stream_timeout=self.timeout_s)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise Glm5ClientError(str(error))
                chunk = chunk_from_infer_result(result)
                yield chunk
                if chunk.final:
                    finished = True
                    break
        finally:
            done.set()
            if not finished:
                call.cancel()

    async def generate(self, prompt: str = "", **kwargs: Any) -> GenerationResult:
        kwargs.setdefault("stream", False)
        start = time.perf_counter()
        chunks = [c async for c in self.generate_stream(prompt, **kwargs)]
        return collect(chunks, start)
