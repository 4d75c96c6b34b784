"""vllm_backend's output conventions and vLLM-named metrics, without a server."""

from __future__ import annotations

from types import SimpleNamespace

from glm5.serving.vllm_metrics import FinishedRequest, VllmMetrics, build_1_2_5_buckets
from glm5.serving.vllm_outputs import SequenceSet, finish_reason_text, logprobs_json, vllm_logprob_entries


def out(text, ids, finished=False, reason=None, lps=None):
    return SimpleNamespace(text=text, token_ids=ids, finished=finished, finish_reason=reason, logprobs=lps,
                           num_prompt_tokens=4, prompt_text="p", metrics=None, prompt_logprobs=None)


def test_finish_reason_is_str_of_vllms_value():
    assert finish_reason_text(None) == "None" and finish_reason_text("length") == "length"


def test_logprob_entries_have_vllms_shape_with_the_sampled_token_first():
    rec = {"token_id": 7, "logprob": -2.0, "rank": 3, "top": [[1, -0.5], [7, -2.0], [2, -1.0]]}
    (entry,) = vllm_logprob_entries([rec], decode=lambda t: f"<{t}>")
    assert list(entry) == ["7", "1", "2"]
    assert entry["7"] == {"logprob": -2.0, "rank": 3, "decoded_token": "<7>"}
    assert entry["1"]["rank"] == 1 and entry["2"]["rank"] == 3   # top ranks are positions 1..k
    assert logprobs_json(None) == "null"


def test_sequence_set_deltas_per_sequence_and_best_of_ranking():
    s = SequenceSet(2)
    s.add(1, out("b1", [5], lps=[{"token_id": 5, "logprob": -0.1, "rank": 1, "top": []}]))
    s.add(0, out("a1", [3], lps=[{"token_id": 3, "logprob": -3.0, "rank": 9, "top": []}]))
    rows = s.take()
    assert [r["text"] for r in rows] == ["a1", "b1"] and [r["num_tokens"] for r in rows] == [1, 1]
    s.add(0, out("a2", [4], finished=True, reason="length", lps=[{"token_id": 4, "logprob": -1.0, "rank": 1,
                                                                  "top": []}]))
    rows = s.take()
    assert [r["text"] for r in rows] == ["a2", ""] and rows[0]["finish_reason"] == "length"
    assert rows[1]["finish_reason"] is None and not s.finished
    s.add(1, out("", [], finished=True, reason="stop"))
    assert s.finished and s.best(1) == [1]
    whole = s.take([1, 0], whole=True)
    assert [r["text"] for r in whole] == ["b1", "a1a2"] and whole[1]["cumulative_logprob"] == -4.0


class _Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        _Family.made[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' API)
        m = _Metric(labels, buckets)
        self.metrics.append(m)
        return m


def test_vllm_metric_names_labels_and_buckets():
    labels = {"model": "glm5", "version": "1"}
    vm = VllmMetrics(_Family, _Family, labels, max_model_len=100)
    names = set(_Family.made)
    assert {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
            "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"} <= names
    assert _Family.made["vllm:request_prompt_tokens"].metrics[0].buckets == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000
    st = SimpleNamespace(running=2, waiting=1, cache_usage=0.25, prompt_tokens_total=10, generation_tokens_total=7,
                         preempted_total=0)
    vm.update_stats(st)
    vm.update_stats(SimpleNamespace(**{**vars(st), "generation_tokens_total": 9}))
    assert vm.generation_tokens.value == 9 and vm.running.value == 2 and vm.gpu_cache_usage.value == 0.25
    m = SimpleNamespace(arrival_time=1.0, first_token_time=1.5, finished_time=3.0, inter_token_latencies=[0.1, 0.2])
    vm.observe_finished(FinishedRequest(m, 4, 3, "stop"))
    assert vm.ttft.observed == [0.5] and vm.e2e.observed == [2.0] and vm.tpot.observed == [0.1, 0.2]
    success = _Family.made["vllm:request_success_total"].metrics[0]
    assert success.labels == {**labels, "finished_reason": "stop"} and success.value == 1


def test_openai_logprob_shapes_and_token_bytes(tiny_checkpoint_dir):
    from glm5.entrypoints.openai.serving import TokenBytes, chat_logprobs, completion_logprobs
    from glm5.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_checkpoint_dir)
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) >= 1
    tb = TokenBytes(tok)
    assert b"".join(bytes(tb(t, tok.decode([t]))) for t in euro) == "€".encode()   # partial-character pieces too
    entries = [{"5": {"logprob": -1.0, "rank": 2, "decoded_token": "a"},
                "9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
    (c,) = chat_logprobs(entries, 2)
    assert c["token"] == "a" and [t["token"] for t in c["top_logprobs"]] == ["b", "a"]
    legacy = completion_logprobs([None] + entries, 1, 3)
    assert legacy == {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"b": -0.5}], "text_offset": [3]}


def test_triton_error_messages_map_to_http_statuses():
    from glm5.entrypoints.openai.triton_client import error_status

    assert error_status("sampling parameter 'top_k' = -7 is invalid") == 400
    assert error_status("internal error: RuntimeError: boom") == 500
    assert error_status("request was cancelled") == 499


def test_chat_media_parts_must_be_data_urls():
    import base64

    import pytest

    from glm5.entrypoints.openai.protocol import OpenAIError
    from glm5.entrypoints.openai.serving import extract_media

    png, mp4 = b"\x89PNG fake", b"\x00\x00\x00\x18ftypmp42"
    msgs = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": "data:image/png;base64," + base64.b64encode(png).decode()}]}]
    assert extract_media(msgs) == ([png], [mp4])
    for url, needle in (("https://x.org/v.mp4", "remote video"), ("data:video/mp4,raw", "base64 encoded"),
                        ("data:video/mp4;base64,@@@", "does not decode")):
        with pytest.raises(OpenAIError, match=needle) as info:
            extract_media([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}])
        assert info.value.status == 400 and info.value.param == "messages[0].content[0]"
