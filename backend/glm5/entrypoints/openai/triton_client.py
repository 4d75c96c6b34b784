"""The OpenAI server's link to Triton: one gRPC stream per request to the ``glm5`` model.

Triton stays the server of record: every request goes through ``ModelStreamInfer`` (tritonclient's
asyncio client) with the model's vllm_backend-compatible tensors, and each Triton response comes
back as a :class:`GenerationUpdate` (one element per output sequence). Leaving the ``async for``
early — the HTTP client went away, the handler was cancelled — cancels the gRPC call, which Triton
turns into a cancellation the ``glm5`` model sees and aborts in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Messages the glm5 backend starts server faults with (everything else it rejects is a bad request).
#: glm5 serve's admin key (glm5.serving.access.ADMIN_KEY_ENV) and the gRPC metadata name tritonserver checks for
#: it (its "triton-grpc-protocol-" prefix + glm5.serving.access.ADMIN_HEADER); spelled out here because the
#: serving package imports this one.
ADMIN_KEY_ENV = "GLM5_ADMIN_KEY"
ADMIN_GRPC_METADATA = "triton-grpc-protocol-glm5-admin-key"
_SERVER_FAULT_PREFIXES = ("internal error", "the engine ended", "the glm5 model is shutting down",
                          "engine loop", "Stub process")


class TritonRequestError(Exception):
    """Triton answered the request with an error; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def error_status(message: str) -> int:
    """HTTP status of a Triton error message: 500 for server faults, 503 when Triton is unreachable,
    499 for a cancelled request, else 400 (the model rejected the input)."""
    if any(message.startswith(p) or p in message for p in _SERVER_FAULT_PREFIXES):
        return 500
    if "cancelled" in message.lower():
        return 499
    if "StatusCode.UNAVAILABLE" in message or "failed to connect" in message.lower():
        return 503
    return 400


@dataclass
class GenerationRequest:
    """What one OpenAI choice group asks of the model (``sampling`` = its ``sampling_parameters``)."""

    sampling: dict[str, Any]
    text: str | None = None
    token_ids: list[int] | None = None
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    stream: bool = False
    logprobs: bool = False


@dataclass
class GenerationUpdate:
    """One Triton response: per sequence the new text, tokens, logprobs and finish reason."""

    texts: list[str]
    finish_reasons: list[str | None]
    num_output_tokens: list[int]
    logprobs: list[list[dict] | None] | None
    num_input_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list | None
    final: bool


def _strings(arr: np.ndarray | None) -> list[str]:
    if arr is None:
        return []
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]


def _update(result: Any) -> GenerationUpdate:
    resp = result.get_response()
    names = {o.name for o in resp.outputs}
    get = lambda n: result.as_numpy(n) if n in names else None  # noqa: E731
    texts = _strings(get("text_output"))
    reasons = [None if r in ("", "None") else r for r in _strings(get("finish_reason"))] or [None] * len(texts)
    n_out = get("num_output_tokens")
    lps = None
    if "logprobs" in names:
        lps = [None if s == "null" else json.loads(s) for s in _strings(get("logprobs"))]
    plp = _strings(get("prompt_logprobs"))
    n_in, n_cached = get("num_input_tokens"), get("num_cached_tokens")
    final = bool(resp.parameters["triton_final_response"].bool_param) if "triton_final_response" in resp.parameters \
        else False
    return GenerationUpdate(texts=texts, finish_reasons=reasons,
                            num_output_tokens=[int(x) for x in n_out.reshape(-1)] if n_out is not None else [0] * len(texts),
                            logprobs=lps, num_input_tokens=int(n_in.reshape(-1)[0]) if n_in is not None else 0,
                            num_cached_tokens=int(n_cached.reshape(-1)[0]) if n_cached is not None else 0,
                            prompt_logprobs=json.loads(plp[0]) if plp else None, final=final)


class TritonGenerator:
    """Streams generations from a Triton model over gRPC (one channel, one stream per request)."""

    def __init__(self, url: str, model_name: str = "glm5") -> None:
        import tritonclient.grpc.aio as grpcaio

        self.url, self.model_name = url, model_name
        self._client = grpcaio.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    async def model_parameters(self) -> dict[str, str]:
        """The model's config.pbtxt parameters (``max_model_len`` and friends).

        ``glm5 serve`` restricts the model-config API; it hands this process the admin key in
        ``$GLM5_ADMIN_KEY``, sent as the gRPC metadata tritonserver checks.
        """
        key = os.environ.get(ADMIN_KEY_ENV)
        headers = {ADMIN_GRPC_METADATA: key} if key else None
        cfg = await self._client.get_model_config(self.model_name, as_json=True, headers=headers)
        params = cfg.get("config", cfg).get("parameters", {})
        return {k: v.get("string_value", "") for k, v in params.items()}

    async def is_ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model_name))
        except Exception:  # noqa: BLE001 (not reachable = not ready)
            return False

    def _inputs(self, req: GenerationRequest) -> list[Any]:
        import tritonclient.grpc as grpcclient

        def tensor(name: str, arr: np.ndarray, dtype: str) -> Any:
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            return t

        def flag(name: str, value: bool) -> Any:
            return tensor(name, np.array([value], dtype=bool), "BOOL")

        inputs = []
        if req.token_ids is not None:
            inputs.append(tensor("input_ids", np.array(req.token_ids, dtype=np.int64), "INT64"))
        if req.text is not None:
            inputs.append(tensor("text_input", np.array([req.text.encode("utf-8")], dtype=np.object_), "BYTES"))
        for name, items in (("image", req.images), ("video", req.videos)):
            if items:
                inputs.append(tensor(name, np.array(items, dtype=np.object_), "BYTES"))
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(req.sampling).encode()], dtype=np.object_),
                             "BYTES"))
        inputs += [flag("stream", req.stream), flag("exclude_input_in_output", True),
                   flag("return_finish_reason", True), flag("return_num_input_tokens", True),
                   flag("return_num_output_tokens", True), flag("return_num_cached_tokens", True),
                   flag("return_logprobs", req.logprobs)]
        return inputs

    async def generate(self, req: GenerationRequest, request_id: str = "") -> AsyncIterator[GenerationUpdate]:
        """Yield the model's responses until the final one; raises :class:`TritonRequestError`."""
        done = asyncio.Event()
        payload = {"model_name": self.model_name, "inputs": self._inputs(req), "request_id": request_id}

        async def requests():
            yield payload
            await done.wait()          # keep our side of the stream open until the last response

        responses = self._client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    msg = str(error.message() if hasattr(error, "message") else error)
                    finished = True
                    raise TritonRequestError(msg, error_status(msg))
                update = _update(result)
                finished = update.final
                yield update
                if finished:
                    return
        except TritonRequestError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (grpc errors: Triton unreachable, stream broken)
            msg = f"Triton at {self.url} did not answer: {exc}"
            finished = True
            raise TritonRequestError(msg, 503) from exc
        finally:
            done.set()
            if not finished:
                responses.cancel()     # the caller left early: cancel the request in Triton
