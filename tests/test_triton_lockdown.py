"""Locked-down serving through a real tritonserver (text-only, as ``glm5 serve --text-only`` runs it):

* administrative APIs (model repository, model config, logging, shared memory, statistics, trace)
  are refused without the admin key on HTTP and gRPC and work with it; inference, health and
  metadata stay open;
* ``--text-only`` serves a one-model runtime repository with model control off, so a model
  upload through the repository API is refused even with the key (it used to run the upload);
* the HTTP front answers 4 MiB and 64 MiB bodies with 413, never forwards a form-urlencoded
  content type (the 2.51 crash), streams ``generate_stream`` through, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from glm5.serving.access import ADMIN_HEADER
from glm5.serving.installation import LauncherError
from glm5.serving.server_process import TritonServerProcess, find_free_port
from glm5_client import Glm5Client

MiB = 1024 * 1024
SAMPLING = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("triton_hardening") / "server.log"
    with TritonServerProcess(model_dir=str(tiny_checkpoint_dir), models=("glm5",), log_file=log,
                             engine_overrides={"cache_memory_gb": "0.05", "max_num_seqs": "4"},
                             ready_timeout_s=240) as srv:
        yield srv


def http(srv: TritonServerProcess, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, url: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{url or srv.http_url}{path}", data=body, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (loopback test server)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_live(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if http(None, "GET", "/v2/health/live", url=url)[0] == 200:  # type: ignore[arg-type]
                return
        except urllib.error.URLError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, f"{url} never came up"
        time.sleep(0.1)


def still_serves(srv: TritonServerProcess) -> None:
    assert srv.proc is not None and srv.proc.poll() is None, "tritonserver died"
    with Glm5Client(srv.grpc_url) as c:
        assert c.generate("still there?", sampling=SAMPLING).num_output_tokens == 4
    assert http(srv, "GET", "/v2/health/ready")[0] == 200


# ------------------------------------------------------------------------------------------ access

RESTRICTED_HTTP = [("POST", "/v2/repository/index", b"{}"), ("GET", "/v2/models/glm5/config", None),
                   ("GET", "/v2/logging", None), ("GET", "/v2/systemsharedmemory/status", None),
                   ("GET", "/v2/models/stats", None), ("GET", "/v2/trace/setting", None)]


@pytest.mark.parametrize("method,path,body", RESTRICTED_HTTP)
def test_admin_http_apis_need_the_key(server, method, path, body):
    status, text = http(server, method, path, body)
    assert status == 403 and ADMIN_HEADER.encode() in text
    status, _ = http(server, method, path, body, headers={ADMIN_HEADER: "wrong-key-0123456789"})
    assert status == 403
    status, _ = http(server, method, path, body, headers=server.admin_key.http_headers())
    assert status == 200


def test_inference_health_and_metadata_stay_open(server):
    assert http(server, "GET", "/v2/health/live")[0] == 200
    assert http(server, "GET", "/v2")[0] == 200
    status, meta = http(server, "GET", "/v2/models/glm5")
    assert status == 200 and json.loads(meta)["name"] == "glm5"
    body = json.dumps({"text_input": "hi", "parameters": SAMPLING}).encode()
    status, out = http(server, "POST", "/v2/models/glm5/generate", body)
    assert status == 200 and "text_output" in json.loads(out)


def test_admin_grpc_apis_need_the_key(server):
    calls = {"model config": lambda c, h: c.get_model_config("glm5", headers=h),
             "repository index": lambda c, h: c.get_model_repository_index(headers=h),
             "log settings": lambda c, h: c.get_log_settings(headers=h),
             "shared memory": lambda c, h: c.get_system_shared_memory_status(headers=h),
             "statistics": lambda c, h: c.get_inference_statistics(headers=h),
             "trace": lambda c, h: c.get_trace_settings(headers=h)}
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for call in calls.values():
            with pytest.raises(InferenceServerException, match="restricted"):
                call(c, None)
            call(c, server.admin_key.grpc_headers())        # no exception with the key
        assert c.is_model_ready("glm5") and c.get_model_metadata("glm5").name == "glm5"
    still_serves(server)


def test_text_only_serves_one_model_with_model_control_off(server, tmp_path: Path):
    """The upload that used to run as root under --text-only: refused without and with the key."""
    argv = server.proc.args                               # the running server's command line
    assert "--model-control-mode=none" in argv and not any(a.startswith("--load-model") for a in argv)
    status, index = http(server, "POST", "/v2/repository/index", b"{}", headers=server.admin_key.http_headers())
    assert [m["name"] for m in json.loads(index)] == ["glm5"]
    marker = tmp_path / "uploaded-code-ran"
    model_py = (f"open({str(marker)!r}, 'w').write('ran')\n"
                "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
    upload = json.dumps({"parameters": {
        "config": json.dumps({"backend": "python", "max_batch_size": 0,
                              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]}),
        "file:1/model.py": base64.b64encode(model_py.encode()).decode()}}).encode()
    status, text = http(server, "POST", "/v2/repository/models/evil/load", upload)
    assert status == 403
    status, text = http(server, "POST", "/v2/repository/models/evil/load", upload,
                        headers=server.admin_key.http_headers())
    assert status >= 400 and b"not allowed" in text
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        with pytest.raises(InferenceServerException):
            c.load_model("evil", headers=server.admin_key.grpc_headers(), config="{}",
                         files={"file:1/model.py": model_py.encode()})
    time.sleep(1.0)
    assert not marker.exists()
    assert http(server, "GET", "/v2/models/evil/ready")[0] != 200
    still_serves(server)


def test_locked_down_defaults_in_the_command_line(tmp_path: Path):
    """--host 0.0.0.0 opens gRPC and the front only: metrics and tritonserver's HTTP stay on loopback."""
    srv = TritonServerProcess(model_dir="/ckpt", host="0.0.0.0", work_dir=tmp_path, models=("glm5",))
    argv, _ = srv.command()
    assert "--metrics-address=127.0.0.1" in argv and "--http-address=127.0.0.1" in argv
    assert "--grpc-address=0.0.0.0" in argv and f"--http-port={srv.triton_http_port}" in argv
    assert "--model-control-mode=none" in argv
    restricted = [a for a in argv if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2 and all("model-repository" in a and "logging" in a for a in restricted)
    key_file = tmp_path / "admin_key"
    assert key_file.read_text().strip() == srv.admin_key.value and (key_file.stat().st_mode & 0o077) == 0
    front = srv.front_command()
    assert front[front.index("--host") + 1] == "0.0.0.0" and front[front.index("--port") + 1] == str(srv.http_port)
    assert srv.admin_key.value not in srv._redacted(argv)


def test_malloc_settings_in_the_server_environment(tmp_path: Path, monkeypatch):
    """glibc malloc keeps two arenas and a fixed 1 MiB mmap threshold in tritonserver and its stubs (the soak's
    RSS drift), unless the user set them."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    _, env = TritonServerProcess(model_dir="/ckpt", work_dir=tmp_path / "a", models=("glm5",)).command()
    assert env["MALLOC_ARENA_MAX"] == "2" and env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    _, env = TritonServerProcess(model_dir="/ckpt", work_dir=tmp_path / "b", models=("glm5",)).command()
    assert env["MALLOC_ARENA_MAX"] == "8"


def test_explicit_model_control_only_when_asked_and_only_behind_the_key(tmp_path: Path):
    srv = TritonServerProcess(model_dir="/ckpt", work_dir=tmp_path / "a", models=("glm5",), model_control="explicit")
    argv, _ = srv.command()
    assert "--model-control-mode=explicit" in argv and "--load-model=glm5" in argv
    open_repo = TritonServerProcess(model_dir="/ckpt", work_dir=tmp_path / "b", model_control="explicit",
                                    restricted_apis=("logging",))
    with pytest.raises(LauncherError, match="upload a model"):
        open_repo.command()
    with pytest.raises(LauncherError, match="model_control"):
        TritonServerProcess(model_dir="/ckpt", work_dir=tmp_path / "c", model_control="poll").command()


# ------------------------------------------------------------------------------------------ front

@pytest.mark.parametrize("size", [4 * MiB, 64 * MiB])
def test_oversized_http_bodies_get_413_and_the_server_keeps_serving(server, size):
    body = b"x" * size
    for path in ("/v2/models/doesnotexist/infer", "/v2/models/glm5/generate"):
        status, text = http(server, "POST", path, body,
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 413, text[:200]
        assert "exceeds" in json.loads(text)["error"]
    still_serves(server)


def test_oversized_chunked_body_is_counted_and_refused(server):
    host, port = server.http_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v2/models/glm5/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Type: application/json\r\nConnection: close\r\n\r\n")
        chunk = b"y" * 65536
        for _ in range(80):                      # 5 MiB in 64 KiB chunks, no Content-Length
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        s.sendall(b"0\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            part = s.recv(4096)
            if not part:
                break
            reply += part
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    still_serves(server)


def test_form_bodies_never_reach_tritonserver_even_under_a_raised_cap(server, tmp_path: Path):
    """8 MB form-urlencoded would kill 2.51 (see test below); through a front allowing 16 MiB it is harmless."""
    port = find_free_port()
    front = subprocess.Popen([sys.executable, "-m", "glm5.serving.http_front", "--port", str(port),
                              "--upstream", f"http://{server.triton_http_url}", "--max-body-bytes", str(16 * MiB)])
    try:
        url = f"127.0.0.1:{port}"
        wait_live(url, front)
        status, text = http(server, "POST", "/v2/models/doesnotexist/infer", b"x" * 8_000_000, url=url,
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 404 and b"unknown model" in text          # Triton answered, nothing crashed
    finally:
        front.terminate()
        front.wait(10)
    still_serves(server)


def test_generate_stream_is_relayed_event_by_event(server):
    body = json.dumps({"text_input": "Count", "stream": True, "exclude_input_in_output": True,
                       "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/glm5/generate_stream", data=body,
                                 method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in r if line.startswith(b"data: ")]
    assert len(events) >= 6 and all("text_output" in e for e in events)
    # The same request straight to tritonserver's private port gives the same events.
    direct = urllib.request.Request(f"http://{server.triton_http_url}/v2/models/glm5/generate_stream", data=body,
                                    method="POST")
    with urllib.request.urlopen(direct, timeout=120) as r:  # noqa: S310
        assert [json.loads(line[6:]) for line in r if line.startswith(b"data: ")] == events


def test_errors_pass_through_unchanged(server):
    status, text = http(server, "POST", "/v2/models/glm5/generate", b'{"text_input": "x", "parameters": '
                        b'{"max_tokens": -1}}')
    assert status == 400 and "max_tokens" in json.loads(text)["error"]
    assert http(server, "GET", "/v2/models/nosuchmodel")[0] in (400, 404)


def test_tritonserver_251_dies_on_a_large_form_body_sent_directly(tmp_path: Path):
    """Why the front exists: one 4,194,303-byte form-urlencoded POST, any path, kills 2.51 (SIGSEGV in
    libevhtp's evhtp_parse_query_wflags: two body-sized arrays on an 8 MiB thread stack)."""
    import resource

    from glm5.serving.installation import locate_tritonserver

    inst = locate_tritonserver("pytriton")
    (tmp_path / "repo").mkdir()
    port = find_free_port()
    env = {"LD_LIBRARY_PATH": str(inst.lib_dir), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([str(inst.binary), f"--model-repository={tmp_path / 'repo'}", "--http-address=127.0.0.1",
                             f"--http-port={port}", "--allow-grpc=false", "--allow-metrics=false",
                             f"--backend-directory={tmp_path}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    try:
        url = f"127.0.0.1:{port}"
        wait_live(url, proc)
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        assert http(None, "POST", "/v2/models/x/infer", b"x" * 4_000_000, headers=form, url=url)[0] == 404  # type: ignore[arg-type]
        try:
            http(None, "POST", "/v2/models/x/infer", b"x" * 4_194_303, headers=form, url=url)  # type: ignore[arg-type]
        except (ConnectionError, urllib.error.URLError):
            pass
        assert proc.wait(30) == -11
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ soak tool

def test_soak_tool_short_run_with_hostile_mix_and_cancellations(server):
    """``glm5-client soak`` against the live server: good streams, cancellations, refused hostile requests,
    RSS sampled through the server's pid, cache back to 0."""
    from glm5_client.soak import build_parser, run_soak

    args = build_parser().parse_args(["--url", server.grpc_url, "--http-url", server.http_url,
                                      "--metrics-url", server.metrics_url, "--pid", str(server.proc.pid),
                                      "--streams", "4", "--minutes", "0.25", "--max-tokens", "8",
                                      "--cancel-fraction", "0.3", "--hostile", "--hostile-interval", "2",
                                      "--warmup-seconds", "2", "--sample-interval", "1"])
    args.hostile_kinds = ["bad_params", "bad_media", "oversized_http"]
    result = asyncio.run(run_soak(args))
    s = result.summary()
    assert s["good_requests"] >= 4 and s["failed_good_requests"] == 0, s["failure_messages"]
    assert s["cancelled_requests"] >= 1 and s["ttft_s"]["n"] >= 4 and s["inter_token_gap_s"]["p50"] > 0
    assert sum(k["sent"] for k in s["hostile"].values()) >= 3 and not s["hostile_mishandled"]
    assert s["hostile"]["oversized_http"]["handled"] == s["hostile"]["oversized_http"]["sent"] >= 1
    assert s["rss_baseline_mb"] > 100 and s["rss_final_mb"] > 100        # tritonserver + the engine's stub
    assert s["cache_usage_after"] == 0.0
    verdict = result.verdict()
    assert verdict["no_failed_good_requests"] and verdict["cache_empty_after"]
    still_serves(server)
