"""A multi-turn conversation about an image: free answers, a choice scored by the model, a constrained choice.

Each turn sends the conversation so far; the prefix cache serves what earlier turns computed
(see `cached_tokens`). Run: python examples/lang_multi_turn.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import tessera

try:
    from examples._backend import IMAGE, run
except ImportError:  # run as a script from examples/
    from _backend import IMAGE, run


@tessera.function
def scene_interview(s, path):
    s += tessera.system("You are a helpful assistant.")
    s += tessera.user(tessera.image(path) + "Describe the image.")
    s += tessera.assistant(tessera.gen("description", max_tokens=32, temperature=0))
    s += tessera.user("How many shapes are there?")
    s += tessera.assistant(tessera.gen("count", max_tokens=8, temperature=0))
    s += tessera.user("What color is the circle?")
    # Scored: the model's log-probability of each choice as the answer; the best is kept.
    s += tessera.assistant(tessera.select("circle_color", ["red", "green", "blue", "yellow"]))
    s += tessera.user("What color is the square?")
    # Constrained: one generation that can only write one of the choices.
    s += tessera.assistant(tessera.select("square_color", ["red", "green", "blue", "yellow"], method="constrained"))


def main(backend) -> dict:
    state = scene_interview.run(path=IMAGE, backend=backend)
    return {"description": state["description"], "count": state["count"], "circle_color": state["circle_color"],
            "circle_scores": state.get_meta_info("circle_color")["scores"], "square_color": state["square_color"],
            "cached_tokens_last_turn": state.get_meta_info("square_color")["cached_tokens"],
            "transcript": state.text()}


if __name__ == "__main__":
    run(main)
