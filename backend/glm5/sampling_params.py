"""Per-request sampling parameters with vLLM's names and meanings.

Clients talk to this server with the vocabulary of the Triton vLLM backend (a JSON
``sampling_parameters`` string; genai-perf sends every value as a *string*, e.g.
``{"max_tokens": "32"}``), so the field names and semantics follow vLLM's ``SamplingParams``:

* ``temperature`` 0 (anything below ``GREEDY_TEMPERATURE_EPS``) means greedy decoding; then
  ``top_k``/``top_p``/``min_p`` and ``seed`` have no effect.
* ``top_k`` 0 or -1 disables top-k; ``top_p`` 1 and ``min_p`` 0 disable those filters.
* ``repetition_penalty`` (1 = off) applies to tokens seen in the prompt *or* the output;
  ``presence_penalty`` / ``frequency_penalty`` (0 = off) only to output tokens.
* ``max_tokens`` defaults to 16 exactly like vLLM: a request that forgets it gets a short
  answer rather than occupying a batch slot until the context is full. The engine enforces its
  own configured cap on top of this.
* ``min_tokens``: EOS and ``stop_token_ids`` are masked until that many tokens exist, and stop
  strings are not searched before then.
* ``logprobs``: ``None`` = none; ``n`` in 0..20 = the sampled token's logprob plus the top ``n``
  alternatives (raw logprobs, see :mod:`glm5.sampler`). A JSON boolean is read the way vllm_backend
  reads it for Triton's OpenAI frontend: ``false`` = none, ``true`` = 1.
* ``prompt_logprobs``: ``None`` = none; ``k`` in 0..20 = the logprob of every prompt token after the
  first (given the tokens before it) plus the top ``k`` alternatives at each position.
* ``n`` / ``best_of``: ``n`` independent sequences per request (``best_of`` >= ``n`` candidates, the
  ``n`` with the highest cumulative logprob are returned). The engine runs one sequence per
  request: serving layers fan a request out with :meth:`SamplingParams.for_sequence`, which gives
  sequence ``i`` the seed ``seed + i`` (vLLM's rule), so a seeded request is reproducible.
* ``logit_bias`` (token id -> added logit) and ``allowed_token_ids`` (only these may be sampled)
  are applied to the logits before the penalties, as vLLM's logits processors do.
* ``truncate_prompt_tokens``: keep only the last ``k`` prompt tokens (``-1`` = as many as
  ``max_model_len`` allows).
* ``bad_words``: words that must not be generated. Like vLLM, each word is tokenized as is and with
  a leading space, and the last token of such a sequence is banned whenever the output so far ends
  with the sequence's other tokens (a one-token word is always banned).

Keys vLLM's ``SamplingParams`` has that change nothing here are accepted and documented in
:data:`NO_EFFECT_KEYS`; keys whose feature this engine does not have are rejected with the reason
(:data:`UNSUPPORTED_KEYS`) rather than silently ignored.

Invalid values raise :class:`SamplingParamsError` (a ``ValueError``) naming the parameter, the
value and the accepted range, so the Triton model can answer ``INVALID_ARG`` with that message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Temperatures below this are treated as greedy (vLLM uses the same epsilon): dividing logits by
#: such a small number overflows fp32 and the result is argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

#: Largest ``logprobs`` value accepted (vLLM's default ``max_logprobs`` is 20).
MAX_LOGPROBS = 20

#: Largest ``n`` / ``best_of`` (each sequence is one engine request).
MAX_SEQUENCES = 64

#: Largest absolute ``logit_bias`` value (OpenAI's range; a larger bias cannot change the result).
MAX_LOGIT_BIAS = 100.0

#: vLLM ``SamplingParams`` keys that are accepted and have no effect here, with the reason.
NO_EFFECT_KEYS: dict[str, str] = {
    "spaces_between_special_tokens": "the GLM tokenizer is a fast tokenizer, whose decode ignores it (as in vLLM)",
    "output_kind": "the Triton response protocol fixes the output form (deltas when streaming, one response otherwise)",
    "flat_logprobs": "an in-process container choice of vLLM; the logprobs output JSON is the same",
    "extra_args": "reserved by vLLM for custom sampling plugins; nothing in-tree reads it",
    "skip_clone": "an internal vLLM flag",
}

#: vLLM keys that name a feature this engine does not implement: rejected with these reasons.
UNSUPPORTED_KEYS: dict[str, str] = {
    "structured_outputs": "structured output (JSON schema / regex / grammar constrained decoding) is not implemented",
    "guided_decoding": "guided (structured) decoding is not implemented",
    "guided_json": "guided (structured) decoding is not implemented",
    "guided_regex": "guided (structured) decoding is not implemented",
    "guided_choice": "guided (structured) decoding is not implemented",
    "guided_grammar": "guided (structured) decoding is not implemented",
    "use_beam_search": "beam search is not implemented (vLLM removed it from SamplingParams too)",
    "length_penalty": "beam search is not implemented",
    "early_stopping": "beam search is not implemented",
    "logits_processors": "custom logits processors are Python callables and cannot be sent in a request",
    "lora_name": "LoRA feature is not enabled (this model serves no LoRA adapters)",
}

#: Accepted seeds: the non-negative int64 range (what OpenAI-style clients and INT64 tensors carry).
#: ``torch.Generator.manual_seed`` takes [-2**63, 2**64) but folds negative seeds onto the top of the
#: uint64 range (-1 and 2**64-1 give the same stream), so both ends outside [0, 2**63) are refused.
_SEED_MIN = 0
_SEED_MAX = 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter with a bad value or type; the message names parameter, value, range."""


