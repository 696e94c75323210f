"""The scene schema and answer regex the structured-output tests ask demo-vl for, and their validators.

Written out by hand (no jsonschema dependency): every output must satisfy these exactly.
"""

from __future__ import annotations

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle"]
SCENE_SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 3},
        "colors": {"type": "array", "items": {"type": "string", "enum": COLORS}, "minItems": 1, "maxItems": 3},
        "shapes": {"type": "array", "items": {"type": "string", "enum": SHAPES}},
    },
    "required": ["count", "colors"],
}
ANSWER_REGEX = r"(one|two|three) (red|green|blue|yellow|purple|orange) (circle|square|triangle)s?"


def validate_scene(obj) -> None:
    """Raises AssertionError unless obj is valid against SCENE_SCHEMA."""
    assert isinstance(obj, dict), obj
    assert {"count", "colors"} <= set(obj) <= {"count", "colors", "shapes"}, obj
    assert isinstance(obj["count"], int) and not isinstance(obj["count"], bool) and 1 <= obj["count"] <= 3, obj
    assert isinstance(obj["colors"], list) and 1 <= len(obj["colors"]) <= 3, obj
    assert all(c in COLORS for c in obj["colors"]), obj
    if "shapes" in obj:
        assert isinstance(obj["shapes"], list) and all(s in SHAPES for s in obj["shapes"]), obj
