"""GLM tool calls in model text -> OpenAI ``tool_calls`` (whole texts and streamed deltas).

GLM-5 (like GLM-4.7; vLLM's ``glm47`` parser) writes a call as
``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``; GLM-4.5
(vLLM's ``glm4_moe``) puts a newline after the name and between the tags. Both parse here: the
name ends at the first whitespace or tag. A value is kept verbatim when the tool's JSON schema
declares that argument a string, otherwise it is read as JSON when it is valid JSON (``2`` -> 2,
``true``, objects, lists) and kept as a string when not. The arguments go out as a JSON object
string, as OpenAI sends them.

Streaming: text outside calls is passed on as content, except a tail that could be the start of
``<tool_call>`` (held back until it can be decided); a call is announced (index, id, name) as soon
as its name is complete and its arguments follow in one delta when ``</tool_call>`` arrives.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END_RE = re.compile(r"\s|<")


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str            # a JSON object, as text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _string_args(tools: list[dict] | None) -> dict[str, set[str]]:
    """Tool name -> the argument names its schema declares as strings."""
    out: dict[str, set[str]] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        out[str(fn.get("name"))] = {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return out


def parse_call(inner: str, string_args: dict[str, set[str]]) -> tuple[str, dict[str, Any]] | None:
    """``NAME<arg_key>..`` (the text between the call tags) -> (name, arguments); None without a name."""
    body = inner.lstrip()
    m = _NAME_END_RE.search(body)
    name = (body[: m.start()] if m else body).strip()
    if not name:
        return None
    strings = string_args.get(name, set())
    args: dict[str, Any] = {}
    for key, value in _ARG_RE.findall(body[len(name):]):
        key = key.strip()
        if key in strings:
            args[key] = value
            continue
        try:
            args[key] = json.loads(value.strip())
        except json.JSONDecodeError:
            args[key] = value
    return name, args


@dataclass
class ToolCallDelta:
    """What one streamed step adds: content text and tool-call deltas (OpenAI ``delta.tool_calls``)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class Glm5ToolParser:
    """Parses one choice's text. ``tools`` are the request's OpenAI tool objects (for argument types)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._strings = _string_args(tools)
        self._buf = ""               # unconsumed text (streaming)
        self._in_call = False
        self._announced = False      # the current call's name was sent
        self._calls: list[ToolCall] = []

    # ------------------------------------------------------------------ whole text
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content without the calls, calls). Text of an unterminated call stays content."""
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(TOOL_CALL_START, pos)
            end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START)) if start != -1 else -1
            if start == -1 or end == -1:
                content.append(text[pos:])
                break
            parsed = parse_call(text[start + len(TOOL_CALL_START):end], self._strings)
            content.append(text[pos:start])
            if parsed is None:
                content.append(text[start:end + len(TOOL_CALL_END)])
            else:
                calls.append(ToolCall(make_tool_call_id(), parsed[0], json.dumps(parsed[1], ensure_ascii=False)))
            pos = end + len(TOOL_CALL_END)
        joined = "".join(content)
        if calls and not joined.strip():
            return None, calls
        return joined, calls

    # ------------------------------------------------------------------ streaming
    @property
    def calls(self) -> list[ToolCall]:
        """Calls completed so far while streaming."""
        return list(self._calls)

    def feed(self, delta: str) -> ToolCallDelta:
        self._buf += delta
        out = ToolCallDelta()
        while self._buf:
            if not self._in_call:
                start = self._buf.find(TOOL_CALL_START)
                if start == -1:
                    keep = partial_suffix(self._buf, TOOL_CALL_START)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.content += self._buf[:start]
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._in_call, self._announced = True, False
                self._calls.append(ToolCall(make_tool_call_id(), "", "{}"))
                continue
            index, call = len(self._calls) - 1, self._calls[-1]
            end = self._buf.find(TOOL_CALL_END)
            if not self._announced:
                body = self._buf.lstrip()
                m = _NAME_END_RE.search(body)
                if m is not None and body[: m.start()]:
                    call.name = body[: m.start()]
                    out.tool_calls.append({"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}})
                    self._announced = True
            if end == -1:
                break
            parsed = parse_call(self._buf[:end], self._strings)
            self._buf = self._buf[end + len(TOOL_CALL_END):]
            self._in_call = False
            if parsed is None:          # "<tool_call></tool_call>": nothing to call
                self._calls.pop()
                continue
            call.name, call.arguments = parsed[0], json.dumps(parsed[1], ensure_ascii=False)
            out.tool_calls.append({"index": index, "function": {"arguments": call.arguments}})
        return out

    def finish(self) -> ToolCallDelta:
        """End of the text: a held-back partial tag is content; an unterminated call is dropped
        from the calls and its text returned as content."""
        out = ToolCallDelta()
        if self._in_call:
            out.content = TOOL_CALL_START + self._buf
            self._calls.pop()
            self._in_call = False
        else:
            out.content = self._buf
        self._buf = ""
        return out
