"""`glm5 serve` as a user runs it: starts tritonserver on the requested loopback ports, prints
the endpoints (and the engine's backends and cache, and where the admin key is) once ready,
serves, keeps the admin APIs locked, and SIGTERM stops the server and every stub process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from glm5.serving.launcher import find_free_port
from serve_process import read_endpoints
from glm5_client import Glm5Client


def test_glm5_serve_starts_serves_and_stops_on_sigterm(tiny_checkpoint_dir: Path, tmp_path: Path):
    ports = [find_free_port() for _ in range(3)]
    cmd = [sys.executable, "-m", "glm5.cli", "serve", "--model", str(tiny_checkpoint_dir), "--text-only",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--cache-memory-gb", "0.05", "--max-num-seqs", "4", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # (tritonserver's own output shares stdout; the endpoints line is the one JSON line)
    try:
        info = read_endpoints(proc)
        assert info["grpc"] == f"127.0.0.1:{ports[1]}" and info["http"] == f"http://127.0.0.1:{ports[0]}"
        assert info["metrics"] == f"http://127.0.0.1:{ports[2]}/metrics"
        # The runtime repository has the checkpoint path filled in.
        cfg = (tmp_path / "work" / "model_repository" / "glm5" / "config.pbtxt").read_text()
        assert f'string_value: "{tiny_checkpoint_dir.resolve()}"' in cfg
        # The engine's choices are reported, and the generated admin key is where the line says.
        assert any(e.startswith("backends on cpu") for e in info["engine"]), info["engine"]
        assert any(e.startswith("hybrid cache:") for e in info["engine"]), info["engine"]
        key_file = Path(info["admin_key_file"])
        assert key_file == tmp_path / "work" / "admin_key" and key_file.stat().st_mode & 0o077 == 0
        key = key_file.read_text().strip()
        assert info["admin_key_fingerprint"] and key not in json.dumps(info)
        cfg_url = f"{info['http']}/v2/models/glm5/config"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(cfg_url, timeout=30)  # noqa: S310 (loopback)
        assert refused.value.code == 403
        req = urllib.request.Request(cfg_url, headers={"glm5-admin-key": key})
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310
            assert json.loads(r.read())["name"] == "glm5"
        with Glm5Client(info["grpc"]) as c:
            assert c.generate("hi", sampling={"max_tokens": 3, "ignore_eos": True}).num_output_tokens == 3
        server_pid = info["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        # tritonserver and its stub processes (one process group) are gone.
        time.sleep(0.5)
        try:
            os.killpg(server_pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, "tritonserver or a stub outlived glm5 serve"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
