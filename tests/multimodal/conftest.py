"""Shared fixtures: a demo-vl skeleton (tokenizer + Qwen2-VL processor, no weights), the processor factory and
chat prompts every family's processor test uses, media generators built on the project's scene generator, and a
tiny bounded HTTP server."""

from __future__ import annotations

import http.server
import io
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from PIL import Image

from tessera.demo import scenes
from tessera.demo.build_vl import build_skeleton
from tessera.multimodal.media import MediaLimits


@dataclass
class Skeleton:
    path: Path
    config: Any
    processor: Any  # transformers Qwen2VLProcessor


@pytest.fixture(scope="session")
def skeleton(tmp_path_factory: pytest.TempPathFactory) -> Skeleton:
    from transformers import AutoProcessor

    path = tmp_path_factory.mktemp("demo-vl")
    config = build_skeleton(path)
    return Skeleton(path, config, AutoProcessor.from_pretrained(path))


@contextmanager
def processor_factory(hf_processor: Any, config: Any) -> Iterator[Callable[..., Any]]:
    """`make(**kwargs)`: create_processor over (hf_processor, config), offline limits unless given; every
    processor made is closed on exit (each owns a preprocessing pool)."""
    from tests.multimodal.processor_registry import create_processor

    made = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("limits", MediaLimits.offline())
        proc = create_processor(hf_processor, config, **kwargs)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.close()


def load_processor_and_config(path: Path) -> tuple[Any, Any]:
    """(transformers AutoProcessor, AutoConfig) of a checkpoint directory."""
    from transformers import AutoConfig, AutoProcessor

    return AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)


def chat_text(hf_processor: Any, parts: list[str], add_generation_prompt: bool = True) -> str:
    """One user turn through the checkpoint's chat template: "image" / "video" parts become media parts (the
    template inserts their placeholders), any other string a text part. Without add_generation_prompt the
    template is called without the flag (Pixtral's template has none)."""
    content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
    messages = [{"role": "user", "content": content}]
    if not add_generation_prompt:
        return hf_processor.apply_chat_template(messages, tokenize=False)
    return hf_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture
def make_processor(skeleton: Skeleton) -> Iterator[Callable[..., Any]]:
    """Factory for QwenVLProcessor over the skeleton; offline limits unless given."""
    with processor_factory(skeleton.processor, skeleton.config) as make:
        yield make


def scene_image(seed: int, size: tuple[int, int] | None = None) -> Image.Image:
    """A scene-grammar image; `size` (width, height) resizes it to arbitrary shapes."""
    img = scenes.render(scenes.random_scene(random.Random(seed)))
    return img.resize(size) if size is not None else img


def scene_frames(seed: int, size: tuple[int, int] | None = None) -> list[Image.Image]:
    frames = list(scenes.video_sample(random.Random(seed)).frames)
    return [f.resize(size) for f in frames] if size is not None else frames


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def encode_mp4(frames: list[Image.Image], fps: int = 10) -> bytes:
    """Lossy mpeg4 in mp4 (moov at the end, so a truncated file loses its index)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_image(f)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_all_frames(data: bytes) -> list[Image.Image]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_image() for f in container.decode(video=0)]


def tone(seconds: float, rate: int, channels: int = 1, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


# ---------------------------------------------------------------- HTTP server

Route = tuple[int, dict[str, str], bytes]  # status, headers, body


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, Route] = {}
    timeout = 5  # a stuck client cannot hold a handler thread forever

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        status, headers, body = self.routes.get(self.path, (404, {}, b"not found"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers and not headers.get("X-No-Length"):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class MediaServer:
    base_url: str
    routes: dict[str, Route]


@pytest.fixture
def media_server() -> Iterator[MediaServer]:
    """An HTTP/1.0 server on 127.0.0.1 (ephemeral port) serving `routes`; stopped after the test."""
    routes: dict[str, Route] = {}
    handler = type("Handler", (_Handler,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield MediaServer(f"http://127.0.0.1:{server.server_address[1]}", routes)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
