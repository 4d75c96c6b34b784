"""The OpenAI-compatible server driven by the official ``openai`` SDK, through a real tritonserver
serving the tiny checkpoint (one Triton + one OpenAI server for the module).

The tiny model's tokens are random, so the tool-call and reasoning plumbing is checked with a
response whose tokens the test controls: the checkpoint copy gets three extra (non-special)
tokens at unused ids, each the text of a whole model turn, and ``logit_bias`` plus
``repetition_penalty`` make greedy decoding emit them in a chosen order (bias 100 > 90 > 80; the
repetition penalty halves a token's logit once it was produced, so the next one wins).
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from glm5.entrypoints.openai.process import OpenAIServerProcess
from glm5.serving.launcher import TritonServerProcess, find_free_port

ENGINE_SETTINGS = {"cache_memory_gb": "0.05", "max_num_seqs": "16", "max_model_len": "512"}
THINK = "<think>Checking the weather.</think>"
TOOL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
ANSWER = "<think>Thinking it over.</think>The answer is 4."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MAX_BODY_MB = 2


def crafted_checkpoint(src: Path, dst: Path, texts: list[str]) -> dict[str, int]:
    """Copy the checkpoint and add ``texts`` as added tokens at ids the tokenizer does not use yet."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    vocab = json.loads((dst / "config.json").read_text())["text_config"]["vocab_size"]
    next_id = max(max(t["id"] for t in tj["added_tokens"]), max(tj["model"]["vocab"].values())) + 1
    ids = {}
    for text in texts:
        assert next_id < vocab, "no unused token id left in the tiny vocabulary"
        entry = {"content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": False}
        tj["added_tokens"].append({"id": next_id, **entry})
        tc.setdefault("added_tokens_decoder", {})[str(next_id)] = entry
        ids[text] = next_id
        next_id += 1
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return ids


@pytest.fixture(scope="module")
def stack(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("openai")
    ckpt = work / "ckpt"
    ids = crafted_checkpoint(tiny_checkpoint_dir, ckpt, [THINK, TOOL, ANSWER])
    with TritonServerProcess(model_dir=str(ckpt), models=("glm5",), log_file=work / "triton.log",
                             engine_overrides=ENGINE_SETTINGS, ready_timeout_s=240) as srv:
        # the admin key lets it read the (restricted) model config, as glm5 serve --openai-port hands it over
        with OpenAIServerProcess(srv.grpc_url, str(ckpt), find_free_port(), log_file=work / "openai.log",
                                 extra_args=["--max-body-mb", str(MAX_BODY_MB)],
                                 extra_env={"GLM5_ADMIN_KEY": srv.admin_key.value}) as oa:
            client = openai.OpenAI(base_url=oa.base_url, api_key="unused", max_retries=0, timeout=120)
            yield {"srv": srv, "oa": oa, "client": client, "ids": ids, "ckpt": ckpt}


@pytest.fixture(scope="module")
def tokenizer(stack):
    from glm5.tokenizer import load_tokenizer

    return load_tokenizer(stack["ckpt"])


def metric(srv: TritonServerProcess, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', srv.metrics_text(), re.M)
    assert m is not None, f"metric {name} not exported"
    return float(m.group(1))


USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_model(stack):
    models = stack["client"].models.list()
    assert [m.id for m in models.data] == ["glm5"]
    assert stack["client"].models.retrieve("glm5").id == "glm5"


def test_chat_completion_usage_counts_the_rendered_prompt(stack, tokenizer):
    from glm5.tokenizer import render_chat

    r = stack["client"].chat.completions.create(model="glm5", messages=USER, max_completion_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    prompt = render_chat(tokenizer, USER)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens == 0    # no prefix cache hit (none exists yet)


def test_chat_stream_equals_the_non_streamed_answer(stack):
    c = stack["client"]
    kw = dict(model="glm5", messages=USER, max_tokens=8, seed=5, temperature=0.9, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**kw).choices[0].message
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    assert text == (full.content or "") and reasoning == (getattr(full, "reasoning_content", None) or "")
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])


def test_seed_repeats_and_n_gives_independent_choices(stack):
    c = stack["client"]
    kw = dict(model="glm5", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=21, n=2,
              extra_body={"ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 16
    other = c.completions.create(**{**kw, "seed": 22, "n": 1})
    assert other.choices[0].text == a.choices[1].text    # sequence i runs with seed + i
    chat = [c.chat.completions.create(model="glm5", messages=USER, max_tokens=6, seed=4, temperature=1.0, n=2,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [x.message.content for x in chat[0].choices] == [x.message.content for x in chat[1].choices]
    assert len(chat[0].choices) == 2


def test_completions_with_several_prompts_echo_and_logprobs(stack, tokenizer):
    r = stack["client"].completions.create(model="glm5", prompt=["Hello", "The cache"], max_tokens=3, echo=True,
                                           logprobs=2, **GREEDY)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("Hello") and r.choices[1].text.startswith("The cache")
    for ch, prompt in zip(r.choices, ["Hello", "The cache"]):
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt - 1 + 3
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)     # keyed by text: equal pieces merge
    ids = tokenizer.encode("Token ids", add_special_tokens=False)
    by_ids = stack["client"].completions.create(model="glm5", prompt=ids, max_tokens=3, **GREEDY)
    by_text = stack["client"].completions.create(model="glm5", prompt="Token ids", max_tokens=3, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_chat_logprobs_in_openai_shape(stack):
    r = stack["client"].chat.completions.create(model="glm5", messages=USER, max_tokens=5, logprobs=True,
                                                top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert [t.logprob for t in tok.top_logprobs] == sorted((t.logprob for t in tok.top_logprobs), reverse=True)
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)     # greedy: the sampled token is the top
        assert isinstance(tok.bytes, list) and all(0 <= b < 256 for b in tok.bytes)


def _png_data_url(w: int = 64, h: int = 48) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_url_part_is_sent_to_the_model(stack):
    c = stack["client"]
    text_only = c.chat.completions.create(model="glm5", max_tokens=2, **GREEDY,
                                          messages=[{"role": "user", "content": [{"type": "text", "text": "Describe"}]}])
    with_image = c.chat.completions.create(model="glm5", max_tokens=2, **GREEDY, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_data_url()}}, {"type": "text", "text": "Describe"}]}])
    # the image's placeholder is expanded to one token per merged patch (64x48 px -> 4 x 3 = 12 tokens here)
    extra = with_image.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert extra > 3, f"the image added only {extra} prompt tokens"
    with pytest.raises(openai.BadRequestError, match="remote image"):
        c.chat.completions.create(model="glm5", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])


