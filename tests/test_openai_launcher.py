"""`glm5 serve --openai-port`: the OpenAI server starts once Triton is ready, answers, and stops with it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai

from glm5.serving.launcher import find_free_port
from serve_process import read_endpoints


def test_glm5_serve_with_openai_port_serves_v1_and_stops(tiny_checkpoint_dir: Path, tmp_path: Path):
    ports = [find_free_port() for _ in range(4)]
    cmd = [sys.executable, "-m", "glm5.cli", "serve", "--model", str(tiny_checkpoint_dir), "--text-only",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--cache-memory-gb", "0.05", "--max-num-seqs", "4",
           "--max-model-len", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = read_endpoints(proc)
        assert info["openai"] == f"http://127.0.0.1:{ports[3]}/v1"
        client = openai.OpenAI(base_url=info["openai"], api_key="unused", max_retries=0)
        assert client.models.list().data[0].max_model_len == 256       # read from the Triton model's config
        r = client.chat.completions.create(model="glm5", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        try:
            client.models.list()
            raise AssertionError("the OpenAI server outlived glm5 serve")
        except openai.APIConnectionError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
