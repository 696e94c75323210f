"""Writes the bundled example media (tessera/assets/examples/): a scene image and a short video.

    python -m tessera.demo.examples

The examples of the README and docs/usage.md and `tessera generate` use them; their answers are fixed by
the grammar, so they double as smoke checks of the demo model.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np

from tessera.demo import scenes

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "assets" / "examples"


def example_scene() -> scenes.Scene:
    return scenes.Scene(320, 240, (
        scenes.Shape("circle", "red", 20, 70, 80),
        scenes.Shape("square", "blue", 125, 40, 70),
        scenes.Shape("triangle", "green", 220, 120, 80),
    ))


def example_video() -> scenes.Sample:
    rng = random.Random(4)
    while True:
        v = scenes.video_sample(rng, "describe_video")
        if len(v.frames) >= 8:
            return v


def encode_video(frames, fps: int = 4) -> bytes:
    """An MP4 (MPEG-4 part 2, high quality) of PIL frames, in memory; sides are cut to even."""
    import av  # PyAV: imported here so that image-only users need not install it

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        w, h = frames[0].size
        stream.width, stream.height = w - w % 2, h - h % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}
        for img in frames:
            arr = np.ascontiguousarray(np.asarray(img.convert("RGB"))[: stream.height, : stream.width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def write_video(frames, path: Path, fps: int = 4) -> None:
    path.write_bytes(encode_video(frames, fps))


def main() -> None:
    EXAMPLES_DIR.mkdir(parents=True, exist_ok=True)
    scenes.render(example_scene()).save(EXAMPLES_DIR / "scene.png")
    v = example_video()
    write_video(list(v.frames), EXAMPLES_DIR / "moving.mp4")
    (EXAMPLES_DIR / "README.md").write_text(
        "Made by `python -m tessera.demo.examples`.\n\n"
        f"- scene.png: `Describe the image.` -> `{scenes.describe(example_scene())}`\n"
        f"- moving.mp4: `Describe the video.` -> `{v.answer}`\n")
    print(f"wrote {EXAMPLES_DIR}")


if __name__ == "__main__":
    main()
