"""Incremental detokenizer (UTF-8 safety, special tokens, bounded work), stop strings, finish reasons.

The tokenizer is a small byte-level BPE trained here on text with accents, CJK and emoji, so
that many characters span several tokens (asserted, so the tests cannot pass vacuously).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glm5.detokenizer import (
    MAX_PENDING_TOKENS,
    FinishReason,
    IncrementalDetokenizer,
    RequestOutputProcessor,
    StopChecker,
)
from glm5.sampling_params import SamplingParams

_CORPUS = [
    "Héllo wörld, café naïve résumé, déjà vu. Ünïcödé ✓ ½ — “quotes” and plain ASCII text.",
    "你好世界，今天天气很好。我们一起去公园散步吧。日本語のテキストも少し。한국어 텍스트.",
    "Emoji time 😀🎉👍🏽 🚀 family: 👨‍👩‍👧 flags 🇫🇷 and more 🤖 words after emoji.",
    "The quick brown fox jumps over the lazy dog. STOP signs and stoplights. END of story.",
]
_SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
_TEXTS = [
    "Hello 😀 你好 café 👍🏽 end",
    "日本語のテキスト🚀🤖 naïve résumé 한국어",
    "family 👨‍👩‍👧 flags 🇫🇷 ✓ ½ — “ok”",
]


def _make_tokenizer(metaspace: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    if metaspace:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=_SPECIALS, show_progress=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=_SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    tok.train_from_iterator(_CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=_SPECIALS[1:])


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _make_tokenizer()


def _decode(tok: Any, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(tok: Any, prompt: list[int], ids: list[int], chunks: list[int] | None = None, skip: bool = True) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas: list[str] = []
    pos = 0
    for size in chunks or [1] * len(ids):
        deltas.append(d.add_tokens(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    deltas.append(d.flush())
    assert "".join(deltas) == d.output_text
    return deltas


# ----------------------------------------------------------------------------- detokenizer
def test_characters_really_span_several_tokens(tok: PreTrainedTokenizerFast) -> None:
    for text in _TEXTS:
        ids = tok.encode(text)
        assert any("\ufffd" in _decode(tok, [i]) for i in ids), text


@pytest.mark.parametrize("text", _TEXTS)
def test_token_by_token_equals_full_decode_without_replacement_chars(tok: PreTrainedTokenizerFast, text: str) -> None:
    prompt = tok.encode("User: 你好 😀 say something")
    ids = tok.encode(text)
    deltas = _stream(tok, prompt, ids)
    assert "".join(deltas) == _decode(tok, ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 3  # it really streams


def test_random_chunking_equals_full_decode(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    ids = tok.encode(" ".join(_TEXTS))
    for _ in range(20):
        chunks: list[int] = []
        left = len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 5)))
            left -= chunks[-1]
        deltas = _stream(tok, [], ids, chunks)
        assert "".join(deltas) == " ".join(_TEXTS)
        assert not any("\ufffd" in d for d in deltas)


def test_chunks_ending_mid_character_stream_promptly(tok: PreTrainedTokenizerFast) -> None:
    """Every chunk ends inside a character: complete text before it must still go out at once."""
    text = "你好世界，今天天气很好。日本語のテキスト😀🎉 한국어 텍스트" * 4
    ids = tok.encode(text)
    mid_char = [k for k in range(1, len(ids)) if _decode(tok, ids[:k]).endswith("\ufffd")]
    assert len(mid_char) > 40
    cuts = [k for k in mid_char if k % 3 == 0 or k % 5 == 0] + [len(ids)]
    d = IncrementalDetokenizer(tok, [])
    pos = 0
    for cut in cuts:
        if cut <= pos:
            continue
        delta = d.add_tokens(ids[pos:cut])
        pos = cut
        assert "\ufffd" not in delta
        complete = _decode(tok, ids[:pos]).rstrip("\ufffd")
        assert text.startswith(d.output_text)
        assert len(complete) - len(d.output_text) <= 1  # only the unfinished character is held
    d.flush()
    assert d.output_text == text


def test_skip_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    user = tok.convert_tokens_to_ids("<|user|>")
    eos = tok.eos_token_id
    ids = tok.encode("Hi 😀") + [user] + tok.encode(" 你好") + [eos, user] + tok.encode("end")
    skipped = "".join(_stream(tok, [], ids, skip=True))
    kept = "".join(_stream(tok, [], ids, skip=False))
    assert skipped == _decode(tok, ids, skip=True) == "Hi 😀 你好end"
    assert kept == _decode(tok, ids, skip=False) == "Hi 😀<|user|> 你好<|endoftext|><|user|>end"


def test_invalid_bytes_are_flushed_and_work_stays_bounded(tok: PreTrainedTokenizerFast) -> None:
    emoji = tok.encode("😀")
    lead = emoji[0]  # a token that alone is an incomplete UTF-8 sequence
    assert _decode(tok, [lead]).endswith("\ufffd")
    ids = [lead] * (MAX_PENDING_TOKENS + 5) + tok.encode(" ok") + [lead]
    d = IncrementalDetokenizer(tok, [])
    out = []
    for i in ids:
        out.append(d.add_tokens([i]))
        assert d.num_pending_tokens <= MAX_PENDING_TOKENS + 1
    out.append(d.flush())
    assert "".join(out) == _decode(tok, ids)  # garbage in, the same garbage out


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees (it has only ``decode``, so the
    detokenizer takes its window path: no ``backend_tokenizer`` to stream with)."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kw: Any) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens, **kw)


def test_work_per_call_is_proportional_to_new_tokens(tok: PreTrainedTokenizerFast) -> None:
    counting = _CountingTokenizer(tok)
    ids = tok.encode(" ".join(_TEXTS * 8))
    assert len(ids) > 300
    prompt = tok.encode(" ".join(_CORPUS))
    d = IncrementalDetokenizer(counting, prompt)
    for i in ids:
        d.add_tokens([i])
    d.flush()
    assert d.output_text == _decode(tok, ids)
    # context (<= 5 tokens) + the few tokens of one incomplete character, never the sequence
    assert max(counting.sizes) <= 10


def test_context_sensitive_decoder_streams_correctly() -> None:
    """A Metaspace decoder strips the first token's leading space: the window context fixes it."""
    ms = _make_tokenizer(metaspace=True)
    prompt = ms.encode("the quick brown")
    ids = ms.encode("fox jumps over the lazy dog")
    assert _decode(ms, ids[:1]) != _decode(ms, prompt + ids[:1])[len(_decode(ms, prompt)) :]  # precondition
    deltas = _stream(ms, prompt, ids)
    full = _decode(ms, prompt + ids)
    assert "".join(deltas) == full[len(_decode(ms, prompt)) :]


