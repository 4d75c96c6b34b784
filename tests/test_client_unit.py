"""Unit tests of the client library's request building and response folding (no server)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from glm5_client import GenerateRequest, GenerationChunk, Glm5ClientError, collect
from glm5_client.client import chunk_from_json


def test_tensors_carry_raw_media_and_json_sampling():
    req = GenerateRequest(prompt="hi", images=[b"\x89PNG..."], videos=[b"\x00\x00\x00\x18ftyp"],
                          sampling={"max_tokens": 3}, stream=True, exclude_input_in_output=True,
                          messages=[{"role": "user", "content": "hi"}])
    t = {name: (arr, dtype) for name, arr, dtype in req.tensors()}
    assert t["text_input"][0].tolist() == [b"hi"] and t["text_input"][1] == "BYTES"
    assert t["image"][0].tolist() == [b"\x89PNG..."]
    assert t["video"][0].dtype == np.object_
    assert json.loads(t["sampling_parameters"][0][0]) == {"max_tokens": 3}
    assert t["stream"][0].tolist() == [True] and t["stream"][1] == "BOOL"
    assert t["exclude_input_in_output"][0].tolist() == [True]
    assert "stop" not in t and "return_logprobs" not in t


def test_http_body_base64_encodes_media():
    body = GenerateRequest(prompt="hi", images=[b"\x89PNG\x00"], stream=False).http_body()
    assert base64.b64decode(body["image"][0]) == b"\x89PNG\x00"
    assert body["stream"] is False and body["text_input"] == "hi"


def test_collect_sums_tokens_and_measures_ttft():
    chunks = [GenerationChunk("a", False, None, 1, 5, received_at=1.5),
              GenerationChunk("b", False, None, 2, None, received_at=2.0),
              GenerationChunk("", True, "length", 0, None, received_at=2.1)]
    res = collect(chunks, started_at=1.0)
    assert res.text == "ab" and res.num_output_tokens == 3 and res.num_input_tokens == 5
    assert res.finish_reason == "length"
    assert res.ttft_s == pytest.approx(0.5) and res.latency_s == pytest.approx(1.1)
    assert res.inter_token_latencies_s == pytest.approx([0.25, 0.25])
    assert res.tokens_per_s == pytest.approx(3 / 1.1)


def test_chunk_from_sse_event_and_error_event():
    ch = chunk_from_json({"text_output": "x", "finish_reason": "stop", "num_output_tokens": [2],
                          "logprobs": json.dumps([{"token_id": 1, "logprob": -0.1}])}, final=True)
    assert (ch.text, ch.finish_reason, ch.num_output_tokens, ch.final) == ("x", "stop", 2, True)
    assert ch.logprobs == [{"token_id": 1, "logprob": -0.1}]
    with pytest.raises(Glm5ClientError, match="boom"):
        chunk_from_json({"error": "boom"}, final=False)


def test_stop_key_travels_on_requests_and_stop_requests():
    t = {name: arr for name, arr, _ in GenerateRequest(prompt="hi", stop_key="k" * 20).tensors()}
    assert t["stop_key"].tolist() == [b"k" * 20]
    assert "stop_key" not in {name for name, _, _ in GenerateRequest(prompt="hi").tensors()}
    assert GenerateRequest(prompt="", stop=True, stop_key="k" * 20).http_body()["stop_key"] == "k" * 20


def test_cli_stop_requires_the_key_and_generate_prints_one(capsys, monkeypatch):
    from glm5_client import cli

    with pytest.raises(SystemExit):
        cli._stop_parser().parse_args(["job-1"])               # --stop-key is required
    assert cli._stop_parser().parse_args(["job-1", "--stop-key", "s" * 16]).stop_key == "s" * 16
    seen = {}

    class FakeClient:
        def __init__(self, *a, **k):
            pass

        def generate_stream(self, prompt, **kwargs):
            seen.update(kwargs)
            return iter([GenerationChunk("x", True, "length", 1, 1)])

        def close(self):
            pass

    monkeypatch.setattr(cli, "Glm5Client", FakeClient)
    assert cli.main(["--request-id", "job-1", "hello"]) == 0
    key = seen["stop_key"]
    assert len(key) == 32 and f"glm5-client stop job-1 --stop-key {key}" in capsys.readouterr().err
