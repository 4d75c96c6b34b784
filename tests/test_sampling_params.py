"""SamplingParams: defaults, validation messages, and from_dict coercion of Triton/JSON input."""

from __future__ import annotations

import math

import pytest

from glm5.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0 and not p.is_greedy
    assert p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.logprobs is None and p.seed is None
    assert not p.needs_penalties


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "value", "range_text"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", "0.7", ">= 0"),  # constructor does not coerce; from_dict does
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("min_p", -math.inf, "[0, 1]"),
        ("top_k", -2, "0 / -1"),
        ("top_k", 2.5, "0 / -1"),
        ("top_k", True, "0 / -1"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_penalty", math.inf, "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", math.nan, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -5, ">= 1"),
        ("max_tokens", 3.0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("stop", [""], "non-empty"),
        ("stop", ["ok", 3], "non-empty"),
        ("stop_token_ids", [5, -1], "non-negative"),
        ("stop_token_ids", ["7"], "non-negative"),
        ("logprobs", 21, f"[0, {MAX_LOGPROBS}]"),
        ("logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
        ("seed", 2**64, "integer in"),
        ("seed", 1.5, "integer in"),
        ("ignore_eos", "yes", "true or false"),
        ("skip_special_tokens", 1, "true or false"),
    ],
)
def test_validation_names_parameter_value_and_range(name: str, value: object, range_text: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{name: value})
    msg = str(info.value)
    assert repr(name) in msg, msg
    assert repr(value) in msg, msg
    assert range_text in msg, msg
    assert isinstance(info.value, ValueError)


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(SamplingParamsError, match=r"'min_tokens' = 10 .*max_tokens \(= 4\)"):
        SamplingParams(max_tokens=4, min_tokens=10)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_validate_checks_stop_token_ids_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[3, 99])
    p.validate(vocab_size=100)
    with pytest.raises(SamplingParamsError, match=r"'stop_token_ids'.*vocab size 50 \(bad entry 99\)"):
        p.validate(vocab_size=50)


def test_validate_catches_mutation() -> None:
    p = SamplingParams()
    p.top_p = math.nan
    with pytest.raises(SamplingParamsError, match="'top_p' = nan"):
        p.validate()


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


# ----------------------------------------------------------------------------- from_dict
def test_from_dict_coerces_genai_perf_strings() -> None:
    p = SamplingParams.from_dict({"max_tokens": "32", "temperature": "0"})
    assert p.max_tokens == 32 and isinstance(p.max_tokens, int)
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.is_greedy


def test_from_dict_coerces_every_kind() -> None:
    p = SamplingParams.from_dict(
        {
            "temperature": "0.7",
            "top_k": "40",
            "top_p": "0.95",
            "min_p": 0,  # int for a float field
            "seed": "1234",
            "max_tokens": 64.0,  # integral float for an int field (JSON number)
            "min_tokens": "2",
            "stop": "###",
            "stop_token_ids": ["5", 6],
            "ignore_eos": "true",
            "repetition_penalty": "1.1",
            "presence_penalty": "-0.5",
            "frequency_penalty": "0.25",
            "logprobs": "5",
            "skip_special_tokens": "False",
            "include_stop_str_in_output": "1",
        }
    )
    assert p.temperature == 0.7 and p.top_k == 40 and p.top_p == 0.95 and p.min_p == 0.0
    assert p.seed == 1234 and p.max_tokens == 64 and p.min_tokens == 2
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert p.ignore_eos is True and p.skip_special_tokens is False and p.include_stop_str_in_output is True
    assert p.repetition_penalty == 1.1 and p.presence_penalty == -0.5 and p.frequency_penalty == 0.25
    assert p.logprobs == 5


def test_from_dict_null_and_json_lists() -> None:
    p = SamplingParams.from_dict({"seed": "null", "logprobs": None, "stop": '["a", "b"]', "stop_token_ids": "[1, 2]"})
    assert p.seed is None and p.logprobs is None
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]


