"""GLM reasoning (``<think>...</think>``) in model text -> OpenAI-style ``reasoning_content``.

GLM models think between ``<think>`` and ``</think>`` before answering (vLLM's ``glm45`` parser).
When the prompt already opened the block (the chat template's ``enable_thinking=true`` ends the
generation prompt with ``<think>``, as GLM-4.7/5 do by default) the output starts inside it;
otherwise reasoning starts where the model writes ``<think>``, and text before it is content.
Only the first block is reasoning. A block that never closes (the output hit ``max_tokens``
while thinking) is all reasoning. Streaming holds back a tail that could be the start of a tag.
"""

from __future__ import annotations

from glm5.entrypoints.openai.tool_parser import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class Glm5ReasoningParser:
    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "before"
        self._start_in = starts_in_reasoning
        self._buf = ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        if self._start_in:
            head, sep, tail = text.partition(THINK_END)
            return (head or None), ((tail or None) if sep else None)
        before, sep, rest = text.partition(THINK_START)
        if not sep:
            return None, text or None
        reasoning, _, tail = rest.partition(THINK_END)
        return (reasoning or None), ((before + tail) or None)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one streamed text delta."""
        self._buf += delta
        reasoning, content = "", ""
        while self._buf:
            if self._state == "after":
                content += self._buf
                self._buf = ""
                break
            tag = THINK_START if self._state == "before" else THINK_END
            i = self._buf.find(tag)
            if i == -1:
                keep = partial_suffix(self._buf, tag)
                emit, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if self._state == "before":
                    content += emit
                else:
                    reasoning += emit
                break
            if self._state == "before":
                content += self._buf[:i]
                self._state = "reasoning"
            else:
                reasoning += self._buf[:i]
                self._state = "after"
            self._buf = self._buf[i + len(tag):]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush a held-back partial tag."""
        buf, self._buf = self._buf, ""
        return (buf, "") if self._state == "reasoning" else ("", buf)