# ----------------------------------------------------------------------------- stop strings
def _feed(checker: StopChecker, pieces: list[str]) -> tuple[list[str], str | None]:
    out = []
    for piece in pieces:
        emit, matched = checker.process(piece)
        out.append(emit)
        if matched:
            return out, matched
    out.append(checker.flush())
    return out, None


def test_stop_checker_holds_back_only_possible_prefixes() -> None:
    c = StopChecker(["STOP"])
    assert c.process("abc S") == ("abc ", None)
    assert c.held_text == "S"
    assert c.process("T") == ("", None)
    assert c.process("x") == ("STx", None)  # disambiguated: released
    assert c.process("ST") == ("", None)
    assert c.process("OP and more") == ("", "STOP")


def test_stop_checker_earliest_ending_match_wins_and_is_chunking_invariant() -> None:
    text = "xxabcdyy"
    for chunks in (["xxabcdyy"], list(text), ["xxa", "bc", "dyy"]):
        out, matched = _feed(StopChecker(["bcd", "c"]), chunks)
        assert ("".join(out), matched) == ("xxab", "c")
        out, matched = _feed(StopChecker(["bcd", "c"], include_stop_str_in_output=True), chunks)
        assert ("".join(out), matched) == ("xxabc", "c")


def test_stop_checker_without_match_emits_everything() -> None:
    out, matched = _feed(StopChecker(["<end>", "###"]), ["a <en", "d #", "# done <", "e"])
    assert matched is None and "".join(out) == "a <end ## done <e"


def _run(tok: Any, text_or_ids: str | list[int], params: SamplingParams, eos: list[int] | None = None) -> tuple[list[str], RequestOutputProcessor]:
    ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    proc = RequestOutputProcessor(tok, tok.encode("prompt"), params, eos if eos is not None else [tok.eos_token_id])
    deltas = []
    for i in ids:
        step = proc.add_tokens([i])
        deltas.append(step.text)
        if step.finished:
            break
    return deltas, proc


