"""SamplingParams: SGLang defaults, normalisation, and validation that names the bad field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.messages.sampling import SamplingParams

VOCAB = 100


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.seed) == (None, None, None)
    assert (p.ignore_eos, p.skip_special_tokens, p.spaces_between_special_tokens) == (False, True, True)
    assert (p.n, p.logprobs, p.top_logprobs_num, p.min_new_tokens) == (1, False, 0, 0)
    p.verify(VOCAB)


def test_normalize_turns_stop_into_lists_and_is_idempotent() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(5, 6)).normalize()
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert p.normalize().stop == ["###"]
    empty = SamplingParams().normalize()
    assert empty.stop == [] and empty.stop_token_ids == []
    listed = SamplingParams(stop=["a", "b"]).normalize()
    assert listed.stop == ["a", "b"]


@pytest.mark.parametrize(
    ("temperature", "expected"), [(0.0, True), (1e-7, True), (1e-3, False), (0.7, False), (1.0, False)]
)
def test_is_greedy(temperature: float, expected: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is expected


def test_top_k_one_is_not_flagged_greedy() -> None:
    # It reaches the same token through the sampling path; is_greedy is only about temperature.
    assert not SamplingParams(top_k=1).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=2),  # ints are fine where floats are expected
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(top_k=10**6),  # larger than the vocab: clamped by the sampler
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(frequency_penalty=-2.0, presence_penalty=2.0),
        dict(repetition_penalty=0.5),
        dict(max_new_tokens=0),
        dict(min_new_tokens=128),
        dict(n=4),
        dict(top_logprobs_num=20, logprobs=True),
        dict(stop_token_ids=[0, VOCAB - 1], stop=["\n\n", "END"]),
        dict(seed=-3),
    ],
)
def test_valid_values_pass(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs).normalize().verify(VOCAB)


INVALID: list[tuple[str, object]] = [
    ("temperature", -1),
    ("temperature", -1e-9),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "0.5"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("max_new_tokens", -1),
    ("max_new_tokens", "16"),
    ("max_new_tokens", 16.0),
    ("max_new_tokens", True),
    ("max_new_tokens", None),
    ("min_new_tokens", -1),
    ("min_new_tokens", 129),  # above the default max_new_tokens
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("top_logprobs_num", -1),
    ("top_logprobs_num", 21),
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["7"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("stop", 5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("seed", "42"),
    ("seed", 1.5),
    ("logprobs", "yes"),
    ("ignore_eos", 1),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 0),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field} "):
        params.verify(VOCAB)
    # The same through the user-facing path, which normalizes first.
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams.from_dict({field: value}).verify(VOCAB)


def test_error_message_states_the_value() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1).verify()


def test_stop_token_ids_bounded_only_when_vocab_known() -> None:
    SamplingParams(stop_token_ids=[10**6]).verify()
    with pytest.raises(ValueError, match="^stop_token_ids "):
        SamplingParams(stop_token_ids=[10**6]).verify(VOCAB)


def test_from_dict_builds_and_normalizes() -> None:
    p = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8, "stop": "x", "seed": 3})
    assert p.is_greedy and p.max_new_tokens == 8 and p.stop == ["x"] and p.seed == 3
    assert p.top_p == 1.0  # untouched fields keep their defaults


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(ValueError, match="max_length"):
        SamplingParams.from_dict({"max_length": 8})
    with pytest.raises(ValueError, match="best_of, typical_p"):
        SamplingParams.from_dict({"typical_p": 0.9, "temperature": 0.5, "best_of": 2})


def test_from_dict_rejects_non_dict() -> None:
    with pytest.raises(ValueError, match="^sampling_params "):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10),
    top_p=st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=2),
    top_k=st.integers(min_value=-5, max_value=500),
)
def test_verify_accepts_exactly_the_documented_ranges(temperature: float, top_p: float, top_k: int) -> None:
    valid = temperature >= 0 and 0 < top_p <= 1 and (top_k == -1 or top_k >= 1)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if valid:
        params.verify(VOCAB)
    else:
        with pytest.raises(ValueError, match=r"^(temperature|top_p|top_k) "):
            params.verify(VOCAB)


def test_max_tokens_is_vllms_name_for_max_new_tokens() -> None:
    """engine.generate(p, {"max_tokens": 8}) as a vLLM or OpenAI user writes it; two different values refused."""
    assert SamplingParams.from_dict({"max_tokens": 8}).max_new_tokens == 8
    assert SamplingParams.from_dict({"max_tokens": 8, "max_new_tokens": 8}).max_new_tokens == 8
    with pytest.raises(ValueError, match="max_tokens .* and max_new_tokens .* disagree"):
        SamplingParams.from_dict({"max_tokens": 8, "max_new_tokens": 9})
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\): n_predict \(n_predict: use max_new_tokens\)"):
        SamplingParams.from_dict({"n_predict": 8})


def test_stop_ids_are_the_requests_and_the_models_eos_unless_ignored():
    """The one stop-id set: the scheduler finishes on it and the sampler bans it below min_new_tokens."""
    assert SamplingParams(stop_token_ids=[5]).normalize().stop_ids({2, 3}) == {2, 3, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).normalize().stop_ids({2, 3}) == {5}
    assert SamplingParams().stop_ids(()) == set()
