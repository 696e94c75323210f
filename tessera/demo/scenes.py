"""Deterministic generator of the demo-vl scene grammar.

The grammar is a contract that tests and outside checks rely on word for word:
white canvas 128..512 px per side (longer side at most twice the shorter), 1..3
filled shapes with distinct colors and distinct types, non-overlapping square
bounding boxes of side 22%..38% of min(width, height). Videos move one shape in a
straight line at constant speed toward left/right/up/down over 4..16 frames.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

BACKGROUND = (255, 255, 255)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
COUNT_WORDS = ("one", "two", "three")

IMAGE_QUESTION_TYPES = ("color", "shape", "count", "describe")
VIDEO_QUESTION_TYPES = ("direction", "describe_video")


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    x0: int  # bounding box, left/top inclusive, side in pixels
    y0: int
    side: int

    @property
    def center_x(self) -> float:
        return self.x0 + self.side / 2

    def overlaps(self, other: Shape) -> bool:
        return not (
            self.x0 + self.side <= other.x0
            or other.x0 + other.side <= self.x0
            or self.y0 + self.side <= other.y0
            or other.y0 + other.side <= self.y0
        )


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Sample:
    """One question about one image or video, with its reference answer."""

    kind: str  # "image" | "video"
    question_type: str
    question: str
    answer: str
    frames: tuple[Image.Image, ...]  # one frame for an image
    scenes: tuple[Scene, ...]  # the scene behind each frame


def random_canvas(rng: random.Random) -> tuple[int, int]:
    while True:
        w, h = rng.randint(128, 512), rng.randint(128, 512)
        if max(w, h) <= 2 * min(w, h):
            return w, h


def random_scene(rng: random.Random, max_shapes: int = 3, min_shapes: int = 1) -> Scene:
    w, h = random_canvas(rng)
    n = rng.randint(min_shapes, max_shapes)
    while True:  # rejection sampling; three boxes of <=38% always fit eventually
        kinds = rng.sample(SHAPES, n)
        colors = rng.sample(list(COLORS), n)
        shapes: list[Shape] = []
        for kind, color in zip(kinds, colors):
            for _ in range(50):
                side = int(round(rng.uniform(0.22, 0.38) * min(w, h)))
                cand = Shape(kind, color, rng.randint(0, w - side), rng.randint(0, h - side), side)
                if not any(cand.overlaps(s) for s in shapes):
                    shapes.append(cand)
                    break
        if len(shapes) == n:
            return Scene(w, h, tuple(shapes))


def draw_shape(draw: ImageDraw.ImageDraw, s: Shape, fill: tuple[int, int, int] | int) -> None:
    x1, y1 = s.x0 + s.side - 1, s.y0 + s.side - 1
    if s.kind == "circle":
        draw.ellipse([s.x0, s.y0, x1, y1], fill=fill)
    elif s.kind == "square":
        draw.rectangle([s.x0, s.y0, x1, y1], fill=fill)
    else:
        draw.polygon([(s.x0 + (s.side - 1) / 2, s.y0), (s.x0, y1), (x1, y1)], fill=fill)


def render(scene: Scene) -> Image.Image:
    img = Image.new("RGB", (scene.width, scene.height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        draw_shape(draw, s, COLORS[s.color])
    return img


def label_maps(scene: Scene) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel shape and color class (0 = background, else 1 + index)."""
    shape_img = Image.new("L", (scene.width, scene.height), 0)
    color_img = Image.new("L", (scene.width, scene.height), 0)
    sd, cd = ImageDraw.Draw(shape_img), ImageDraw.Draw(color_img)
    for s in scene.shapes:
        draw_shape(sd, s, 1 + SHAPES.index(s.kind))
        draw_shape(cd, s, 1 + list(COLORS).index(s.color))
    return np.asarray(shape_img), np.asarray(color_img)


def describe(scene: Scene) -> str:
    parts = [f"a {s.color} {s.kind}" for s in sorted(scene.shapes, key=lambda s: s.center_x)]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def ask(scene: Scene, qtype: str, target: Shape) -> tuple[str, str]:
    """(question, answer) of an image question type about `scene` (`target`: the shape a lookup asks about)."""
    if qtype == "color":
        return f"What color is the {target.kind}?", target.color
    if qtype == "shape":
        return f"What shape is the {target.color} object?", target.kind
    if qtype == "count":
        return "How many shapes are there?", COUNT_WORDS[len(scene.shapes) - 1]
    if qtype == "describe":
        return "Describe the image.", describe(scene)
    raise ValueError(f"unknown image question type {qtype!r}")


def image_sample(rng: random.Random, question_type: str | None = None, max_shapes: int = 3) -> Sample:
    scene = random_scene(rng, max_shapes=max_shapes)
    qtype = question_type or rng.choice(IMAGE_QUESTION_TYPES)
    q, a = ask(scene, qtype, rng.choice(scene.shapes))
    return Sample("image", qtype, q, a, (render(scene),), (scene,))


def video_sample(rng: random.Random, question_type: str | None = None) -> Sample:
    qtype = question_type or rng.choice(VIDEO_QUESTION_TYPES)
    w, h = random_canvas(rng)
    num_frames = rng.randint(4, 16)
    direction = rng.choice(DIRECTIONS)
    kind, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    side = int(round(rng.uniform(0.22, 0.38) * min(w, h)))
    axis_len = w if direction in ("left", "right") else h
    # Travel at least 25% of the canvas side along the axis of motion.
    max_travel = axis_len - side
    travel = rng.randint(int(np.ceil(0.25 * axis_len)), max(int(np.ceil(0.25 * axis_len)), max_travel))
    start = rng.randint(0, axis_len - side - travel)
    other = rng.randint(0, (h if direction in ("left", "right") else w) - side)
    if direction in ("left", "up"):
        start = start + travel  # move toward decreasing coordinate
        step = -travel / (num_frames - 1)
    else:
        step = travel / (num_frames - 1)
    scenes = []
    for i in range(num_frames):
        pos = int(round(start + step * i))
        x0, y0 = (pos, other) if direction in ("left", "right") else (other, pos)
        scenes.append(Scene(w, h, (Shape(kind, color, x0, y0, side),)))
    if qtype == "direction":
        q, a = f"Which way is the {color} {kind} moving?", direction
    elif qtype == "describe_video":
        q, a = "Describe the video.", f"a {color} {kind} moving {direction}"
    else:
        raise ValueError(f"unknown video question type {qtype!r}")
    return Sample("video", qtype, q, a, tuple(render(s) for s in scenes), tuple(scenes))
