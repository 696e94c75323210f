"""Structured answers inside a program: gen() with a JSON schema and with a regex.

Run: python examples/lang_structured.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import json

import tessera

try:
    from examples._backend import IMAGE, run
except ImportError:
    from _backend import IMAGE, run

SCENE = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 3},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow", "purple", "orange"]},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["count", "colors"],
}
ANSWER = r"(one|two|three) (red|green|blue|yellow|purple|orange) (circle|square|triangle)s?"


@tessera.function
def structured(s, path):
    s += tessera.user(tessera.image(path) + "How many shapes are there, and what colors are they?")
    s += tessera.assistant(tessera.gen("scene", max_tokens=64, temperature=0, json_schema=SCENE))
    s += tessera.user("Describe one shape.")
    s += tessera.assistant(tessera.gen("shape", max_tokens=16, temperature=0, regex=ANSWER))


def main(backend) -> dict:
    state = structured.run(path=IMAGE, backend=backend)
    return {"scene": json.loads(state["scene"]), "shape": state["shape"]}


if __name__ == "__main__":
    run(main)
