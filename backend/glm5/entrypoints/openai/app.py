"""The OpenAI-compatible HTTP server: a FastAPI app run by uvicorn, in front of Triton.

``python -m glm5.entrypoints.openai --triton-url 127.0.0.1:8001 --model CKPT --port 9000`` (or
``glm5 serve --openai-port 9000``, which starts this process once Triton is ready). Routes:
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /health``.
Errors use OpenAI's JSON with the matching HTTP status (400 bad input, 404 unknown model, 413
body too large, 500 server fault, 503 Triton unreachable). A client that disconnects cancels its
Triton request: streams through the response task's cancellation, non-streamed requests through a
watcher that polls the connection while the answer is computed. Binds 127.0.0.1 unless told.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from glm5.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9000
DEFAULT_MAX_BODY_MB = 64.0


class BodyLimit:
    """Pure ASGI middleware: a body larger than ``max_bytes`` gets 413 (by its Content-Length before
    anything is read; a chunked body when the running count passes the limit). Pure ASGI, not
    ``BaseHTTPMiddleware``: that one wraps ``receive`` so ``Request.is_disconnected`` no longer
    sees the client leave, which the cancellation of non-streamed requests relies on."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await JSONResponse(self._error(int(length)).to_json(), status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error(seen)
            return message

        await self.app(scope, counting_receive, send)

    def _error(self, size: int) -> OpenAIError:
        return OpenAIError(f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes "
                           "(--max-body-mb)", status=413)


def build_app(serving: Any, max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)) -> FastAPI:
    """The FastAPI app around an :class:`~glm5.entrypoints.openai.serving.OpenAIServing`."""
    app = FastAPI(title="glm5-triton OpenAI-compatible API")

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return JSONResponse(OpenAIError(msg or "invalid request", param=param).to_json(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = OpenAIError(f"internal error: {type(exc).__name__}: {exc}", status=500)
        return JSONResponse(err.to_json(), status_code=500)

    async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
        """Run ``work``; cancel it (and with it the Triton request) if the client goes away."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise OpenAIError("the client disconnected; request cancelled", status=499)

    async def answer(request: Request, work: Awaitable[Any]) -> Any:
        result = await until_disconnect(request, work)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await serving.generator.is_ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        serving.check_model(model)
        return JSONResponse(serving.models()["data"][0])

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await answer(request, serving.chat(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await answer(request, serving.completions(body))

    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton gRPC address (default 127.0.0.1:8001)")
    parser.add_argument("--triton-model", default="glm5", help="Triton model to call (default glm5)")
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer + chat template)")
    parser.add_argument("--served-model-name", default="glm5", help="model id clients send (default glm5)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the Triton model's max_model_len)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                        help=f"largest request body, MiB (default {DEFAULT_MAX_BODY_MB:g}; larger gets 413)")
    parser.add_argument("--no-reasoning-parser", action="store_true",
                        help="return <think>...</think> inside content instead of reasoning_content")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for the Triton model")
    parser.add_argument("--log-level", default="info")


async def _model_parameters(generator: Any, timeout: float) -> dict[str, str]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if await generator.is_ready():
                return await generator.model_parameters()
        except Exception as exc:  # noqa: BLE001 (retried until the deadline)
            if "restricted" in str(exc):    # waiting would not help: say what is missing
                raise RuntimeError("Triton's model-config API is restricted (glm5 serve's default): give this "
                                   "server the admin key in $GLM5_ADMIN_KEY") from None
            logger.debug("Triton not ready yet: %s", exc)
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"Triton model {generator.model_name!r} at {generator.url} not ready after {timeout:.0f}s")
        await asyncio.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from glm5.entrypoints.openai.serving import OpenAIServing
    from glm5.entrypoints.openai.triton_client import TritonGenerator
    from glm5.heap import freeze_startup_heap
    from glm5.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)

    async def main() -> None:
        generator = TritonGenerator(args.triton_url, args.triton_model)
        try:
            params = await _model_parameters(generator, args.ready_timeout)
            max_len = args.max_model_len or int(params.get("max_model_len") or 4096)
            serving = OpenAIServing(generator, tokenizer, args.served_model_name, max_len,
                                    reasoning_parser=not args.no_reasoning_parser)
            app = build_app(serving, int(args.max_body_mb * 2**20))
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=str(args.log_level).lower())
            logger.info("OpenAI API on http://%s:%d/v1 -> Triton %s model %s (max_model_len %d)", args.host,
                        args.port, args.triton_url, args.triton_model, max_len)
            # the tokenizer brings transformers and torch: ~235,000 tracked objects, whose full collection
            # (~0.2 s) would hold every stream's next event (glm5.heap)
            freeze_startup_heap()
            await uvicorn.Server(config).serve()
        finally:
            await generator.close()

    try:
        asyncio.run(main())
    except RuntimeError as exc:
        print(f"glm5 openai server: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5.entrypoints.openai",
                                     description="OpenAI-compatible API in front of the Triton glm5 model")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run(args)
