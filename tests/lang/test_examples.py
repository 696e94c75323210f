"""The examples/ programs on demo-vl through the offline Engine, and the program API's rules."""

from __future__ import annotations

import json

import pytest

import tessera
from examples import lang_fork_and_batch, lang_multi_turn, lang_structured
from tests.constrained.scene_schema import ANSWER_REGEX, validate_scene

SCENE = "a red circle, a blue square and a green triangle"  # tessera/assets/examples/README.md
VIDEO = "a green circle moving up"


def test_multi_turn_example_scores_choices_and_reuses_the_prefix(demo_vl_engine):
    out = lang_multi_turn.main(demo_vl_engine)
    assert out["description"] == SCENE
    scores = out["circle_scores"]
    assert len(scores) == 4 and out["circle_color"] == ["red", "green", "blue", "yellow"][scores.index(max(scores))]
    assert out["circle_color"] == "red"  # the circle in the example image is red
    assert out["square_color"] in ("red", "green", "blue", "yellow")
    assert out["cached_tokens_last_turn"] > 100  # the image and earlier turns came from the prefix cache
    assert out["transcript"].count("\nuser: ") == 4 and out["transcript"].startswith("system: ")


def test_fork_and_batch_example(demo_vl_engine):
    out = lang_fork_and_batch.main(demo_vl_engine)
    assert out["description"] == SCENE
    assert set(out["answers"]) == set(lang_fork_and_batch.QUESTIONS) and all(out["answers"].values())
    assert out["batch"] == [SCENE, VIDEO, SCENE, VIDEO]


def test_structured_example_validates(demo_vl_engine):
    out = lang_structured.main(demo_vl_engine)
    validate_scene(out["scene"])
    import re

    assert re.fullmatch(ANSWER_REGEX, out["shape"]), out["shape"]


def test_forks_share_the_state_so_far_and_diverge(demo_vl_engine):
    @tessera.function
    def prog(s):
        s += tessera.user("Say something.")
        s += tessera.assistant("Sure: " + tessera.gen("first", max_tokens=4, temperature=0))
        forks = s.fork(2)
        forks[0] += tessera.user("Again.")
        forks[1] += tessera.user("Once more.")
        forks += tessera.assistant(tessera.gen("second", max_tokens=4, temperature=0))
        forks.join()
        s.set_var("fork_messages", [f.messages() for f in forks])

    state = prog.run(backend=demo_vl_engine)
    a, b = state["fork_messages"]
    assert a[:2] == b[:2] == state.messages()[:2]
    assert state.messages()[1]["content"].startswith("Sure: ")  # a prefilled answer is continued
    assert a[2]["content"] == "Again." and b[2]["content"] == "Once more." and len(a) == len(b) == 4


def test_gen_dtype_constrains_the_answer(demo_vl_engine):
    @tessera.function
    def count(s):
        s += tessera.user(tessera.image(lang_multi_turn.IMAGE) + "How many shapes are there?")
        s += tessera.assistant(tessera.gen("n", max_tokens=6, temperature=0, dtype=int))

    value = count.run(backend=demo_vl_engine)["n"]
    assert int(value) == int(value.strip()), value  # an integer literal, though the model answers in words
    with pytest.raises(ValueError, match="dtype"):
        tessera.gen("x", dtype=list)


def test_program_errors_surface_when_results_are_read(demo_vl_engine):
    @tessera.function
    def bad_schema(s):
        s += tessera.user("hi")
        s += tessera.assistant(tessera.gen("x", json_schema={"type": "nope"}))

    with pytest.raises(ValueError, match="json_schema"):
        bad_schema.run(backend=demo_vl_engine)

    @tessera.function
    def gen_in_user(s):
        s += tessera.user("hi " + tessera.gen("x"))

    with pytest.raises(ValueError, match="assistant"):
        gen_in_user.run(backend=demo_vl_engine)
    with pytest.raises(ValueError, match="choices"):
        tessera.select("x", [])
    with pytest.raises(ValueError, match="backend"):
        tessera.lang.program._default_backend = None
        gen_in_user.run()
    json.dumps(tessera.lang.__all__)  # the public names are plain strings


def test_streamed_program_text_arrives_in_pieces_and_adds_up(demo_vl_engine):
    @tessera.function
    def describe(s):
        s += tessera.user(tessera.image(lang_multi_turn.IMAGE) + "Describe the image.")
        s += tessera.assistant(tessera.gen("d", max_tokens=32, temperature=0))

    state = describe.run(backend=demo_vl_engine, stream=True)
    pieces = list(state.text_iter("d"))
    assert len(pieces) > 1 and "".join(pieces) == state["d"] == SCENE
    assert state.get_meta_info("d")["finish_reason"] == "stop"
    everything = "".join(describe.run(backend=demo_vl_engine, stream=True).text_iter())
    assert everything == "Describe the image." + SCENE