def test_stop_string_split_across_tokens_is_excluded(tok: PreTrainedTokenizerFast) -> None:
    text = "Hello 你好 STOP world"
    ids = tok.encode(text)
    stop_tokens = [i for i in ids if any(c in _decode(tok, [i]) for c in "STOP")]
    assert len(stop_tokens) > 1  # the stop string spans several tokens
    deltas, proc = _run(tok, text, SamplingParams(stop=["STOP"], max_tokens=100))
    assert "".join(deltas) == proc.text == "Hello 你好 "
    assert proc.finish_reason is FinishReason.STOP and proc.stop_reason == "STOP"
    assert len(proc.output_token_ids) < len(ids)
    assert not any("S" in d for d in deltas)

    deltas, proc = _run(tok, text, SamplingParams(stop=["STOP"], include_stop_str_in_output=True, max_tokens=100))
    assert proc.text == "Hello 你好 STOP" and proc.stop_reason == "STOP"


def test_stop_prefix_lookalike_is_emitted_once_disambiguated(tok: PreTrainedTokenizerFast) -> None:
    text = "a ST b STOx c"
    deltas, proc = _run(tok, text, SamplingParams(stop=["STOP"], max_tokens=100))
    emitted, history = "", []
    for d in deltas:
        emitted += d
        history.append(emitted)
        assert not emitted.endswith(("S", "ST", "STO"))  # a possible stop start is never shown early
    assert proc.finish_reason is None and proc.text == text
    # released as soon as the following text rules STOP out, not only at the end
    assert any(h.startswith("a ST b") and not h.startswith("a ST b STOx c") for h in history)
    assert any(h.startswith("a ST b STOx") for h in history[:-1])


def test_stop_strings_are_ignored_within_min_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("ab cd ab cd")
    first_ab_end = len(tok.encode("ab"))
    _, proc = _run(tok, ids, SamplingParams(stop=["ab"], min_tokens=first_ab_end, max_tokens=100))
    assert proc.finish_reason is FinishReason.STOP and proc.text == "ab cd "
    _, proc = _run(tok, ids, SamplingParams(stop=["ab"], max_tokens=100))
    assert proc.finish_reason is FinishReason.STOP and proc.text == ""


