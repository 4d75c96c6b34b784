"""vllm_backend drop-in, end to end through tritonserver on the tiny checkpoint: vllm_backend's
full input set, Triton's OpenAI-frontend default payload, its output layout (one element per
sequence, ``finish_reason`` "None" until the end, vLLM-shaped logprobs, cumulative logprob),
``n`` / ``best_of``, and the ``vllm:`` metric families after traffic."""

from __future__ import annotations

import json
import math
import queue
import re
import time
from pathlib import Path

import numpy as np
import pytest

from glm5.serving.launcher import TritonServerProcess

ENGINE_SETTINGS = {"cache_memory_gb": "0.05", "max_num_seqs": "16", "max_model_len": "512"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("triton_vllm") / "server.log"
    with TritonServerProcess(model_dir=str(tiny_checkpoint_dir), models=("glm5",), log_file=log,
                             engine_overrides=ENGINE_SETTINGS, ready_timeout_s=240) as srv:
        yield srv


def _infer(server, tensors: dict[str, object], timeout: float = 60.0) -> list[dict[str, np.ndarray]]:
    """One request over the gRPC stream; returns every response's outputs (raises on an error)."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = []
    for name, value in tensors.items():
        if isinstance(value, bool):
            arr, dtype = np.array([value]), "BOOL"
        else:
            arr, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    c.async_stream_infer("glm5", inputs, enable_empty_final_response=True)
    responses = []
    try:
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            resp = result.get_response()
            outs = {o.name: result.as_numpy(o.name) for o in resp.outputs}
            if outs:
                responses.append(outs)
            if resp.parameters["triton_final_response"].bool_param:
                return responses
    finally:
        c.stop_stream()
        c.close()


def _texts(arr: np.ndarray) -> list[str]:
    return [v.decode() for v in arr.reshape(-1)]


#: Every input vllm_backend declares (src/model.py auto_complete_config), all set.
def full_input_set(stream: bool, sampling: dict) -> dict[str, object]:
    return {"text_input": "The quick brown fox", "stream": stream, "sampling_parameters": json.dumps(sampling),
            "exclude_input_in_output": True, "return_finish_reason": True, "return_cumulative_logprob": True,
            "return_logprobs": True, "return_num_input_tokens": True, "return_num_output_tokens": True}


def test_full_vllm_backend_input_set_streaming(server):
    sampling = {"max_tokens": "6", "temperature": "0.8", "seed": "7", "top_p": 0.95, "ignore_eos": True,
                "logprobs": 2}
    resps = _infer(server, full_input_set(True, sampling))
    assert len(resps) > 1
    reasons = [_texts(r["finish_reason"])[0] for r in resps]
    assert reasons[:-1] == ["None"] * (len(resps) - 1) and reasons[-1] == "length"   # str(None) before the end
    n_out = [int(r["num_output_tokens"][0]) for r in resps]
    assert sum(n_out) == 6
    assert all(int(r["num_input_tokens"][0]) > 0 for r in resps)
    entries = [e for r in resps for e in json.loads(_texts(r["logprobs"])[0])]
    assert len(entries) == 6
    sampled = [next(iter(e.values()))["logprob"] for e in entries]
    assert all(2 <= len(e) <= 3 for e in entries)                    # sampled + top-2 (merged if equal)
    cum = [float(r["cumulative_logprob"][0]) for r in resps]
    assert cum[-1] == pytest.approx(sum(sampled), abs=1e-3)          # running total, not a delta
    assert all(a >= b for a, b in zip(cum, cum[1:]))


def test_full_vllm_backend_input_set_non_streaming_with_vllm_only_keys(server):
    sampling = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 1, "logprobs": 1,
                "spaces_between_special_tokens": True, "output_kind": 0, "detokenize": True, "prompt_logprobs": 1,
                "logit_bias": {}, "stop": [], "stop_token_ids": [], "min_tokens": 0, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "repetition_penalty": 1.0, "min_p": 0.0, "top_k": -1}
    resps = _infer(server, full_input_set(False, sampling))
    assert len(resps) == 1
    r = resps[0]
    assert _texts(r["finish_reason"]) == ["length"] and int(r["num_output_tokens"][0]) == 5
    assert math.isfinite(float(r["cumulative_logprob"][0]))
    plp = json.loads(_texts(r["prompt_logprobs"])[0])
    assert plp[0] is None and len(plp) == int(r["num_input_tokens"][0])
    # detokenize=false: no text, the tokens are still counted
    quiet = _infer(server, full_input_set(False, dict(sampling, detokenize=False)))[0]
    assert _texts(quiet["text_output"]) == [""] and int(quiet["num_output_tokens"][0]) == 5


def test_triton_openai_frontend_default_payload_is_answered(server):
    """What Triton's OpenAI frontend sends for a plain chat request to a vLLM model (n=1, logprobs=false)."""
    sampling = {"n": 1, "logprobs": False, "frequency_penalty": 0.0, "presence_penalty": 0.0, "temperature": 1.0,
                "top_p": 1.0, "max_tokens": 4, "best_of": 1}
    resps = _infer(server, {"text_input": "Hello", "stream": False, "sampling_parameters": json.dumps(sampling),
                            "exclude_input_in_output": True, "return_logprobs": False,
                            "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert len(resps) == 1 and int(resps[0]["num_output_tokens"][0]) >= 1
    assert "logprobs" not in resps[0]


def test_n_returns_independent_sequences_and_seeds_are_reproducible(server):
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 3}
    tensors = {"text_input": "Once upon a time", "sampling_parameters": json.dumps(sampling),
               "exclude_input_in_output": True, "return_finish_reason": True, "return_num_output_tokens": True}
    a = _infer(server, tensors)[0]
    assert len(_texts(a["text_output"])) == 3 and list(a["num_output_tokens"]) == [8, 8, 8]
    assert _texts(a["finish_reason"]) == ["length"] * 3
    assert len(set(_texts(a["text_output"]))) > 1, "n sequences must be sampled independently"
    assert _texts(_infer(server, tensors)[0]["text_output"]) == _texts(a["text_output"])
    # sequence i uses seed + i: sequence 1 of seed 11 is sequence 0 of seed 12
    one = dict(sampling, n=1, seed=12)
    b = _infer(server, dict(tensors, sampling_parameters=json.dumps(one)))[0]
    assert _texts(b["text_output"])[0] == _texts(a["text_output"])[1]
    # streaming: every response has one element per sequence; deltas concatenate to the same texts
    resps = _infer(server, dict(tensors, stream=True))
    joined = ["".join(_texts(r["text_output"])[i] for r in resps) for i in range(3)]
    assert joined == _texts(a["text_output"])


def test_best_of_returns_the_best_candidates(server):
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 1, "best_of": 4}
    r = _infer(server, {"text_input": "Pick the best", "sampling_parameters": json.dumps(sampling),
                        "exclude_input_in_output": True, "return_cumulative_logprob": True})[0]
    best = float(r["cumulative_logprob"][0])
    cands = [float(_infer(server, {"text_input": "Pick the best", "exclude_input_in_output": True,
                                   "return_cumulative_logprob": True,
                                   "sampling_parameters": json.dumps(dict(sampling, best_of=None, seed=3 + i))}
                          )[0]["cumulative_logprob"][0]) for i in range(4)]
    assert best == pytest.approx(max(cands), abs=1e-4)
    with pytest.raises(RuntimeError, match="cannot stream"):
        _infer(server, {"text_input": "x", "stream": True, "sampling_parameters": json.dumps(sampling)})


@pytest.mark.parametrize("sampling,needle", [
    ({"structured_outputs": json.dumps({"json": {"type": "object"}})}, "structured output"),
    ({"guided_decoding": {"regex": "a+"}}, "guided"),
    ({"lora_name": "adapter"}, "LoRA feature is not enabled"),
])
def test_unsupported_vllm_features_are_named(server, sampling, needle):
    with pytest.raises(RuntimeError, match=needle):
        _infer(server, {"text_input": "x", "sampling_parameters": json.dumps(sampling)})


def test_embedding_request_gets_a_clear_error(server):
    with pytest.raises(RuntimeError, match="does not support 'embed'"):
        _infer(server, {"embedding_request": json.dumps({"input": "hi"})})


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = rf'^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$'
    m = re.search(pat, text, re.M)
    assert m is not None, f"metric {name} {labels} not exported"
    return float(m.group(1))


def test_vllm_named_metric_families_after_traffic(server):
    _infer(server, {"text_input": "metrics please", "sampling_parameters": json.dumps(
        {"max_tokens": 4, "ignore_eos": True, "n": 2})})
    time.sleep(0.6)   # the metrics thread publishes every 200 ms
    text = server.metrics_text()
    labels = 'model="glm5",version="1"'
    assert _metric(text, "vllm:prompt_tokens_total", labels) >= 1
    assert _metric(text, "vllm:generation_tokens_total", labels) >= 8
    assert _metric(text, "vllm:time_to_first_token_seconds_count", labels) >= 2
    assert _metric(text, "vllm:time_per_output_token_seconds_count", labels) >= 6
    assert _metric(text, "vllm:e2e_request_latency_seconds_count", labels) >= 2
    assert _metric(text, "vllm:request_prompt_tokens_count", labels) >= 2
    assert _metric(text, "vllm:request_generation_tokens_sum", labels) >= 8
    assert _metric(text, "vllm:request_params_n_count", labels) >= 1
    assert _metric(text, 'vllm:request_params_n_bucket', 'le="2"') >= 1
    assert _metric(text, "vllm:request_success_total", 'finished_reason="length"') >= 2
    assert _metric(text, "vllm:num_requests_running", labels) == 0
    assert _metric(text, "vllm:num_requests_waiting", labels) == 0
    assert _metric(text, "vllm:gpu_cache_usage_perc", labels) == 0.0
    # the engine's own families stay beside them, with the same totals
    assert _metric(text, "glm5:generation_tokens_total") == _metric(text, "vllm:generation_tokens_total")
