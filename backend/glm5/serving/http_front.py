"""A size-capping HTTP front for tritonserver's HTTP endpoint (ASGI: Starlette + httpx, run by uvicorn).

Why it exists. tritonserver 2.51 dies with SIGSEGV on one HTTP request: a body of about 4 MB sent
with ``Content-Type: application/x-www-form-urlencoded`` (curl's default for ``-d`` and
``--data-binary``). Its HTTP library, libevhtp, parses such a body as a query string once the
request is read (``request_parse_fini_`` → ``evhtp_parse_query_wflags``), and that function puts
two buffers of the body's length on the worker thread's stack (C99 arrays
``key_buf[len + 1]``/``val_buf[len + 1]``): past ~4.17 MB they overflow the 8 MiB thread stack
(upstream issue triton-inference-server/server#5840). The model, the endpoint and the body's
content do not matter, and 2.51 has no option that limits the HTTP body size
(``--http-max-input-size`` arrived in 2.59 and caps tensor sizes, not this parse).

What it does. ``glm5 serve`` binds tritonserver's HTTP port to 127.0.0.1 on a private port and
runs this front on the public HTTP port. It forwards every ``/v2/...`` request unchanged
(headers, status, the ``generate_stream`` server-sent events chunk by chunk without buffering)
except that

* a body larger than ``max_body_bytes`` (by ``Content-Length`` or counted while it streams in) is
  answered ``413`` with a JSON error and never forwarded;
* ``application/x-www-form-urlencoded`` is never passed on (the header is dropped): Triton's
  protocol is JSON or binary and ignores the content type, so nothing else changes, and no body
  can reach the crashing parse even when an operator raises the size cap.

``make_app`` builds the ASGI app so that it can be served alone (``python -m
glm5.serving.http_front``, what ``glm5 serve`` runs) or mounted beside another ASGI app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger(__name__)

#: Default body cap. Below 2.51's crash threshold (~4.17 MB) so the front stays safe even if
#: another parse of that kind exists; large media go over gRPC (no such limit there).
DEFAULT_MAX_BODY_BYTES = 4_000_000
#: After a too-large body is detected the rest is still read (and dropped), so that the client,
#: which is usually still sending, receives the 413 instead of a reset connection; past this many
#: bytes or seconds the connection is simply closed.
DRAIN_MAX_BYTES = 256 * 1024 * 1024
DRAIN_MAX_SECONDS = 10.0
FORM_CONTENT_TYPE = "application/x-www-form-urlencoded"
#: Upstream answers with a Content-Length up to this size are read whole and passed on with it;
#: everything else (generate_stream's events, large outputs) is streamed through chunk by chunk.
BUFFERED_RESPONSE_BYTES = 1024 * 1024
#: While tritonserver is starting every readiness poll fails; say so at most this often.
UNREACHABLE_LOG_INTERVAL_S = 30.0

# Connection-level headers (RFC 9110 §7.6.1) are not forwarded, nor what httpx/uvicorn recompute.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length", "expect"})


@dataclass(frozen=True)
class FrontSettings:
    """Where to forward and what to refuse."""

    upstream: str                               # tritonserver's HTTP base URL, e.g. http://127.0.0.1:PORT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"upstream {self.upstream!r} must be an http:// URL (tritonserver's HTTP endpoint)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be >= 1")


class BodyTooLarge(Exception):
    """The request body passed the cap; ``seen`` is how many bytes were counted (or announced)."""

    def __init__(self, seen: int) -> None:
        super().__init__(seen)
        self.seen = seen


def _error(status: int, message: str) -> JSONResponse:
    # Triton's own error shape, so clients parse errors from the front and from Triton alike.
    return JSONResponse({"error": message}, status_code=status)


def _too_large(settings: FrontSettings, seen: int, announced: bool) -> JSONResponse:
    what = f"of {seen} bytes" if announced else f"of more than {settings.max_body_bytes} bytes"
    return _error(413, f"request body {what} exceeds this server's HTTP limit of {settings.max_body_bytes} "
                       "bytes; send large images/videos over gRPC, or raise the limit with "
                       "glm5 serve --http-max-body-bytes")


async def _drain(request: Request) -> None:
    """Read and drop what is left of the body, bounded in bytes and time (see DRAIN_MAX_*)."""
    drained = 0
    deadline = time.monotonic() + DRAIN_MAX_SECONDS
    try:
        async with asyncio.timeout(DRAIN_MAX_SECONDS):
            async for chunk in request.stream():
                drained += len(chunk)
                if drained > DRAIN_MAX_BYTES or time.monotonic() > deadline:
                    return
    except (ClientDisconnect, TimeoutError, RuntimeError):
        return


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it passes ``limit`` (nothing kept beyond it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise ValueError(f"Content-Length {declared!r} is not a number") from None
        if n > limit:
            raise BodyTooLarge(n)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        parts.append(chunk)
    return b"".join(parts)


def forward_headers(headers: "list[tuple[str, str]]") -> list[tuple[str, str]]:
    """Request headers as sent upstream: no hop-by-hop headers, no form content type."""
    out = []
    for k, v in headers:
        lk = k.lower()
        if lk in _HOP_BY_HOP:
            continue
        if lk == "content-type" and v.split(";", 1)[0].strip().lower() == FORM_CONTENT_TYPE:
            continue
        out.append((k, v))
    return out


def make_app(settings: FrontSettings, client: httpx.AsyncClient | None = None) -> Starlette:
    """The front as an ASGI app: ``/v2`` and everything under it is forwarded to ``settings.upstream``.

    ``client`` lets a caller share or mock the upstream connection pool; by default one is made
    for the app's lifetime.
    """
    state: dict[str, Any] = {}

    def upstream_client() -> httpx.AsyncClient:
        if "client" not in state:
            # TCP_NODELAY: requests and small answers go out at once instead of waiting on Nagle.
            transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            state["client"] = client or httpx.AsyncClient(
                base_url=settings.upstream, transport=transport,
                timeout=httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=60.0, pool=None))
        return state["client"]

    async def forward(request: Request) -> Response:
        if request.headers.get("expect", "").lower() == "100-continue":
            # The client waits for "100 Continue" before sending: refuse by the announced size
            # alone and it never sends the body.
            declared = request.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
                return _too_large(settings, int(declared), announced=True)
        try:
            body = await read_capped_body(request, settings.max_body_bytes)
        except BodyTooLarge as exc:
            announced = request.headers.get("content-length") is not None
            logger.warning("refused a %s-byte HTTP body from %s (limit %d)", exc.seen if announced else ">limit",
                           request.client.host if request.client else "?", settings.max_body_bytes)
            await _drain(request)
            return _too_large(settings, exc.seen, announced)
        except ValueError as exc:
            return _error(400, str(exc))
        except ClientDisconnect:
            return Response(status_code=400)
        url = httpx.URL(path=request.url.path, query=request.url.query.encode())
        up_req = upstream_client().build_request(request.method, url, headers=forward_headers(request.headers.items()),
                                                 content=body)
        try:
            up = await upstream_client().send(up_req, stream=True)
        except httpx.HTTPError as exc:
            now = time.monotonic()
            if now - state.get("unreachable_logged", -1e9) > UNREACHABLE_LOG_INTERVAL_S:   # not once per poll
                state["unreachable_logged"] = now
                logger.warning("tritonserver at %s unreachable: %s", settings.upstream, exc)
            return _error(502, f"the inference server behind this front is unreachable ({type(exc).__name__})")
        headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP}
        length = up.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) <= BUFFERED_RESPONSE_BYTES:
            # A small answer of known size (health, metadata, errors, /generate): pass it on whole,
            # with its Content-Length, instead of re-chunking it.
            try:
                content = await up.aread()
            except httpx.HTTPError as exc:
                return _error(502, f"the inference server's answer broke off ({type(exc).__name__})")
            finally:
                await up.aclose()
            return Response(content, status_code=up.status_code, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            # Raw chunks as they arrive: generate_stream events reach the client one by one.
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                logger.warning("upstream stream ended early: %s", exc)
            finally:
                await up.aclose()

        return StreamingResponse(relay(), status_code=up.status_code, headers=headers)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        if "client" in state and client is None:
            await state["client"].aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    routes = [Route("/v2", forward, methods=methods), Route("/v2/{path:path}", forward, methods=methods)]
    return Starlette(routes=routes, lifespan=lifespan)


# ---------------------------------------------------------------------------------------------
# Process entry point (what glm5 serve runs)
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m glm5.serving.http_front", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--upstream", required=True, help="tritonserver HTTP base URL, e.g. http://127.0.0.1:8010")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body forwarded (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = FrontSettings(upstream=args.upstream, max_body_bytes=args.max_body_bytes)
    except ValueError as exc:
        print(f"http_front: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(make_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

