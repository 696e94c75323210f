"""fork(): one image prompt, several questions answered concurrently from the shared prefix;
run_batch(): the same program over many inputs at once (their requests batch in the engine).

Run: python examples/lang_fork_and_batch.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import tessera

try:
    from examples._backend import IMAGE, VIDEO, run
except ImportError:
    from _backend import IMAGE, VIDEO, run

QUESTIONS = ["What color is the circle?", "What shape is blue?", "How many shapes are there?"]


@tessera.function
def ask_many(s, path, questions):
    s += tessera.user(tessera.image(path) + "Describe the image.")
    s += tessera.assistant(tessera.gen("description", max_tokens=32, temperature=0))
    forks = tessera.fork(s, len(questions))
    for branch, question in zip(forks, questions):
        branch += tessera.user(question)
        branch += tessera.assistant(tessera.gen("answer", max_tokens=8, temperature=0))
    forks.join()
    s.set_var("answers", {q: f["answer"] for q, f in zip(questions, forks)})


@tessera.function
def describe(s, media, kind):
    item = tessera.image(media) if kind == "image" else tessera.video(media, num_frames=4)
    s += tessera.user(item + f"Describe the {kind}.")
    s += tessera.assistant(tessera.gen("description", max_tokens=24, temperature=0))


def main(backend) -> dict:
    forked = ask_many.run(path=IMAGE, questions=QUESTIONS, backend=backend)
    batch = tessera.run_batch(describe, [{"media": IMAGE, "kind": "image"}, {"media": VIDEO, "kind": "video"}] * 2,
                              backend=backend)
    return {"description": forked["description"], "answers": forked["answers"],
            "batch": [state["description"] for state in batch]}


if __name__ == "__main__":
    run(main)
