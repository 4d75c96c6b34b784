"""The HTTP front as an ASGI app in front of a stand-in upstream (no tritonserver): what is forwarded,
what is refused, and that streamed responses are relayed as they are produced."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from glm5.serving.http_front import FrontSettings, forward_headers, make_app
from glm5.serving.server_process import find_free_port

seen: list[dict] = []


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    record = {"method": request.method, "path": request.url.path, "query": request.url.query,
              "headers": dict(request.headers), "size": len(body)}
    seen.append(record)
    return JSONResponse(record, headers={"x-upstream": "yes"}, status_code=201)


async def slow_stream(request: Request) -> StreamingResponse:
    async def events():
        for i in range(3):
            yield f"data: {json.dumps({'i': i, 't': time.monotonic()})}\n\n".encode()
            await asyncio.sleep(0.3)
    return StreamingResponse(events(), media_type="text/event-stream")


UPSTREAM = Starlette(routes=[Route("/v2/models/m/generate_stream", slow_stream, methods=["POST"]),
                             Route("/v2", echo), Route("/v2/{path:path}", echo, methods=["GET", "POST", "DELETE"])])


def front(limit: int = 1000, upstream_app: Starlette = UPSTREAM) -> httpx.AsyncClient:
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=upstream_app), base_url="http://upstream")
    app = make_app(FrontSettings(upstream="http://upstream", max_body_bytes=limit), client=upstream)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front")


def run(coro):
    return asyncio.run(coro)


def test_requests_are_forwarded_with_method_path_query_headers_and_body():
    async def go():
        async with front() as c:
            r = await c.post("/v2/models/m/infer?x=1&y=2", content=b"a" * 1000,
                             headers={"glm5-admin-key": "k" * 20, "Content-Type": "application/json"})
            return r
    seen.clear()
    r = run(go())
    assert r.status_code == 201 and r.headers["x-upstream"] == "yes"
    rec = r.json()
    assert rec == seen[-1]
    assert (rec["method"], rec["path"], rec["query"], rec["size"]) == ("POST", "/v2/models/m/infer", "x=1&y=2", 1000)
    assert rec["headers"]["glm5-admin-key"] == "k" * 20 and rec["headers"]["content-type"] == "application/json"


def test_body_over_the_limit_is_refused_by_content_length_and_never_forwarded():
    async def go():
        async with front(limit=1000) as c:
            return await c.post("/v2/models/m/infer", content=b"a" * 1001)
    seen.clear()
    r = run(go())
    assert r.status_code == 413 and "1001 bytes" in r.json()["error"] and "gRPC" in r.json()["error"]
    assert seen == []


def test_streamed_body_over_the_limit_is_counted_and_refused():
    async def chunks():
        for _ in range(20):
            yield b"b" * 100

    async def go():
        async with front(limit=1000) as c:
            return await c.post("/v2/models/m/infer", content=chunks())   # no Content-Length: chunked
    seen.clear()
    r = run(go())
    assert r.status_code == 413 and "more than 1000 bytes" in r.json()["error"]
    assert seen == []


def test_form_content_type_and_hop_by_hop_headers_are_not_forwarded():
    assert forward_headers([("Content-Type", "application/x-www-form-urlencoded; charset=utf-8"),
                            ("Connection", "keep-alive"), ("Host", "front"), ("Content-Length", "3"),
                            ("Transfer-Encoding", "chunked"), ("Accept", "*/*")]) == [("Accept", "*/*")]

    async def go():
        async with front() as c:
            return await c.post("/v2/x", content=b"a=b", headers={"Content-Type": "application/x-www-form-urlencoded"})
    rec = run(go()).json()
    assert "content-type" not in rec["headers"] and rec["size"] == 3


@contextlib.contextmanager
def serving(app: Starlette) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread (httpx's ASGI transport buffers
    whole responses, so streaming needs real sockets)."""
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_streaming_responses_are_relayed_as_they_are_produced():
    with serving(UPSTREAM) as upstream, serving(make_app(FrontSettings(upstream=upstream))) as url:
        arrivals = []
        with httpx.stream("POST", f"{url}/v2/models/m/generate_stream", content=b"{}", timeout=10) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic(), json.loads(line[6:])))
    assert [e["i"] for _, e in arrivals] == [0, 1, 2]
    # each event reached the client right after the upstream produced it, not at the end
    for received, event in arrivals:
        assert received - event["t"] < 0.2
    assert arrivals[2][0] - arrivals[0][0] > 0.5


def test_unreachable_upstream_is_a_502_with_a_reason():
    async def go():
        app = make_app(FrontSettings(upstream="http://127.0.0.1:9", max_body_bytes=10, connect_timeout_s=1))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as c:
            return await c.get("/v2/health/ready")
    r = run(go())
    assert r.status_code == 502 and "unreachable" in r.json()["error"]


def test_only_v2_is_served():
    async def go():
        async with front() as c:
            return (await c.get("/metrics")).status_code, (await c.get("/v2")).status_code
    assert run(go()) == (404, 201)


@pytest.mark.parametrize("bad", [{"upstream": "127.0.0.1:8000"}, {"upstream": "http://x", "max_body_bytes": 0}])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError):
        FrontSettings(**bad)
