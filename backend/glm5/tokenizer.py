"""Tokenizer and chat template of a checkpoint (transformers' fast tokenizer, offline)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path):
    """The checkpoint's HF tokenizer; a clear error when the directory has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {path}: the engine needs the "
                                "checkpoint's tokenizer files (token-id prompts work without them only offline)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _tool_call(i: int, j: int, tc: object) -> dict:
    """An OpenAI ``tool_calls`` entry with ``arguments`` as an object (the template writes each
    argument as a key/value pair; OpenAI clients send ``arguments`` as a JSON string)."""
    if not isinstance(tc, dict):
        raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object with 'function'")
    fn = tc.get("function", tc)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"messages[{i}].tool_calls[{j}].function needs a non-empty 'name'")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({exc.msg})") from exc
    if not isinstance(args, dict):
        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
    return {"id": tc.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Accept OpenAI-style parts (``image_url``, ``video_url``, ``input_text``) and map them to the
    template's ``text`` / ``image`` / ``video`` parts; validate roles. Assistant ``tool_calls``
    (arguments parsed from their JSON string) and ``reasoning_content``, and a tool message's
    ``tool_call_id`` / ``name``, are kept for the template."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m["role"]
        if role not in ("system", "user", "assistant", "observation", "tool"):
            raise ValueError(f"messages[{i}].role={role!r}: use system, user, assistant, tool or observation")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind in ("text", "input_text"):
                    parts.append({"type": "text", "text": str(p.get("text", ""))})
                elif kind in ("image", "image_url", "input_image"):
                    parts.append({"type": "image"})
                elif kind in ("video", "video_url"):
                    parts.append({"type": "video"})
                else:
                    raise ValueError(f"messages[{i}].content[{j}].type={kind!r}: use text, image or video")
            content = parts
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            if calls:
                msg["tool_calls"] = [_tool_call(i, j, tc) for j, tc in enumerate(calls)]
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                msg["reasoning_content"] = str(reasoning)
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = str(m[key])
        out.append(msg)
    return out


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **template_kwargs) -> str:
    """The chat prompt: ``messages`` (normalised), ``tools`` (OpenAI tool objects) and extra template
    variables (e.g. ``enable_thinking``) through the checkpoint's chat template."""
    return tokenizer.apply_chat_template(normalize_messages(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
