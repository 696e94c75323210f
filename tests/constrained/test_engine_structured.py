"""Structured output through the offline Engine on demo-vl, under chunked prefill and retraction."""

from __future__ import annotations

import json
import re

import pytest

from tessera.config import ASSETS_DIR
from tests.constrained.scene_schema import ANSWER_REGEX, SCENE_SCHEMA, validate_scene

# Long enough (40+ tokens each) that 16 at once outgrow the fixture's 384-token KV pool.
LONG_REGEX = r"(red|green|blue)( (red|green|blue|circle|square)){40}"
IMAGE = str(ASSETS_DIR / "examples" / "scene.png")


def scene_prompt(engine, question: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": question}]}])


def test_schema_regex_and_ebnf_in_engine_sampling_params(demo_vl_engine):
    eng = demo_vl_engine
    prompt = scene_prompt(eng, "How many shapes are there, and what colors are they?")
    before = eng.get_stats()
    outs = eng.generate([prompt] * 16, [
        {"json_schema": SCENE_SCHEMA, "temperature": 1.0, "seed": i, "max_new_tokens": 64} for i in range(8)
    ] + [{"regex": LONG_REGEX, "temperature": 1.0, "seed": i, "max_new_tokens": 160} for i in range(8)],
        image_data=[IMAGE] * 16)
    stats = eng.get_stats()
    assert outs[0]["meta_info"]["prompt_tokens"] > 48  # the image prompt was prefilled in several chunks
    assert stats.num_retractions > before.num_retractions  # and the pool ran dry: requests were retracted
    for out in outs[:8]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        validate_scene(json.loads(out["text"]))
    for out in outs[8:]:
        assert re.fullmatch(LONG_REGEX, out["text"]), out["text"]
    answer = eng.generate(prompt, {"regex": ANSWER_REGEX, "temperature": 0}, image_data=IMAGE)
    assert re.fullmatch(ANSWER_REGEX, answer["text"]), answer["text"]
    yes_no = eng.generate(scene_prompt(eng, "Is there a red circle?"),
                          {"ebnf": 'root ::= ("yes" | "no") "."', "temperature": 0, "max_new_tokens": 8},
                          image_data=IMAGE)
    assert yes_no["text"] in ("yes.", "no.")


def test_engine_streams_constrained_output_and_rejects_bad_grammars(demo_vl_engine):
    eng = demo_vl_engine
    prompt = scene_prompt(eng, "Describe the image.")
    params = {"json_schema": json.dumps(SCENE_SCHEMA), "temperature": 0, "max_new_tokens": 64}
    chunks = list(eng.generate(prompt, params, image_data=IMAGE, stream=True))
    whole = eng.generate(prompt, params, image_data=IMAGE)
    assert chunks[-1]["text"] == whole["text"] and "".join(c["delta"] for c in chunks) == whole["text"]
    validate_scene(json.loads(whole["text"]))
    with pytest.raises(ValueError, match="^json_schema"):
        eng.generate(prompt, {"json_schema": '{"type": "nope"}'}, image_data=IMAGE)
    with pytest.raises(ValueError, match="^regex"):
        eng.generate(prompt, {"regex": "(a"}, image_data=IMAGE)
