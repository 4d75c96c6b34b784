"""``/v1/chat/completions`` and ``/v1/completions``: OpenAI requests -> model requests -> OpenAI JSON.

A chat request is rendered with the checkpoint's chat template here (``tools`` included), its
``image_url`` / ``video_url`` parts become the model's ``image`` / ``video`` tensors (data URLs
only: the server fetches nothing from the network), and the model's text is split into
``reasoning_content``, ``content`` and ``tool_calls`` by the GLM parsers. ``n`` choices are the
model's ``n`` independent sequences; a completions request with several prompts runs them
concurrently and numbers the choices ``prompt index * n + sequence``. Streams are Server-Sent
Events ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from glm5.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from glm5.entrypoints.openai.reasoning_parser import Glm5ReasoningParser, prompt_opens_reasoning
from glm5.entrypoints.openai.tool_parser import Glm5ToolParser
from glm5.entrypoints.openai.triton_client import GenerationRequest, GenerationUpdate, TritonGenerator, TritonRequestError

logger = logging.getLogger(__name__)


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def decode_data_url(url: str, what: str, where: str) -> bytes:
    """The bytes of a ``data:<mime>;base64,<payload>`` URL; other URLs are refused."""
    if not isinstance(url, str) or not url:
        raise OpenAIError(f"{where}: {what} needs a 'url'", param=where)
    if not url.startswith("data:"):
        raise OpenAIError(f"{where}: remote {what}s are not fetched ({url[:60]!r}): the server has no network "
                          f"access by default; send the file inline as a data URL "
                          f"(data:<mime>;base64,<payload>)", param=where)
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise OpenAIError(f"{where}: the data URL must be base64 encoded (data:<mime>;base64,...)", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OpenAIError(f"{where}: the data URL's base64 payload does not decode ({exc})", param=where) from exc


def extract_media(messages: list[dict]) -> tuple[list[bytes], list[bytes]]:
    """Images and videos of the chat, in prompt order (one per ``image_url`` / ``video_url`` part)."""
    images: list[bytes] = []
    videos: list[bytes] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in ("image_url", "video_url"):
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                (images if kind == "image_url" else videos).append(decode_data_url(url, kind.split("_")[0], where))
            elif kind in ("image", "video", "input_image"):
                raise OpenAIError(f"{where}: part type {kind!r} carries no data here; use "
                                  f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": \"data:...\"}}}}",
                                  param=where)
    return images, videos


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _byte_level_table()


class TokenBytes:
    """A token's exact UTF-8 bytes for OpenAI's ``bytes`` field: a byte-level BPE piece can hold part
    of a character, which its decoded text shows only as U+FFFD. Added (special) tokens are text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._added = set(getattr(tokenizer, "get_added_vocab", dict)().values()) if tokenizer is not None else set()

    def __call__(self, token_id: str | int, decoded: str) -> list[int]:
        if self._tok is not None and int(token_id) not in self._added:
            piece = self._tok.convert_ids_to_tokens(int(token_id))
            if isinstance(piece, str) and piece and all(ch in _BYTE_OF for ch in piece):
                return [_BYTE_OF[ch] for ch in piece]
        return list(decoded.encode("utf-8"))


def _top(entry: dict[str, dict]) -> list[tuple[str, dict]]:
    """A vLLM logprob entry's tokens sorted by rank (the sampled token first in the dict)."""
    return sorted(entry.items(), key=lambda kv: kv[1]["rank"])


def chat_logprobs(entries: list[dict], k: int, token_bytes: Any = None) -> list[dict]:
    """OpenAI chat ``logprobs.content`` from vLLM-shaped entries (sampled token, then the top ``k``)."""
    to_bytes = token_bytes or (lambda _tid, text: list(text.encode("utf-8")))
    out = []
    for e in entries:
        tid, rec = next(iter(e.items()))
        tok = rec["decoded_token"]
        tops = [{"token": r["decoded_token"], "logprob": r["logprob"], "bytes": to_bytes(t, r["decoded_token"])}
                for t, r in _top(e)[:k]] if k else []
        out.append({"token": tok, "logprob": rec["logprob"], "bytes": to_bytes(tid, tok), "top_logprobs": tops})
    return out


