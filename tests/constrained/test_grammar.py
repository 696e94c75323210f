"""Constraint checking, matchers on demo-vl's tokenizer, and the sampler's batch mask (no model)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from tessera.constrained.grammar import grammar_text, no_unlisted_properties
from tessera.constrained.matcher import GrammarCompiler, bitmask_width, fill_bitmask
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.response_format import constraint_from_openai
from tessera.worker.sampler import Sampler, SamplingBatchInfo, unpack_bitmask
from tessera.messages.sampling import SamplingParams
from tests.constrained.scene_schema import ANSWER_REGEX, SCENE_SCHEMA, validate_scene

DEMO_VL = "tessera/assets/demo-vl"
EOS = 2


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_VL)
    return tok, GrammarCompiler(tok, vocab_size=576, eos_token_ids={EOS})


@pytest.mark.parametrize(("kind", "source", "needle"), [
    ("json_schema", "{not json", "json_schema: not valid JSON"),
    ("json_schema", '{"type": "strange"}', "json_schema: "),
    ("json_schema", "[1, 2]", "json_schema: a schema is a JSON object"),
    ("regex", "a(b", "regex: "),
    ("ebnf", 'root ::= "a" | missing', "ebnf: "),
])
def test_invalid_constraints_name_the_field(kind, source, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        grammar_text(kind, source)
    with pytest.raises(ValueError, match=f"^{kind}"):
        SamplingParams(**{kind: source}).normalize().verify(576)


def test_one_constraint_per_request_and_dict_schema_is_serialised():
    with pytest.raises(ValueError, match="^regex: only one of"):
        SamplingParams(json_schema='{"type": "object"}', regex="a+").verify()
    sp = SamplingParams.from_dict({"json_schema": SCENE_SCHEMA})
    assert json.loads(sp.json_schema) == SCENE_SCHEMA and sp.constraint == ("json_schema", sp.json_schema)
    sp.verify(576)
    assert SamplingParams().constraint is None


def test_listed_properties_close_the_object_but_explicit_choices_stay():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "$defs": {"x": {"properties": {"y": {}}}}, "allOf": [{"properties": {"z": {}}}],
              "enum": [{"properties": 1}]}
    out = no_unlisted_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # allOf members describe one object together
    assert out["enum"] == [{"properties": 1}]  # values are not schemas
    assert no_unlisted_properties({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the input is not modified


def _random_walk(compiler, kind: str, source: str, batch: int, seed: int, max_steps: int = 200) -> list[str]:
    """Decodes `batch` rows from random logits under the mask; returns the finished texts."""
    tok, comp = compiler
    matchers = [comp.build(kind, source) for _ in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    outs: list[list[int]] = [[] for _ in range(batch)]
    live = list(range(batch))
    for _ in range(max_steps):
        mask = fill_bitmask([matchers[i] for i in live])
        assert mask.shape == (len(live), bitmask_width(576))
        logits = torch.randn(len(live), 576, generator=gen)
        info = SamplingBatchInfo.build([SamplingParams(temperature=0)] * len(live), 576, [[]] * len(live),
                                       [[]] * len(live), vocab_mask=mask)
        ids = Sampler()(logits, info).next_token_ids.tolist()
        still = []
        for i, t in zip(live, ids):
            assert matchers[i].accept(t), matchers[i].error
            if t != EOS:
                outs[i].append(t)
            if not matchers[i].is_terminated:
                still.append(i)
        live = still
        if not live:
            break
    assert not live, "every row reaches the end of its grammar"
    return [tok.decode(o) for o in outs]


def test_random_logits_under_the_scene_schema_always_give_valid_compact_json(compiler):
    texts = _random_walk(compiler, "json_schema", json.dumps(SCENE_SCHEMA), batch=16, seed=0)
    for text in texts:
        validate_scene(json.loads(text))
        assert " " not in text  # compact: no whitespace between tokens (and no value here has any)


def test_random_logits_under_a_regex_and_an_ebnf_match(compiler):
    for text in _random_walk(compiler, "regex", ANSWER_REGEX, batch=8, seed=1):
        assert re.fullmatch(ANSWER_REGEX, text), text
    for text in _random_walk(compiler, "ebnf", 'root ::= ("yes" | "no") "." ', batch=4, seed=2):
        assert text in ("yes.", "no."), text


def test_unconstrained_rows_are_untouched_and_compiled_grammars_are_reused(compiler):
    _, comp = compiler
    m = comp.build("regex", "(yes|no)")
    assert comp.submit("regex", "(yes|no)").done()  # cached: no compile wait
    mask = fill_bitmask([None, m, None])
    assert mask[0].eq(-1).all() and mask[2].eq(-1).all()
    allowed = unpack_bitmask(mask, 576)
    assert allowed[0].all() and 0 < allowed[1].sum() < 20
    logits = torch.randn(3, 576, generator=torch.Generator().manual_seed(3))
    info = SamplingBatchInfo.build([SamplingParams(temperature=0, logprobs=True)] * 3, 576, [[]] * 3, [[]] * 3,
                                   vocab_mask=mask)
    out = Sampler()(logits, info)
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()
    assert allowed[1, out.next_token_ids[1]]
    # Logprobs are the model's, taken before the mask (tessera.lang's select scores forced choices with them).
    expected = torch.log_softmax(logits, dim=-1).gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert fill_bitmask([None, None]) is None
    failed = comp.submit("regex", "a(b")
    with pytest.raises(ValueError, match="^regex"):
        failed.result()


def test_min_new_tokens_does_not_hold_back_eos_of_a_constrained_row():
    info = SamplingBatchInfo.build([SamplingParams(min_new_tokens=5, regex="a"), SamplingParams(min_new_tokens=5)],
                                   576, [[], []], [[], []], eos_token_ids={EOS})
    assert info.banned_token_mask is not None
    assert not info.banned_token_mask[0].any() and info.banned_token_mask[1, EOS]


@pytest.mark.parametrize(("body", "expected"), [
    ({}, {}),
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"},
                                                                 "strict": True}}},
     {"json_schema": '{"type": "integer"}'}),
    ({"regex": "yes|no"}, {"regex": "yes|no"}),
    ({"ebnf": 'root ::= "x"'}, {"ebnf": 'root ::= "x"'}),
    ({"json_schema": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
])
def test_openai_fields_map_to_sampling_params(body, expected):
    assert constraint_from_openai(body) == expected


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": "json"}, "response_format", "response_format: must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
     "response_format", "response_format: "),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format", "only one output constraint"),
    ({"regex": "a(b"}, "regex", "regex: "),
    ({"regex": 5}, "regex", "regex: must be a non-empty string"),
])
def test_openai_constraint_errors_name_the_field(body, param, needle):
    with pytest.raises(APIError) as err:
        constraint_from_openai(body)
    assert err.value.param == param and needle in err.value.message, err.value.message


def test_random_walk_is_reproducible_for_any_seed(compiler):
    seed = random.Random(7).randrange(1000)
    assert _random_walk(compiler, "regex", ANSWER_REGEX, 2, seed) == _random_walk(compiler, "regex", ANSWER_REGEX, 2,
                                                                                    seed)


def test_a_json_row_that_wants_eos_closes_instead_and_others_are_unchanged():
    from tessera.worker.sampler import close_on_stop_intent

    vocab, eos, quote, bracket, letter = 8, 2, 3, 4, 5
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 5.0  # every row's model wants to stop
    logits[:, letter] = 1.0
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[:, [quote, bracket, letter]] = True  # inside a string: EOS not allowed
    allowed[1, eos] = True  # row 1's grammar could end here
    closers = torch.tensor([[quote, bracket], [quote, bracket], [-1, -1]])  # row 2 is not JSON
    out = close_on_stop_intent(logits, allowed, closers, torch.tensor([eos]))
    assert out[0].nonzero().flatten().tolist() == [quote]  # closes the string first
    assert torch.equal(out[1], allowed[1]) and torch.equal(out[2], allowed[2])
    logits[0, eos] = 0.0  # a row whose model does not want to stop keeps its choices
    assert torch.equal(close_on_stop_intent(logits, allowed, closers, torch.tensor([eos]))[0], allowed[0])
