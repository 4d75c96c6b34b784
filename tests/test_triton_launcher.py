"""`glm5 serve` as a user runs it: starts tritonserver on the requested loopback ports, prints
the endpoints once ready, serves, and SIGTERM stops the server and every stub process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from glm5.serving.launcher import find_free_port
from glm5_client import Glm5Client


def test_glm5_serve_starts_serves_and_stops_on_sigterm(tiny_checkpoint_dir: Path, tmp_path: Path):
    ports = [find_free_port() for _ in range(3)]
    cmd = [sys.executable, "-m", "glm5.cli", "serve", "--model", str(tiny_checkpoint_dir), "--text-only",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--cache-memory-gb", "0.05", "--max-num-seqs", "4", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and info is None:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                info = json.loads(line)
        assert info is not None, f"glm5 serve exited ({proc.poll()}) without printing its endpoints"
        assert info["grpc"] == f"127.0.0.1:{ports[1]}" and info["http"] == f"http://127.0.0.1:{ports[0]}"
        # The runtime repository has the checkpoint path filled in.
        cfg = (tmp_path / "work" / "model_repository" / "glm5" / "config.pbtxt").read_text()
        assert f'string_value: "{tiny_checkpoint_dir.resolve()}"' in cfg
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
