"""Constrained decoding under --tp-size 2 (CPU, gloo): the mask rides in the broadcast step, rank 0 applies it."""

from __future__ import annotations

import json
import re

import pytest

from tessera import Engine
from tessera.config import ASSETS_DIR
from tests.constrained.scene_schema import ANSWER_REGEX, SCENE_SCHEMA, validate_scene

pytestmark = pytest.mark.slow  # two scheduler ranks to start


def test_tp2_outputs_fit_their_grammars():
    image = str(ASSETS_DIR / "examples" / "scene.png")
    with Engine("demo-vl", tp_size=2, max_total_tokens=2048, show_progress=False) as engine:
        prompt = engine.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "How many shapes are there?"}]}])
        outs = engine.generate([prompt] * 4, [{"json_schema": SCENE_SCHEMA, "temperature": 1.0, "seed": 1,
                                               "max_new_tokens": 64},
                                              {"json_schema": SCENE_SCHEMA, "temperature": 0, "max_new_tokens": 64},
                                              {"regex": ANSWER_REGEX, "temperature": 1.0, "seed": 2},
                                              {"temperature": 0, "max_new_tokens": 8}],
                               image_data=[image] * 4)
        assert engine.get_server_info()["effective"]["tp_size"] == 2
    validate_scene(json.loads(outs[0]["text"]))
    validate_scene(json.loads(outs[1]["text"]))
    assert re.fullmatch(ANSWER_REGEX, outs[2]["text"]), outs[2]["text"]
    assert outs[3]["text"]  # the unconstrained row of the same batch is untouched
