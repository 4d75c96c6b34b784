"""Unit tests of the backend's request parsing (glm5.serving.request) and repository preparation
(glm5.serving.launcher), without a server."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from glm5.serving import launcher
from glm5.serving.request import (DuplicateRequestIdError, LiveRequests, RequestError, check_finite_numbers,
                                  check_stop_key, decode_media_item, output_flags, parse_json_object, parse_messages,
                                  request_parameters)


def test_media_raw_bytes_pass_through_and_base64_is_decoded():
    jpeg = b"\xff\xd8\xff\xe0" + os.urandom(64)
    assert decode_media_item(jpeg, name="image", index=0) == jpeg
    assert decode_media_item(base64.b64encode(jpeg).decode(), name="image", index=0) == jpeg
    assert decode_media_item(base64.urlsafe_b64encode(jpeg), name="image", index=0) == jpeg
    wrapped = b"\n".join(base64.encodebytes(jpeg).splitlines())
    assert decode_media_item(wrapped, name="image", index=0) == jpeg


def test_media_errors_name_the_item():
    with pytest.raises(RequestError, match=r"video\[2\] is empty"):
        decode_media_item(b"", name="video", index=2)
    with pytest.raises(RequestError, match=r"image\[0\] is a data URL"):
        decode_media_item(b"data:image/png,abc", name="image", index=0)


def test_json_object_inputs():
    assert parse_json_object(None, name="sampling_parameters") == {}
    assert parse_json_object(b'{"max_tokens": "4"}', name="sampling_parameters") == {"max_tokens": "4"}
    with pytest.raises(RequestError, match="sampling_parameters is not valid JSON"):
        parse_json_object("{max_tokens: 4}", name="sampling_parameters")
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_json_object("[1, 2]", name="sampling_parameters")


def test_request_parameters_drop_reserved_and_triton_keys():
    params = json.dumps({"max_tokens": 5, "priority": 1, "triton_enable_empty_final_response": True, "top_p": 0.5,
                         "id": "req-7"})
    assert request_parameters(params) == {"max_tokens": 5, "top_p": 0.5}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "NaN", "-inf"])
def test_non_finite_numbers_rejected(value):
    with pytest.raises(RequestError, match="temperature.*not a finite number"):
        check_finite_numbers({"temperature": value})


def test_finite_numbers_and_strings_accepted():
    check_finite_numbers({"temperature": 0.5, "stop": "end", "max_tokens": "8"})


def test_messages_validation():
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    assert parse_messages(json.dumps(msgs)) == msgs
    assert parse_messages(None) is None
    with pytest.raises(RequestError, match=r"messages\[0\] must be an object with 'role' and 'content'"):
        parse_messages('[{"role": "user"}]')
    with pytest.raises(RequestError, match=r"content\[0\] must be a part of type text, image or video"):
        parse_messages('[{"role": "user", "content": [{"type": "audio"}]}]')


def test_output_flags_follow_vllm_conventions():
    assert output_flags(None, None).prepend_input is True            # non-streaming: prompt prepended
    assert output_flags(True, None).prepend_input is False
    assert output_flags(False, True).prepend_input is False
    with pytest.raises(RequestError, match="exclude_input_in_output=false is not supported with stream=true"):
        output_flags(True, False)
    assert output_flags(True, None, return_logprobs=True).return_logprobs is True


def test_live_requests_one_per_id_and_stops_need_the_key():
    live = LiveRequests()
    key = "k" * 16
    live.register("job", "job-a", key)
    with pytest.raises(DuplicateRequestIdError, match="'job' belongs to a request that is still running"):
        live.register("job", "job-b", key)          # one id names at most one running request
    live.register("", "anon-1", None)               # requests without an id are not registered
    live.register("", "anon-2", None)
    assert live.authorize_stop("job", key) == "job-a"
    assert live.authorize_stop("job", "x" * 16) is None          # wrong key
    assert live.authorize_stop("other", key) is None             # unknown id
    live.register("nokey", "nokey-a", None)
    assert live.authorize_stop("nokey", key) is None             # a request without a key cannot be stopped
    live.release("job", "job-zzz")                  # a stale release of another engine id keeps the entry
    assert live.authorize_stop("job", key) == "job-a"
    live.release("job", "job-a")
    assert live.authorize_stop("job", key) is None
    live.register("job", "job-c", key)              # the id is free again once its request ended
    assert set(live.active) == {"job", "nokey"}


def test_stop_key_length_is_checked():
    assert check_stop_key(None) is None and check_stop_key("") is None
    assert check_stop_key("a" * 32) == "a" * 32
    with pytest.raises(RequestError, match="stop_key has 5 characters; use 16 to 256"):
        check_stop_key("short")
    with pytest.raises(RequestError, match="stop_key has 300"):
        check_stop_key("a" * 300)


def test_backend_directory_layout(tmp_path: Path):
    inst = launcher.locate_tritonserver("pytriton")
    d = launcher.assemble_backend_dir(inst, tmp_path / "backends")
    for f in ("python/libtriton_python.so", "python/triton_python_backend_utils.py",
              "python/triton_python_backend_stub", "glm5/model.py"):
        p = d / f
        assert p.is_file() and not p.is_symlink(), f   # tritonserver rejects libraries outside the dir
    assert (d / "glm5" / "model.py").read_text() == launcher.backend_model_py().read_text()


def test_free_ports_are_distinct_and_bindable():
    ports = {launcher.find_free_port() for _ in range(3)}
    assert all(1024 < p < 65536 for p in ports)
