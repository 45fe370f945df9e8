"""SamplingParams: vLLM's fields and defaults; every bad value is a ValueError (or a
TypeError for a wrong type) that names the field and says what it accepts."""

import pytest

from nanovllm.sampling_params import SamplingParams


def test_defaults_turn_every_option_off():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos) == (64, 0, False)
    assert (p.stop_token_ids, p.stop, p.logit_bias) == ([], [], {})
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.is_greedy and not p.has_penalties
    assert (p.n, p.logprobs, p.prompt_logprobs) == (1, None, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)


def test_max_tokens_none_means_up_to_max_model_len_and_bounds_no_min_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=500).max_tokens is None


def test_temperature_zero_or_below_1e_5_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 0),
        ("top_k", -1),
        ("top_k", 0),
        ("top_k", 1),
        ("top_p", 1e-9),
        ("top_p", 1),
        ("min_p", 0),
        ("min_p", 0.999),
        ("seed", 0),
        ("seed", -5),
        ("seed", 2**70),
        ("min_tokens", 64),
        ("repetition_penalty", 0.01),
        ("presence_penalty", -2),
        ("frequency_penalty", 2),
        ("logit_bias", {0: -100.0, 5: 1e6}),
    ],
)
def test_boundary_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize(
    "field,value,range_text",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("top_k", -2, ">= 1"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", float("nan"), "(0, 1]"),
        ("min_p", -0.1, "[0, 1)"),
        ("min_p", 1, "[0, 1)"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, "[0, max_tokens=64]"),
        ("min_tokens", 65, "[0, max_tokens=64]"),
        ("repetition_penalty", 0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop", ["ok", ""], "empty"),
        ("n", 0, ">= 1"),
        ("logprobs", -1, ">= 0"),
        ("prompt_logprobs", -2, ">= 0"),
        ("logit_bias", {-1: 1.0}, ">= 0"),
        ("logit_bias", {3: float("-inf")}, "finite"),
        ("logit_bias", {3: float("nan")}, "finite"),
    ],
)
def test_bad_values_are_value_errors_naming_field_and_range(field, value, range_text):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and range_text in str(err.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("top_k", 2.0),
        ("top_p", None),
        ("min_p", "0.1"),
        ("seed", 1.5),
        ("seed", True),
        ("max_tokens", 1.5),
        ("min_tokens", None),
        ("ignore_eos", 1),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", "12"),
        ("stop", 3),
        ("stop", ["a", 3]),
        ("repetition_penalty", "1"),
        ("presence_penalty", None),
        ("frequency_penalty", [0.1]),
        ("n", 2.0),
        ("n", None),
        ("logprobs", 1.0),
        ("prompt_logprobs", True),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", None),
        ("logit_bias", [(1, 2.0)]),
        ("logit_bias", {"1": 2.0}),
        ("logit_bias", {True: 2.0}),
        ("logit_bias", {1: "2"}),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})
