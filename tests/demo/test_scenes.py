"""The scene grammar is a contract: check every rule on many generated samples."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tessera.demo import scenes


def _check_scene(scene: scenes.Scene) -> None:
    w, h = scene.width, scene.height
    assert 128 <= w <= 512 and 128 <= h <= 512
    assert max(w, h) <= 2 * min(w, h)
    assert 1 <= len(scene.shapes) <= 3
    assert len({s.color for s in scene.shapes}) == len(scene.shapes)
    assert len({s.kind for s in scene.shapes}) == len(scene.shapes)
    for i, s in enumerate(scene.shapes):
        assert 0.22 * min(w, h) - 0.5 <= s.side <= 0.38 * min(w, h) + 0.5
        assert 0 <= s.x0 and s.x0 + s.side <= w and 0 <= s.y0 and s.y0 + s.side <= h
        for t in scene.shapes[i + 1 :]:
            assert not s.overlaps(t)


def test_image_samples_follow_grammar() -> None:
    rng = random.Random(7)
    for _ in range(120):
        s = scenes.image_sample(rng)
        (scene,) = s.scenes
        _check_scene(scene)
        img = np.asarray(s.frames[0])
        assert img.shape == (scene.height, scene.width, 3)
        # Only background and the scene's exact colors appear (no anti-aliasing, no outline).
        allowed = {scenes.BACKGROUND} | {scenes.COLORS[x.color] for x in scene.shapes}
        packed = np.unique(img.reshape(-1, 3).astype(np.int64) @ np.array([65536, 256, 1]))
        present = {(int(v) >> 16, (int(v) >> 8) & 255, int(v) & 255) for v in packed}
        assert present <= allowed
        assert present == allowed  # every shape is visible


def test_answers_match_scene() -> None:
    rng = random.Random(11)
    for _ in range(200):
        s = scenes.image_sample(rng)
        scene = s.scenes[0]
        by_kind = {x.kind: x.color for x in scene.shapes}
        by_color = {x.color: x.kind for x in scene.shapes}
        if s.question_type == "color":
            kind = s.question.removeprefix("What color is the ").removesuffix("?")
            assert s.answer == by_kind[kind]
        elif s.question_type == "shape":
            color = s.question.removeprefix("What shape is the ").removesuffix(" object?")
            assert s.answer == by_color[color]
        elif s.question_type == "count":
            assert s.answer == ["one", "two", "three"][len(scene.shapes) - 1]
        else:
            ordered = sorted(scene.shapes, key=lambda x: x.center_x)
            assert s.answer == scenes.describe(scene)
            positions = [s.answer.index(f"a {x.color} {x.kind}") for x in ordered]
            assert positions == sorted(positions)


@pytest.mark.parametrize("n,expected", [(1, "a red circle"), (2, "a red circle and a blue square"),
                                        (3, "a red circle, a blue square and a green triangle")])
def test_describe_wording(n: int, expected: str) -> None:
    shapes = [scenes.Shape("circle", "red", 0, 0, 40), scenes.Shape("square", "blue", 60, 0, 40),
              scenes.Shape("triangle", "green", 120, 0, 40)][:n]
    assert scenes.describe(scenes.Scene(200, 200, tuple(reversed(shapes)))) == expected


def test_videos_move_in_a_straight_line() -> None:
    rng = random.Random(3)
    for _ in range(100):
        v = scenes.video_sample(rng)
        assert 4 <= len(v.frames) <= 16
        for sc in v.scenes:
            _check_scene(sc)
        first, last = v.scenes[0].shapes[0], v.scenes[-1].shapes[0]
        dx, dy = last.x0 - first.x0, last.y0 - first.y0
        w, h = v.scenes[0].width, v.scenes[0].height
        direction = v.answer.split()[-1]
        if direction in ("left", "right"):
            assert dy == 0 and abs(dx) >= 0.25 * w - 1 and (dx < 0) == (direction == "left")
        else:
            assert dx == 0 and abs(dy) >= 0.25 * h - 1 and (dy < 0) == (direction == "up")
        assert len({(s.shapes[0].kind, s.shapes[0].color, s.shapes[0].side) for s in v.scenes}) == 1


def test_generator_is_deterministic() -> None:
    a = [scenes.image_sample(random.Random(5)) for _ in range(3)]
    b = [scenes.image_sample(random.Random(5)) for _ in range(3)]
    assert [(s.question, s.answer, s.scenes) for s in a] == [(s.question, s.answer, s.scenes) for s in b]
    assert np.array_equal(np.asarray(a[0].frames[0]), np.asarray(b[0].frames[0]))