def _err(name: str, value: Any, expected: str) -> SamplingParamsError:
    return SamplingParamsError(f"sampling parameter {name!r} = {value!r} is invalid: expected {expected}.")


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM semantics; see the module docstring).

    Construction validates (``__post_init__`` calls :meth:`validate`) and normalises ``stop``
    to a list of strings, so an existing instance is always valid unless mutated afterwards;
    call :meth:`validate` again after mutating.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    # ------------------------------------------------------------------ derived properties
    @property
    def is_greedy(self) -> bool:
        """True when the request decodes with argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (always a list after construction)."""
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def needs_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def for_sequence(self, index: int) -> "SamplingParams":
        """The parameters of sequence ``index`` of an ``n`` / ``best_of`` request: one sequence,
        seed ``seed + index`` (vLLM's parallel-sampling rule; unseeded stays unseeded)."""
        if not 0 <= index < self.num_sequences:
            raise ValueError(f"sequence index {index} is outside [0, {self.num_sequences})")
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > _SEED_MAX:
            seed -= _SEED_MAX - _SEED_MIN + 1
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`SamplingParamsError` for the first invalid field.

        ``vocab_size`` (optional, known to the engine) additionally bounds ``stop_token_ids``.
        """
        _check_float("temperature", self.temperature, lo=0.0, lo_open=False, desc="a finite number >= 0 (0 = greedy)")
        _check_int("top_k", self.top_k, desc="an integer >= 1, or 0 / -1 to disable top-k")
        if self.top_k < -1:
            raise _err("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable top-k")
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0, desc="a number in (0, 1] (1 = disabled)")
        _check_float("min_p", self.min_p, lo=0.0, lo_open=False, hi=1.0, desc="a number in [0, 1] (0 = disabled)")
        if self.seed is not None:
            _check_int("seed", self.seed, desc=f"null or an integer in [{_SEED_MIN}, {_SEED_MAX}]")
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise _err("seed", self.seed, f"null or an integer in [{_SEED_MIN}, {_SEED_MAX}]")
        _check_int("max_tokens", self.max_tokens, desc="an integer >= 1")
        if self.max_tokens < 1:
            raise _err("max_tokens", self.max_tokens, "an integer >= 1")
        _check_int("min_tokens", self.min_tokens, desc="an integer >= 0 and <= max_tokens")
        if self.min_tokens < 0:
            raise _err("min_tokens", self.min_tokens, "an integer >= 0 and <= max_tokens")
        if self.min_tokens > self.max_tokens:
            raise _err("min_tokens", self.min_tokens, f"an integer >= 0 and <= max_tokens (= {self.max_tokens})")
        if not isinstance(self.stop, list):
            raise _err("stop", self.stop, "a string or a list of non-empty strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _err("stop", self.stop, "a string or a list of non-empty strings (got an empty or non-string entry)")
        if not isinstance(self.stop_token_ids, list):
            raise _err("stop_token_ids", self.stop_token_ids, "a list of non-negative integer token ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise _err("stop_token_ids", self.stop_token_ids, f"a list of non-negative integer token ids (bad entry {t!r})")
            if vocab_size is not None and t >= vocab_size:
                raise _err("stop_token_ids", self.stop_token_ids, f"token ids < vocab size {vocab_size} (bad entry {t})")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True, desc="a finite number > 0 (1 = disabled)")
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, lo_open=False, hi=2.0, desc="a number in [-2, 2] (0 = disabled)")
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, lo_open=False, hi=2.0, desc="a number in [-2, 2] (0 = disabled)")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, desc=f"null or an integer in [0, {MAX_LOGPROBS}]")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise _err("logprobs", self.logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]")
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("detokenize", self.detokenize)
        _check_int("n", self.n, desc=f"an integer in [1, {MAX_SEQUENCES}]")
        if not 1 <= self.n <= MAX_SEQUENCES:
            raise _err("n", self.n, f"an integer in [1, {MAX_SEQUENCES}]")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, desc=f"null or an integer in [n, {MAX_SEQUENCES}]")
            if not self.n <= self.best_of <= MAX_SEQUENCES:
                raise _err("best_of", self.best_of, f"null or an integer in [n (= {self.n}), {MAX_SEQUENCES}]")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, desc=f"null or an integer in [0, {MAX_LOGPROBS}]")
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise _err("prompt_logprobs", self.prompt_logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _err("logit_bias", self.logit_bias, "an object mapping token ids to biases")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    bound = f" < vocab size {vocab_size}" if vocab_size is not None else ""
                    raise _err("logit_bias", {t: b}, f"token ids >= 0{bound} as keys (bad key {t!r})")
                if not _is_real(b) or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS:
                    raise _err("logit_bias", {t: b}, f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise _err("allowed_token_ids", self.allowed_token_ids, "null or a non-empty list of token ids")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise _err("allowed_token_ids", self.allowed_token_ids, f"token ids in the vocabulary (bad entry {t!r})")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise _err("bad_words", self.bad_words, "null or a list of non-empty strings")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, desc="null, -1, or an integer >= 1")
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise _err("truncate_prompt_tokens", self.truncate_prompt_tokens, "null, -1, or an integer >= 1")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def field_names(cls) -> list[str]:
        """The accepted keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a JSON-like mapping (Triton ``sampling_parameters``), coercing strings.

        Each value is coerced by its field's type: ``"32"`` -> 32 for integer fields, ``"0.7"`` ->
        0.7 for float fields, ``"true"``/``"false"`` (also ``"1"``/``"0"``) -> bool, ``null`` or
        ``"null"``/``"none"`` -> ``None`` for optional fields. A JSON-encoded list is accepted for
        ``stop_token_ids`` / ``stop`` when it arrives as a string starting with ``[``. Keys in
        :data:`NO_EFFECT_KEYS` are accepted and dropped; keys in :data:`UNSUPPORTED_KEYS` and
        unknown keys are rejected with the reason or the list of valid ones.
        """
        if not isinstance(d, Mapping):
            raise SamplingParamsError(f"sampling parameters must be a JSON object, got {type(d).__name__}: {d!r}")
        valid = cls.field_names()
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in NO_EFFECT_KEYS:
                continue
            if key in UNSUPPORTED_KEYS and value is not None:
                raise SamplingParamsError(f"sampling parameter {key!r} is not supported: {UNSUPPORTED_KEYS[key]}.")
            if key in UNSUPPORTED_KEYS:
                continue
            if key not in _COERCERS:
                raise SamplingParamsError(
                    f"unknown sampling parameter {key!r} (value {value!r}); valid parameters: {', '.join(valid)}."
                )
            kwargs[key] = _COERCERS[key](key, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- field checks
def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_float(name: str, value: Any, *, lo: float, lo_open: bool, hi: float | None = None, desc: str) -> None:
    if not _is_real(value) or not math.isfinite(value):
        raise _err(name, value, desc)
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise _err(name, value, desc)


def _check_int(name: str, value: Any, *, desc: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(name, value, desc)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _err(name, value, "true or false")


# ---------------------------------------------------------------------- coercion (from_dict)
_NULL_STRINGS = {"null", "none", ""}
_TRUE_STRINGS = {"true", "1", "yes"}
_FALSE_STRINGS = {"false", "0", "no"}


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _err(name, value, "a number (a numeric string is accepted)") from None
    if not _is_real(value):
        raise _err(name, value, "a number")
    return float(value)


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise _err(name, value, "an integer (an integer string is accepted)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(name, value, "an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _err(name, value, "an integer")
        return int(value)
    return value


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE_STRINGS:
            return True
        if low in _FALSE_STRINGS:
            return False
    elif isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _err(name, value, "true or false (\"true\"/\"false\" strings are accepted)")


def _optional(conv: Any) -> Any:
    def coerce(name: str, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_STRINGS):
            return None
        return conv(name, value)

    return coerce


def _maybe_json_list(name: str, value: Any) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise _err(name, value, f"a JSON list ({exc})") from None
    return value


def _to_stop(name: str, value: Any) -> list[str] | None:
    if value is None:
        return None
    value = _maybe_json_list(name, value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _err(name, value, "a string or a list of strings")


def _to_logprobs(name: str, value: Any) -> int | None:
    """``logprobs`` as vllm_backend reads it: a JSON boolean from Triton's OpenAI frontend
    (``false`` = none, ``true`` = 1), otherwise an optional integer."""
    if isinstance(value, bool):
        return 1 if value else None
    return _optional(_to_int)(name, value)


def _to_logit_bias(name: str, value: Any) -> dict[int, float] | None:
    """JSON object keys are strings: ``{"42": -100}`` -> ``{42: -100.0}``."""
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _err(name, value, f"a JSON object ({exc})") from None
    if not isinstance(value, Mapping):
        raise _err(name, value, "an object mapping token ids to biases")
    return {_to_int(name, k): _to_float(name, v) for k, v in value.items()}


def _to_id_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    value = _maybe_json_list(name, value)
    if not isinstance(value, (list, tuple)):
        raise _err(name, value, "a list of integer token ids")
    return [_to_int(name, v) for v in value]


_COERCERS: dict[str, Any] = {
    "temperature": _to_float,
    "top_k": _to_int,
    "top_p": _to_float,
    "min_p": _to_float,
    "seed": _optional(_to_int),
    "max_tokens": _to_int,
    "min_tokens": _to_int,
    "stop": _to_stop,
    "stop_token_ids": _to_id_list,
    "ignore_eos": _to_bool,
    "repetition_penalty": _to_float,
    "presence_penalty": _to_float,
    "frequency_penalty": _to_float,
    "logprobs": _to_logprobs,
    "skip_special_tokens": _to_bool,
    "include_stop_str_in_output": _to_bool,
    "n": _to_int,
    "best_of": _optional(_to_int),
    "prompt_logprobs": _to_logprobs,
    "logit_bias": _to_logit_bias,
    "allowed_token_ids": _optional(_to_id_list),
    "truncate_prompt_tokens": _optional(_to_int),
    "detokenize": _to_bool,
    "bad_words": _to_stop,
}
if set(_COERCERS) != {f.name for f in dataclasses.fields(SamplingParams)}:  # keep the two in sync
    raise RuntimeError("glm5.sampling_params: _COERCERS does not cover exactly the SamplingParams fields")