def test_held_back_prefix_is_flushed_at_length(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("end ST")
    deltas, proc = _run(tok, ids, SamplingParams(stop=["STOP"], max_tokens=len(ids)))
    assert proc.finish_reason is FinishReason.LENGTH and proc.stop_reason is None
    assert "".join(deltas) == "end ST"
    assert not deltas[-2].endswith("S")  # it was held while it could still become STOP


# ----------------------------------------------------------------------------- token-level stops
def test_eos_stops_and_is_not_in_text(tok: PreTrainedTokenizerFast) -> None:
    eos = tok.eos_token_id
    ids = tok.encode("ok 😀") + [eos] + tok.encode(" more")
    deltas, proc = _run(tok, ids, SamplingParams(skip_special_tokens=False, max_tokens=100))
    assert proc.text == "ok 😀" and proc.finish_reason is FinishReason.STOP and proc.stop_reason is None
    assert proc.output_token_ids[-1] == eos


def test_ignore_eos_and_min_tokens(tok: PreTrainedTokenizerFast) -> None:
    eos = tok.eos_token_id
    ids = tok.encode("ab") + [eos] + tok.encode("cd")
    _, proc = _run(tok, ids, SamplingParams(ignore_eos=True, max_tokens=100))
    assert proc.finish_reason is None and proc.text == "abcd"
    _, proc = _run(tok, ids, SamplingParams(min_tokens=len(ids), max_tokens=100))
    assert proc.finish_reason is None  # EOS inside min_tokens is not a stop
    _, proc = _run(tok, ids, SamplingParams(max_tokens=100))
    assert proc.finish_reason is FinishReason.STOP and proc.text == "ab"


def test_stop_token_ids(tok: PreTrainedTokenizerFast) -> None:
    user = tok.convert_tokens_to_ids("<|user|>")
    ids = tok.encode("hi") + [user] + tok.encode("x")
    _, proc = _run(tok, ids, SamplingParams(stop_token_ids=[user], skip_special_tokens=False, max_tokens=100))
    assert proc.finish_reason is FinishReason.STOP and proc.stop_reason == user and proc.text == "hi"
    _, proc = _run(
        tok, ids, SamplingParams(stop_token_ids=[user], skip_special_tokens=False, include_stop_str_in_output=True, max_tokens=100)
    )
    assert proc.text == "hi<|user|>" and proc.stop_reason == user


def test_max_tokens_gives_length_with_pending_utf8_flushed(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("abc 😀")
    # stop in the middle of the emoji: the partial character is flushed as U+FFFD at the end
    deltas, proc = _run(tok, ids, SamplingParams(max_tokens=len(ids) - 1))
    assert proc.finish_reason is FinishReason.LENGTH
    assert proc.text == _decode(tok, ids[:-1]) and proc.text.endswith("\ufffd")
    assert not any("\ufffd" in d for d in deltas[:-1])


def test_multi_token_step_stops_at_first_finishing_token(tok: PreTrainedTokenizerFast) -> None:
    eos = tok.eos_token_id
    a, b = tok.encode("xy")[:2]
    proc = RequestOutputProcessor(tok, [], SamplingParams(max_tokens=100), [eos])
    step = proc.add_tokens([a, eos, b])
    assert step.num_accepted == 2 and step.finish_reason is FinishReason.STOP
    assert proc.output_token_ids == [a, eos]
    with pytest.raises(RuntimeError, match="already finished"):
        proc.add_tokens([b])
    proc2 = RequestOutputProcessor(tok, [], SamplingParams(max_tokens=2), [eos])
    step = proc2.add_tokens([a, b, a])
    assert step.num_accepted == 2 and step.finish_reason is FinishReason.LENGTH and str(step.finish_reason) == "length"


def test_abort(tok: PreTrainedTokenizerFast) -> None:
    proc = RequestOutputProcessor(tok, [], SamplingParams(), [tok.eos_token_id])
    proc.add_tokens(tok.encode("a"))
    assert proc.abort().finish_reason is FinishReason.ABORT and FinishReason.ABORT == "abort"


@pytest.mark.parametrize("metaspace", [False, True])
def test_library_stream_gives_the_window_paths_deltas(metaspace: bool) -> None:
    """With a fast tokenizer the deltas come from ``tokenizers``' DecodeStream; token by token and in random
    chunks, with and without special tokens, they add up to the text the whole sequence decodes to after the
    prompt, and the stream makes no HF ``decode`` call per token. Byte-level BPE: the window path gives the
    same text and the stream emits it no later. (Metaspace after a skipped special token: the window path,
    whose context then decodes to nothing, drops the next token's leading space; the stream keeps it, as the
    whole sequence's decode does.)"""
    tk = _make_tokenizer(metaspace=metaspace)
    rng = random.Random(3)
    prompt = tk.encode("the quick <|user|> brown")
    for skip in (True, False):
        for text in _TEXTS + ["<|user|>" + _TEXTS[1] + "<|endoftext|> tail", " ".join(_CORPUS)]:
            ids = tk.encode(text)
            chunks = [1] * len(ids)
            if rng.random() < 0.5:
                chunks, left = [], len(ids)
                while left:
                    chunks.append(min(left, rng.randint(1, 4)))
                    left -= chunks[-1]
            fast = _stream(tk, prompt, ids, chunks, skip)
            assert "".join(fast) == _decode(tk, prompt + ids, skip)[len(_decode(tk, prompt, skip)):], (text, skip)
            if not metaspace:
                window = _stream(_CountingTokenizer(tk), prompt, ids, chunks, skip)
                assert "".join(window) == "".join(fast)
                for k in range(len(fast)):
                    assert "".join(fast[: k + 1]).startswith("".join(window[: k + 1])), (text, k)
    calls = []
    orig = tk.decode
    tk.decode = lambda *a, **kw: calls.append(1) or orig(*a, **kw)  # type: ignore[method-assign]
    try:
        d = IncrementalDetokenizer(tk, prompt)
        before = len(calls)
        ids = tk.encode(_TEXTS[0] * 4)
        for i in ids:
            d.add_tokens([i])
        assert len(calls) == before
    finally:
        tk.decode = orig  # type: ignore[method-assign]
    assert d.output_text == _decode(tk, prompt + ids)[len(_decode(tk, prompt)):]


def test_a_context_ending_mid_character_is_not_emitted(tok: PreTrainedTokenizerFast) -> None:
    """A prompt cut inside a character, or whose text ends in U+FFFD before skipped special tokens: the output
    is what the window path gives (the context's text is never part of it)."""
    ids = tok.encode("Hello 😀 end")
    cut = tok.encode("abc 😀😀")
    prompts = [cut[: next(k for k in range(1, len(cut)) if _decode(tok, cut[:k]).endswith("\ufffd"))],
               [tok.convert_tokens_to_ids("<|user|>")] + tok.encode("what is this \ufffd")
               + [tok.convert_tokens_to_ids("<|assistant|>")]]
    for prompt in prompts:
        for chunks in (None, [3] * (len(ids) // 3) + [len(ids) % 3] * bool(len(ids) % 3)):
            window = _stream(_CountingTokenizer(tok), prompt, ids, chunks)
            assert "".join(_stream(tok, prompt, ids, chunks)) == "".join(window)