def test_from_dict_round_trips_to_dict() -> None:
    p = SamplingParams(temperature=0.3, stop=["x"], stop_token_ids=[9], seed=5, logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_from_dict_rejects_unknown_key_and_lists_valid_ones() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"max_tokens": 8, "temprature": 0.5})
    msg = str(info.value)
    assert "'temprature'" in msg
    for valid in ("temperature", "max_tokens", "stop_token_ids", "include_stop_str_in_output"):
        assert valid in msg


@pytest.mark.parametrize(
    ("d", "name"),
    [
        ({"max_tokens": "abc"}, "max_tokens"),
        ({"max_tokens": "3.5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "0"}, "max_tokens"),
        ({"temperature": [1]}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"top_p": "inf"}, "top_p"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"ignore_eos": 2}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": "[1, "}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"seed": "abc"}, "seed"),
        ({"logprobs": "50"}, "logprobs"),
    ],
)
def test_from_dict_rejects_bad_values_naming_the_parameter(d: dict, name: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict(d)
    assert repr(name) in str(info.value), str(info.value)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(SamplingParamsError, match="JSON object"):
        SamplingParams.from_dict(["max_tokens", 3])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- vLLM keys beyond the basics
def test_triton_openai_frontend_default_payload_is_accepted() -> None:
    """Triton's OpenAI frontend always sends n=1 and logprobs=false (and best_of=1 for completions)."""
    p = SamplingParams.from_dict({"n": 1, "logprobs": False, "best_of": 1, "frequency_penalty": 0.0,
                                  "presence_penalty": 0.0, "temperature": 1.0, "top_p": 1.0, "max_tokens": 16})
    assert p.n == 1 and p.logprobs is None and p.num_sequences == 1
    assert SamplingParams.from_dict({"logprobs": True}).logprobs == 1
    assert SamplingParams.from_dict({"logprobs": "3"}).logprobs == 3


def test_logit_bias_keys_arrive_as_strings() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"42": -100, "7": "2.5"}})
    assert p.logit_bias == {42: -100.0, 7: 2.5}
    assert SamplingParams.from_dict({"logit_bias": '{"3": 1}'}).logit_bias == {3: 1.0}
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"1": 101}})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"-1": 1}})


@pytest.mark.parametrize(("d", "needle"), [
    ({"n": 0}, "'n'"), ({"n": 65}, "'n'"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_new_keys_are_validated(d: dict, needle: str) -> None:
    with pytest.raises(SamplingParamsError, match=needle):
        SamplingParams.from_dict(d)


def test_no_effect_keys_are_accepted_and_unsupported_keys_name_the_reason() -> None:
    from glm5.sampling_params import NO_EFFECT_KEYS, UNSUPPORTED_KEYS

    p = SamplingParams.from_dict({k: v for k, v in zip(NO_EFFECT_KEYS, (True, 0, False, {}, False))})
    assert p == SamplingParams()
    for key in ("structured_outputs", "guided_decoding", "use_beam_search", "lora_name"):
        with pytest.raises(SamplingParamsError, match="not supported") as info:
            SamplingParams.from_dict({key: '{"json": {}}'})
        assert UNSUPPORTED_KEYS[key] in str(info.value)
    # an explicit null of an unsupported feature asks for nothing
    assert SamplingParams.from_dict({"structured_outputs": None}) == SamplingParams()


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63, 2**64 - 1])
def test_seeds_that_would_wrap_are_rejected(seed: int) -> None:
    """torch folds a negative seed onto the top of the uint64 range (-1 and 2**64-1 gave the same
    stream); the accepted range is the non-negative int64 one, and the error says so."""
    with pytest.raises(SamplingParamsError, match=r"'seed'.*\[0, 9223372036854775807\]"):
        SamplingParams(seed=seed)
    with pytest.raises(SamplingParamsError, match="'seed'"):
        SamplingParams.from_dict({"seed": str(seed)})


def test_seed_range_ends_are_accepted() -> None:
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams.from_dict({"seed": str(2**63 - 1)}).seed == 2**63 - 1
