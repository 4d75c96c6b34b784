"""Tokenizer and chat template of a checkpoint (transformers' fast tokenizer, offline)."""

from __future__ import annotations

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


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Accept OpenAI-style parts (``image_url``, ``video_url``, ``input_text``) and map them to the
    template's ``text`` / ``image`` / ``video`` parts; validate roles."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m["role"]
        if role not in ("system", "user", "assistant", "observation", "tool"):
            raise ValueError(f"messages[{i}].role={role!r}: use system, user, assistant or observation")
        content = m.get("content", "")
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
        out.append({"role": role, "content": content})
    return out


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(normalize_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
