"""Request models of the OpenAI-compatible API (pydantic) and OpenAI's error JSON.

Fields follow OpenAI's API plus the vLLM extensions its users send through ``extra_body``
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``prompt_logprobs``, ``allowed_token_ids``, ``chat_template_kwargs``, ...). Unknown fields are
ignored (and logged), as vLLM does, so newer SDKs keep working. Responses are built as plain
dicts in :mod:`glm5.entrypoints.openai.serving` in OpenAI's shape.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 499: "request_cancelled", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=64)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None

    @model_validator(mode="after")
    def _log_unknown(self) -> "_Request":
        if self.model_extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def check_response_format(self) -> None:
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            raise OpenAIError(f"response_format type {rf.get('type')!r} needs structured output (constrained "
                              "decoding), which this server does not implement; omit response_format or use "
                              "{\"type\": \"text\"}", param="response_format")

    def common_sampling(self) -> dict[str, Any]:
        """The engine's ``sampling_parameters`` for what this request sets (unset = engine default)."""
        sp: dict[str, Any] = {}
        for key in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                    "include_stop_str_in_output", "prompt_logprobs", "allowed_token_ids", "truncate_prompt_tokens",
                    "bad_words"):
            value = getattr(self, key)
            if value is not None:
                sp[key] = value
        if self.stop:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias:
            sp["logit_bias"] = dict(self.logit_bias)
        sp["n"] = self.n
        return sp


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)
    suffix: str | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

