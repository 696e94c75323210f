"""A user turn with media run through a model's processor, as the frontend runs it: the worker and scheduler
tests' requests (input ids and media inputs)."""

from __future__ import annotations

from tessera.config import ASSETS_DIR

SCENE = str(ASSETS_DIR / "examples" / "scene.png")


def process_chat(info, content: list[dict], image_data: list[str]):
    """`info` (frontend ModelInfo)'s chat template over one user turn, then its processor with the images."""
    processor = info.make_mm_processor()
    try:
        prompt = info.apply_chat_template([{"role": "user", "content": content}])
        return processor.process(prompt=prompt, image_data=image_data)
    finally:
        processor.close()


def scene_question(info):
    """The bundled example scene and "How many shapes are there?"."""
    return process_chat(info, [{"type": "image"}, {"type": "text", "text": "How many shapes are there?"}], [SCENE])
