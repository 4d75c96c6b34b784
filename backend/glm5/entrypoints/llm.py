"""vLLM-style offline API: ``from glm5 import LLM, SamplingParams``.

::

    llm = LLM(model="/path/to/checkpoint", max_num_seqs=16)      # any EngineArgs field as a keyword
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason
    outs[0].prompt_token_ids, outs[0].num_cached_tokens

One ``LLM`` owns one engine, so successive ``generate`` / ``chat`` calls share its prefix cache: a
second call that resends a conversation reuses what the first computed (``num_cached_tokens``).
Prompts of one call run together (continuous batching) and come back in order.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from glm5.engine import CompletionOutput, EngineArgs, LLMEngine, PromptInput
from glm5.engine.sequence import RequestMetrics
from glm5.sampling_params import SamplingParams

#: what ``generate`` accepts per prompt
Prompt = str | dict[str, Any] | PromptInput


@dataclass
class RequestResult:
    """One finished request, shaped like vLLM's ``RequestOutput`` (``outputs`` holds one completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = None


def _media_bytes(item: Any, what: str) -> bytes:
    """Raw bytes for an image / video given as bytes, a path-like or a PIL image (saved as PNG)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if hasattr(item, "save") and what == "image":  # a PIL image
        buf = io.BytesIO()
        item.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(item, str) or hasattr(item, "__fspath__"):
        with open(item, "rb") as f:
            return f.read()
    raise ValueError(f"multi_modal_data {what}: expected bytes, a file path or a PIL image, got {type(item).__name__}")


def to_prompt_input(prompt: Prompt) -> PromptInput:
    """A vLLM prompt (text, ``{"prompt_token_ids": [...]}``, ``{"prompt": ..., "multi_modal_data": {...}}``)
    as the engine's :class:`PromptInput`."""
    if isinstance(prompt, PromptInput):
        return prompt
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"prompt keys {sorted(unknown)} are not understood; use prompt, prompt_token_ids, "
                             "multi_modal_data")
        media = prompt.get("multi_modal_data") or {}
        bad = set(media) - {"image", "video"}
        if bad:
            raise ValueError(f"multi_modal_data keys {sorted(bad)}: only image and video are supported")

        def items(key: str) -> list[bytes]:
            v = media.get(key)
            if v is None:
                return []
            return [_media_bytes(x, key) for x in (v if isinstance(v, (list, tuple)) else [v])]

        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a dict prompt needs exactly one of 'prompt' (text) or 'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            return PromptInput(token_ids=list(prompt["prompt_token_ids"]), images=items("image"), videos=items("video"))
        return PromptInput(text=prompt["prompt"], images=items("image"), videos=items("video"))
    raise ValueError(f"a prompt must be a string, a dict with 'prompt' or 'prompt_token_ids', or a PromptInput; "
                     f"got {type(prompt).__name__}")


class LLM:
    """An offline engine over one checkpoint; ``engine_args`` are :class:`EngineArgs` fields."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; valid: {sorted(fields)}")
        if model is None:
            from glm5.tiny_checkpoint import ensure_default_checkpoint
            model = str(ensure_default_checkpoint())
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestResult]:
        """Run ``prompts`` (one or a list) to completion; one result per prompt, in order.
        ``sampling_params``: one for all prompts, or one per prompt."""
        single = isinstance(prompts, (str, dict, PromptInput))
        plist = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"{len(params)} sampling_params for {len(plist)} prompts; give one, or one per prompt")
        else:
            params = [sampling_params or SamplingParams()] * len(plist)
        inputs = [to_prompt_input(p) for p in plist]
        done = self.llm_engine.generate(inputs, params)
        out = []
        for p, c in zip(plist, done):
            text = p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else p.text
            out.append(RequestResult(request_id=c.request_id, prompt=text, prompt_token_ids=c.prompt_token_ids,
                                     outputs=[c], num_cached_tokens=c.num_cached_tokens, metrics=c.metrics))
        return out

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestResult]:
        """Chat-template one conversation (a list of ``{"role", "content"}`` messages) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([PromptInput(messages=list(c)) for c in convs], sampling_params)  # type: ignore[arg-type]