def completion_logprobs(entries: list[dict | None], k: int, offset: int) -> dict[str, list]:
    """OpenAI's legacy completions logprobs; ``None`` entries (the first prompt token) have no logprob."""
    res: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if e is None:
            continue
        tid, rec = next(iter(e.items()))
        res["tokens"].append(rec["decoded_token"])
        res["token_logprobs"].append(rec["logprob"])
        res["top_logprobs"].append({r["decoded_token"]: r["logprob"] for _, r in _top(e)[:k]} if k else None)
        res["text_offset"].append(offset)
        offset += len(rec["decoded_token"])
    return res


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class _ChoiceStream:
    """Per-choice parser state of a streamed chat completion."""

    reasoning: Glm5ReasoningParser | None
    tools: Glm5ToolParser | None
    finished: bool = False
    called: bool = False

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r2, c2 = self.reasoning.finish()
            reasoning, content = reasoning + r2, content + c2
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if self.tools is not None:
            step = self.tools.feed(content)
            if final:
                tail = self.tools.finish()
                step.content += tail.content
            content = step.content
            if step.tool_calls:
                delta["tool_calls"] = step.tool_calls
                self.called = True
        if content:
            delta["content"] = content
        return delta


class OpenAIServing:
    """The request handlers; ``tokenizer`` renders chat prompts, ``generator`` talks to Triton."""

    def __init__(self, generator: TritonGenerator, tokenizer: Any, served_model_name: str, max_model_len: int,
                 reasoning_parser: bool = True) -> None:
        self.generator, self.tokenizer = generator, tokenizer
        self.served_model_name, self.max_model_len = served_model_name, max_model_len
        self.reasoning_parser = reasoning_parser
        self.token_bytes = TokenBytes(tokenizer)
        self.created = int(time.time())

    # ------------------------------------------------------------------ shared
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": self.created,
                                            "owned_by": "glm5-triton", "max_model_len": self.max_model_len}]}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise OpenAIError(f"The model `{name}` does not exist; this server serves `{self.served_model_name}` "
                              "(see /v1/models)", status=404, param="model", code="model_not_found")

    def _max_tokens(self, limit: int | None, prompt_text: str | None, prompt_ids: list[int] | None) -> int:
        """The request's limit, else what the context leaves (vLLM's default; the engine still ends
        the sequence with ``length`` at ``max_model_len``)."""
        if limit is not None:
            return limit
        n = len(prompt_ids) if prompt_ids is not None else len(self.tokenizer.encode(prompt_text or "",
                                                                                      add_special_tokens=False))
        return max(1, self.max_model_len - n)

    @staticmethod
    async def _first(agen: AsyncIterator[GenerationUpdate]) -> GenerationUpdate:
        """The first response, before any HTTP byte goes out (so a rejected request gets its status)."""
        try:
            return await agen.__anext__()
        except TritonRequestError as exc:
            raise OpenAIError(exc.message, status=exc.status) from exc

    # ------------------------------------------------------------------ chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[bytes], list[bytes]]:
        images, videos = extract_media(req.messages)
        from glm5.tokenizer import render_chat

        try:
            prompt = render_chat(self.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
                                 tools=req.tools, **(req.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 (ValueError from normalisation, jinja errors from the template)
            raise OpenAIError(f"messages cannot be rendered with the chat template: {exc}", param="messages") from exc
        return prompt, images, videos

    def _chat_request(self, req: ChatCompletionRequest) -> tuple[GenerationRequest, str]:
        self.check_model(req.model)
        req.check_response_format()
        tc = req.tool_choice
        if tc == "required" or isinstance(tc, dict):
            raise OpenAIError("tool_choice 'required' or a named function needs structured output (constrained "
                              "decoding), which this server does not implement; use tool_choice 'auto' or 'none'",
                              param="tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt, images, videos = self._chat_prompt(req)
        sampling = req.common_sampling()
        sampling["max_tokens"] = self._max_tokens(req.output_limit, prompt, None)
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        return GenerationRequest(sampling=sampling, text=prompt, images=images, videos=videos, stream=req.stream,
                                 logprobs=req.logprobs), prompt

    def _parsers(self, req: ChatCompletionRequest, prompt: str) -> tuple[Glm5ReasoningParser | None,
                                                                           Glm5ToolParser | None]:
        reasoning = Glm5ReasoningParser(prompt_opens_reasoning(prompt)) if self.reasoning_parser else None
        tools = Glm5ToolParser(req.tools) if req.tools and req.tool_choice != "none" else None
        return reasoning, tools

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        gen_req, prompt = self._chat_request(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        agen = self.generator.generate(gen_req, request_id)
        first = await self._first(agen)
        if req.stream:
            return self._chat_stream(req, prompt, request_id, first, agen)
        return self._chat_full(req, prompt, request_id, first)

    def _chat_full(self, req: ChatCompletionRequest, prompt: str, request_id: str, u: GenerationUpdate) -> dict:
        choices = []
        for i, text in enumerate(u.texts):
            reasoning_p, tools_p = self._parsers(req, prompt)
            reasoning, content = reasoning_p.extract(text) if reasoning_p else (None, text)
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            reason = u.finish_reasons[i]
            if tools_p is not None and content:
                content, calls = tools_p.extract(content)
                msg["content"] = content
                if calls:
                    msg["tool_calls"] = [c.to_openai() for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choice: dict[str, Any] = {"index": i, "message": msg, "finish_reason": reason, "logprobs": None}
            if req.logprobs and u.logprobs and u.logprobs[i] is not None:
                choice["logprobs"] = {"content": chat_logprobs(u.logprobs[i], req.top_logprobs or 0, self.token_bytes)}
            choices.append(choice)
        out = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model":
               self.served_model_name, "choices": choices,
               "usage": usage(u.num_input_tokens, sum(u.num_output_tokens), u.num_cached_tokens)}
        if u.prompt_logprobs is not None:
            out["prompt_logprobs"] = u.prompt_logprobs
        return out

    async def _chat_stream(self, req: ChatCompletionRequest, prompt: str, request_id: str, first: GenerationUpdate,
                           agen: AsyncIterator[GenerationUpdate]) -> AsyncIterator[str]:
        created, include_usage = int(time.time()), req.include_usage()
        n = len(first.texts)
        states = [_ChoiceStream(*self._parsers(req, prompt)) for _ in range(n)]
        n_prompt, n_cached, n_out = first.num_input_tokens, first.num_cached_tokens, 0

        def chunk(choices: list[dict], usage_obj: dict | None = None) -> str:
            obj: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                   "model": self.served_model_name, "choices": choices}
            if include_usage:
                obj["usage"] = usage_obj
            return sse(obj)

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
            u: GenerationUpdate | None = first
            while u is not None:
                n_out += sum(u.num_output_tokens)
                n_prompt, n_cached = u.num_input_tokens or n_prompt, max(n_cached, u.num_cached_tokens)
                out = []
                for i, st in enumerate(states):
                    if st.finished:
                        continue
                    reason = u.finish_reasons[i] if i < len(u.finish_reasons) else None
                    delta = st.feed(u.texts[i], reason is not None)
                    lp = None
                    if req.logprobs and u.logprobs and u.logprobs[i]:
                        lp = {"content": chat_logprobs(u.logprobs[i], req.top_logprobs or 0, self.token_bytes)}
                    if reason is not None:
                        st.finished = True
                        if st.called and reason == "stop":
                            reason = "tool_calls"
                    if delta or lp or reason is not None:
                        out.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason})
                if out:
                    yield chunk(out)
                if u.final:
                    break
                try:
                    u = await agen.__anext__()
                except StopAsyncIteration:
                    u = None
            if include_usage:
                yield chunk([], usage(n_prompt, n_out, n_cached))
        except TritonRequestError as exc:
            yield sse(OpenAIError(exc.message, status=exc.status).to_json())
        finally:
            await agen.aclose()
        yield sse("[DONE]")

    # ------------------------------------------------------------------ completions
    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int] | None]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, None)]
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [(x, None) for x in p]
        if isinstance(p, list) and p and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x)
                                             for x in p):
            return [(None, list(x)) for x in p]
        raise OpenAIError("prompt must be a non-empty string, list of strings, list of token ids or list of token id "
                          "lists", param="prompt")

    def _completion_requests(self, req: CompletionRequest) -> list[tuple[GenerationRequest, str]]:
        self.check_model(req.model)
        req.check_response_format()
        if req.suffix:
            raise OpenAIError("suffix (insertion) is not supported by this model", param="suffix")
        if req.best_of is not None and req.best_of < req.n:
            raise OpenAIError(f"best_of={req.best_of} must be >= n={req.n}", param="best_of")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise OpenAIError("best_of > n cannot stream (the best candidates are known only at the end)",
                              param="best_of")
        out = []
        for text, ids in self._prompts(req):
            sampling = req.common_sampling()
            sampling["max_tokens"] = self._max_tokens(req.output_limit, text, ids)
            if req.best_of is not None:
                sampling["best_of"] = req.best_of
            if req.logprobs is not None:
                sampling["logprobs"] = req.logprobs
                if req.echo:
                    sampling["prompt_logprobs"] = req.logprobs
            echo = (text if text is not None else self.tokenizer.decode(ids)) if req.echo else ""
            out.append((GenerationRequest(sampling=sampling, text=text, token_ids=ids, stream=req.stream,
                                          logprobs=req.logprobs is not None), echo))
        return out

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        reqs = self._completion_requests(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        agens = [self.generator.generate(g, f"{request_id}-{k}") for k, (g, _) in enumerate(reqs)]
        try:
            firsts = list(await asyncio.gather(*(self._first(a) for a in agens)))
        except BaseException:
            for a in agens:
                await a.aclose()
            raise
        if req.stream:
            return self._completion_stream(req, request_id, reqs, firsts, agens)
        return self._completion_full(req, request_id, reqs, firsts)

    def _completion_full(self, req: CompletionRequest, request_id: str, reqs: list, firsts: list) -> dict:
        choices, n_prompt, n_out, n_cached = [], 0, 0, 0
        for k, ((_, echo), u) in enumerate(zip(reqs, firsts)):
            n_prompt += u.num_input_tokens
            n_cached += u.num_cached_tokens
            n_out += sum(u.num_output_tokens)
            for i, text in enumerate(u.texts):
                lp = None
                if req.logprobs is not None and u.logprobs and u.logprobs[i] is not None:
                    entries = (u.prompt_logprobs or []) + u.logprobs[i] if echo else u.logprobs[i]
                    lp = completion_logprobs(entries, req.logprobs, 0)
                choices.append({"index": k * req.n + i, "text": echo + text, "finish_reason": u.finish_reasons[i],
                                "logprobs": lp})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.served_model_name, "choices": choices, "usage": usage(n_prompt, n_out, n_cached)}

    async def _completion_stream(self, req: CompletionRequest, request_id: str, reqs: list, firsts: list,
                                 agens: list) -> AsyncIterator[str]:
        created, include_usage = int(time.time()), req.include_usage()
        queue: asyncio.Queue = asyncio.Queue()
        totals = {"prompt": 0, "out": 0, "cached": 0}

        async def pump(k: int) -> None:
            u = firsts[k]
            try:
                while True:
                    await queue.put((k, u, None))
                    if u.final:
                        break
                    u = await agens[k].__anext__()
            except StopAsyncIteration:
                pass
            except TritonRequestError as exc:
                await queue.put((k, None, exc))
            await queue.put((k, None, None))

        def chunk(choices: list[dict], usage_obj: dict | None = None) -> str:
            obj: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                   "model": self.served_model_name, "choices": choices}
            if include_usage:
                obj["usage"] = usage_obj
            return sse(obj)

        tasks = [asyncio.ensure_future(pump(k)) for k in range(len(agens))]
        sent_echo: set[int] = set()
        try:
            open_ = len(agens)
            while open_:
                k, u, exc = await queue.get()
                if exc is not None:
                    yield sse(OpenAIError(exc.message, status=exc.status).to_json())
                    continue
                if u is None:
                    open_ -= 1
                    continue
                totals["out"] += sum(u.num_output_tokens)
                if u is firsts[k]:
                    totals["prompt"] += u.num_input_tokens
                    totals["cached"] += u.num_cached_tokens
                out = []
                for i, text in enumerate(u.texts):
                    idx = k * req.n + i
                    if idx not in sent_echo:
                        sent_echo.add(idx)
                        text = reqs[k][1] + text
                    lp = None
                    if req.logprobs is not None and u.logprobs and u.logprobs[i]:
                        lp = completion_logprobs(u.logprobs[i], req.logprobs, 0)
                    if text or lp or u.finish_reasons[i] is not None:
                        out.append({"index": idx, "text": text, "finish_reason": u.finish_reasons[i], "logprobs": lp})
                if out:
                    yield chunk(out)
            if include_usage:
                yield chunk([], usage(totals["prompt"], totals["out"], totals["cached"]))
        finally:
            for t in tasks:
                t.cancel()
            for a in agens:
                await a.aclose()
        yield sse("[DONE]")