def _tool_bias(ids: dict[str, int], first: str, second: str | None) -> dict:
    bias = {str(ids[first]): 100}
    if second is not None:
        bias[str(ids[second])] = 90
    bias["576"] = 80      # <|endoftext|>: ends the turn after the scripted tokens
    return {"temperature": 0.0, "logit_bias": bias, "extra_body": {"repetition_penalty": 2.0}}


def test_tool_call_is_parsed_from_the_model_output(stack):
    c, ids = stack["client"], stack["ids"]
    r = c.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, max_tokens=6, **_tool_bias(ids, THINK, TOOL))
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None and ch.message.reasoning_content == "Checking the weather."
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}   # days typed by the schema
    assert r.usage.completion_tokens == 3

    stream = list(c.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, max_tokens=6, stream=True,
                                            **_tool_bias(ids, THINK, TOOL)))
    deltas = [s.choices[0].delta for s in stream if s.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"city": "Paris", "days": 3} and {tc.index for tc in calls} == {0}
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Checking the weather."
    assert not "".join(d.content or "" for d in deltas)
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # with tool_choice "none" the same text is returned as content
    plain = c.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=6,
                                      **_tool_bias(ids, THINK, TOOL))
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == TOOL


def test_reasoning_is_split_from_the_answer(stack):
    c, ids = stack["client"], stack["ids"]
    r = c.chat.completions.create(model="glm5", messages=USER, max_tokens=4, **_tool_bias(ids, ANSWER, None))
    msg = r.choices[0].message
    assert msg.reasoning_content == "Thinking it over." and msg.content == "The answer is 4."
    assert r.choices[0].finish_reason == "stop"


def test_tool_results_in_the_history_render_and_run(stack):
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = stack["client"].chat.completions.create(model="glm5", messages=history, tools=TOOLS, max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("kwargs,status,needle", [
    ({"response_format": {"type": "json_object"}}, 400, "structured output"),
    ({"model": "gpt-4"}, 404, "does not exist"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"extra_body": {"top_k": -7}}, 400, "top_k"),
    ({"tool_choice": "required", "tools": TOOLS}, 400, "tool_choice"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ({"top_logprobs": 2}, 400, "logprobs"),
])
def test_bad_requests_get_openai_errors(stack, kwargs, status, needle):
    args = {"model": "glm5", "messages": USER, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        stack["client"].chat.completions.create(**args)
    assert info.value.status_code == status
    body = info.value.body
    assert needle in body["message"] and body["type"] and "param" in body


def test_oversized_body_is_413(stack):
    big = "x" * (MAX_BODY_MB * 2**20 + 10)
    r = httpx.post(stack["oa"].base_url + "/chat/completions", timeout=30,
                   json={"model": "glm5", "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def _wait_idle(srv, aborted0: float) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(srv, "glm5:request_aborted_total") > aborted0 and metric(srv, "vllm:num_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the engine request was not aborted after the client disconnected")


LONG = {"model": "glm5", "messages": USER, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}


def test_client_disconnect_cancels_the_triton_request(stack):
    srv, url = stack["srv"], stack["oa"].base_url + "/chat/completions"
    time.sleep(0.5)
    aborted0, gen0 = metric(srv, "glm5:request_aborted_total"), metric(srv, "glm5:generation_tokens_total")
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    _wait_idle(srv, aborted0)
    time.sleep(0.5)
    assert metric(srv, "glm5:generation_tokens_total") - gen0 < 100     # far from the 400 asked for

    aborted1 = metric(srv, "glm5:request_aborted_total")
    with pytest.raises(httpx.ReadTimeout):      # non-streamed: the client gives up while the server works
        httpx.post(url, json=LONG, timeout=1.5)
    _wait_idle(srv, aborted1)


def test_concurrent_streams_do_not_mix(stack):
    c = stack["client"]
    prompts = [f"Story number {i}" for i in range(4)]
    ref = [c.completions.create(model="glm5", prompt=p, max_tokens=5, **GREEDY).choices[0].text for p in prompts]
    got: dict[int, str] = {}

    def run(i: int) -> None:
        s = c.completions.create(model="glm5", prompt=prompts[i], max_tokens=5, stream=True, **GREEDY)
        got[i] = "".join(ch.choices[0].text for ch in s if ch.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(4)] == ref


def test_front_process_froze_its_start_up_heap(stack):
    """The OpenAI front loads the tokenizer (transformers, torch), then freezes what start-up made (glm5.heap),
    so that a full garbage collection does not hold every stream's next event."""
    text = Path(stack["oa"].log_file).read_text(errors="replace")
    m = re.search(r"start-up heap frozen: (\d+) objects", text)
    assert m is not None, text[-3000:]
    assert int(m.group(1)) > 50_000
