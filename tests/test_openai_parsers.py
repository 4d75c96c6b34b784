"""GLM tool-call and reasoning parsers: on the chat template's own rendering of tool calls, on
crafted model text, and streamed in every possible split of the text into deltas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm5.entrypoints.openai.reasoning_parser import Glm5ReasoningParser, prompt_opens_reasoning
from glm5.entrypoints.openai.tool_parser import Glm5ToolParser, partial_suffix

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}}}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3, "units": "42"}),
         ("search", {"query": "a <b> & \"c\"\nnext line", "filters": {"year": [2024, 2025], "open": True}})]


def _history(calls: list[tuple[str, dict]]) -> list[dict]:
    return [{"role": "user", "content": "Plan my trip"},
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "Two tools needed.",
             "tool_calls": [{"id": f"c{i}", "type": "function",
                             "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]}]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint_dir: Path):
    from glm5.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoint_dir)


def _assistant_turn(tok, messages: list[dict], tools: list[dict]) -> str:
    """What the template renders for the last assistant message (= what the model is taught to write)."""
    from glm5.tokenizer import render_chat

    full = render_chat(tok, messages, add_generation_prompt=False, tools=tools)
    return full[full.rindex("<|assistant|>\n") + len("<|assistant|>\n"):]


def test_template_renders_tools_and_the_parser_reads_back_its_tool_calls(tok):
    from glm5.tokenizer import render_chat

    prompt = render_chat(tok, _history(CALLS)[:1], tools=TOOLS)
    assert "# Tools" in prompt and json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    assert "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>" in prompt
    assert prompt.endswith("<|user|>\nPlan my trip<|assistant|>\n")
    turn = _assistant_turn(tok, _history(CALLS), TOOLS)
    assert turn.startswith("<think>Two tools needed.</think>Let me look.<tool_call>get_weather<arg_key>city</arg_key>")
    reasoning, rest = Glm5ReasoningParser().extract(turn)
    assert reasoning == "Two tools needed."
    content, calls = Glm5ToolParser(TOOLS).extract(rest)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


def test_string_typed_arguments_stay_strings_and_others_are_json():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value>"
            "<arg_key>days</arg_key><arg_value>7</arg_value><arg_key>extra</arg_key><arg_value>not json</arg_value>"
            "</tool_call>")
    _, (call,) = Glm5ToolParser(TOOLS).extract(text)
    assert json.loads(call.arguments) == {"city": "123", "days": 7, "extra": "not json"}


def test_glm45_layout_with_newlines_and_zero_argument_calls_parse():
    text = "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>" \
           "<tool_call>search</tool_call>"
    content, calls = Glm5ToolParser(TOOLS).extract(text)
    assert content == "Sure.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("search", {})]


def test_text_without_calls_and_unterminated_calls_stay_content():
    assert Glm5ToolParser(TOOLS).extract("just text") == ("just text", [])
    text = "x<tool_call>get_weather<arg_key>city</arg_key>"
    assert Glm5ToolParser(TOOLS).extract(text) == (text, [])


def _stream_tools(text: str, cut: list[int]) -> tuple[str, list[dict]]:
    p = Glm5ToolParser(TOOLS)
    content, deltas, prev = "", [], 0
    for c in cut + [len(text)]:
        step = p.feed(text[prev:c])
        content += step.content
        deltas += step.tool_calls
        prev = c
    content += p.finish().content
    return content, deltas


def _assemble(deltas: list[dict]) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        if d.get("id"):
            assert d["type"] == "function"
        fn = d["function"]
        c["name"] += fn.get("name") or ""
        c["arguments"] += fn.get("arguments") or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_streamed_tool_calls_equal_the_whole_text_parse_for_every_split(tok):
    text = "Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call> ok" \
           "<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value></tool_call>"
    whole_content, whole_calls = Glm5ToolParser(TOOLS).extract(text)
    expected = [(c.name, json.loads(c.arguments)) for c in whole_calls]
    for i in range(1, len(text)):
        for cut in ([i], [i, min(len(text) - 1, i + 7)]):
            content, deltas = _stream_tools(text, sorted(set(cut)))
            assert content == whole_content, cut
            assert _assemble(deltas) == expected, cut
    # the name is announced before the arguments arrive
    p = Glm5ToolParser(TOOLS)
    first = p.feed("<tool_call>get_weather<arg_key>ci")
    assert first.tool_calls == [{"index": 0, "id": first.tool_calls[0]["id"], "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]


def test_streaming_holds_back_only_a_possible_tag_prefix():
    p = Glm5ToolParser(TOOLS)
    assert p.feed("a <tool_").content == "a "
    assert p.feed("x").content == "<tool_x"
    assert partial_suffix("abc<tool_c", "<tool_call>") == len("<tool_c")


REASONING_CASES = [
    (False, "<think>plan</think>answer", ("plan", "answer")),
    (False, "no thinking at all", (None, "no thinking at all")),
    (False, "pre<think>plan</think>post", ("plan", "prepost")),
    (True, "plan directly</think>answer", ("plan directly", "answer")),
    (True, "still thinking when cut off", ("still thinking when cut off", None)),
    (False, "<think></think>only answer", (None, "only answer")),
]


@pytest.mark.parametrize("opened,text,expected", REASONING_CASES)
def test_reasoning_split_whole_and_streamed_in_every_split(opened, text, expected):
    assert Glm5ReasoningParser(opened).extract(text) == expected
    for i in range(len(text) + 1):
        p = Glm5ReasoningParser(opened)
        r1, c1 = p.feed(text[:i])
        r2, c2 = p.feed(text[i:])
        r3, c3 = p.finish()
        assert ((r1 + r2 + r3) or None, (c1 + c2 + c3) or None) == expected, i


def test_prompt_opens_reasoning_follows_the_template(tok):
    from glm5.tokenizer import render_chat

    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(render_chat(tok, msgs, enable_thinking=True))
    assert not prompt_opens_reasoning(render_chat(tok, msgs, enable_thinking=False))
    assert render_chat(tok, msgs, enable_thinking=False).endswith("<|assistant|>\n<think></think>")
    assert not prompt_opens_reasoning(render_chat(tok, msgs))


def test_tool_messages_share_one_observation_turn(tok):
    from glm5.tokenizer import render_chat

    msgs = _history(CALLS) + [{"role": "tool", "tool_call_id": "c0", "content": "sunny"},
                              {"role": "tool", "tool_call_id": "c1", "content": "3 results"}]
    text = render_chat(tok, msgs, tools=TOOLS)
    assert text.endswith("</tool_call><|observation|>\n<tool_response>sunny</tool_response>"
                         "<tool_response>3 results</tool_response><|assistant|>\n")
    with pytest.raises(ValueError, match="arguments is not valid JSON"):
        render_chat(tok, [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{bad"}}]}])
