"""Prefix caching through a real tritonserver (2.51, nvidia-pytriton) on the tiny checkpoint: the
per-request ``num_cached_tokens`` output (asked for with ``return_num_cached_tokens``, on the glm5 model
and through the multimodal ensemble) and the ``glm5:prefix_cache_queries_total`` /
``glm5:prefix_cache_hits_total`` metrics moving."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from glm5.serving.launcher import TritonServerProcess

ENGINE_SETTINGS = {"cache_memory_gb": "0.05", "max_num_seqs": "8", "max_model_len": "1024", "block_size": "16",
                   "prefix_cache_snapshot_memory_gb": "0.01"}
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite the document when you can, "
          "and say so when the document does not contain the answer. Document: the river rises in the "
          "northern hills, runs south through three towns and reaches the sea at a wide delta. ")
QUESTIONS = ["Where does the river rise?", "How many towns does it pass?", "Which way does it run?",
             "What is at its mouth?"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("triton_prefix") / "server.log"
    with TritonServerProcess(model_dir=str(tiny_checkpoint_dir), log_file=log,
                             engine_overrides=ENGINE_SETTINGS, ready_timeout_s=240) as srv:
        yield srv


def metric(srv: TritonServerProcess, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', srv.metrics_text(), re.M)
    assert m is not None, f"metric {name} not exported"
    return float(m.group(1))


def generate(srv: TritonServerProcess, text: str, model: str = "glm5", **flags) -> dict:
    body = json.dumps({"text_input": text, "parameters": GREEDY, **flags}).encode()
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (loopback test server)
        return json.loads(r.read())


def scalar(v) -> int:
    return int(v[0] if isinstance(v, list) else v)


def test_shared_system_prompt_hits_and_metrics_move(server, tiny_checkpoint_dir):
    from glm5.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_checkpoint_dir)
    ids = [tok.encode(SYSTEM + q, add_special_tokens=False) for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(x, ids[0])) if a != b) for x in ids[1:])
    assert shared > 32, "the questions must share a long tokenized prefix"
    q0, h0 = metric(server, "glm5:prefix_cache_queries_total"), metric(server, "glm5:prefix_cache_hits_total")
    outs = [generate(server, SYSTEM + q, return_num_cached_tokens=True, return_num_input_tokens=True,
                     exclude_input_in_output=True) for q in QUESTIONS]
    cached = [scalar(o["num_cached_tokens"]) for o in outs]
    assert cached[0] == cached[1] == 0, cached
    assert all(c >= 0.9 * shared for c in cached[2:]), f"{cached} of {shared} shared tokens"
    assert [scalar(o["num_input_tokens"]) for o in outs] == [len(x) for x in ids]
    assert "num_cached_tokens" not in generate(server, "no flag, no output")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:   # the metrics thread copies engine stats every 200 ms
        q, h = metric(server, "glm5:prefix_cache_queries_total"), metric(server, "glm5:prefix_cache_hits_total")
        if h - h0 >= sum(cached) and q - q0 >= sum(len(x) for x in ids):
            break
        time.sleep(0.2)
    assert q - q0 >= sum(len(x) for x in ids), (q0, q)
    assert h - h0 == sum(cached), (h0, h, cached)


def test_ensemble_returns_num_cached_tokens(server):
    """The ensemble forwards the flag and the output; its glm5 step shares the engine (and its cache)."""
    outs = [generate(server, SYSTEM + q, model="glm5_multimodal", return_num_cached_tokens=True)
            for q in ("Is there a bridge?", "Is there a ferry?", "Is there a dam?")]
    assert scalar(outs[2]["num_cached_tokens"]) > 32, outs
