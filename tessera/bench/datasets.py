"""Benchmark inputs: deterministic request lists for the serving and offline benchmarks.

Everything is a pure function of the seed (and the other arguments), so two runs of a benchmark,
or a benchmark and its test, see byte-identical prompts and media. Media are encoded here, before
any clock starts: a benchmark must time the server, not the client's PNG encoder.
"""

from __future__ import annotations

import base64
import io
import math
import random
import re
import dataclasses
from dataclasses import dataclass

import numpy as np
from PIL import Image

from tessera.demo import scenes

SERVING_DATASETS = ("random-image", "random-video", "scenes", "random-audio")
OFFLINE_WORKLOADS = ("a", "b", "c", "d")

# Words for random prompts: the demo grammar plus generic English, which the demo tokenizer was
# trained on, so prompt lengths stay predictable (about 1.2 tokens per word with demo-vl).
_WORDS = tuple(sorted({w.strip(".,!?") for line in (
    "you are a helpful assistant what is shown here please describe the picture in detail",
    "the quick brown fox jumps over lazy dog hello world how are you today tell me about this image",
    "and objects in it what do you see which way moving answer yes or no count from left to right",
    "there picture of cat car house tree person on street zero one two three four five six seven",
    " ".join(scenes.COLORS), " ".join(scenes.SHAPES), " ".join(scenes.DIRECTIONS),
) for w in line.split()}))


@dataclass(frozen=True)
class Resolution:
    """A fixed size, or a range each side is drawn from uniformly (`random:min-max`)."""

    min_side: int
    max_side: int
    width: int | None = None
    height: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Resolution:
        spec = spec.strip().lower()
        if m := re.fullmatch(r"(\d+)x(\d+)", spec):
            w, h = int(m[1]), int(m[2])
            if w < 1 or h < 1:
                raise ValueError(f"image_resolution: sides must be positive, got {spec!r}")
            return cls(min(w, h), max(w, h), w, h)
        if m := re.fullmatch(r"random:(\d+)-(\d+)", spec):
            lo, hi = int(m[1]), int(m[2])
            if not 1 <= lo <= hi:
                raise ValueError(f"image_resolution: need 1 <= min <= max in {spec!r}")
            return cls(lo, hi)
        raise ValueError(f"image_resolution: expected WxH (e.g. 448x448) or random:MIN-MAX, got {spec!r}")

    def draw(self, rng: random.Random) -> tuple[int, int]:
        if self.width is not None and self.height is not None:
            return self.width, self.height
        return rng.randint(self.min_side, self.max_side), rng.randint(self.min_side, self.max_side)


def random_image(rng: random.Random, width: int, height: int) -> Image.Image:
    """Uniform noise, as in SGLang's random-image dataset: no two images share a prefix-cache key."""
    pixels = np.random.default_rng(rng.getrandbits(64)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def encode_image(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    # JPEG for noise (PNG cannot compress it); PNG for flat scenes (lossless and small).
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def encode_video(frames: list[Image.Image], fps: int = 4) -> bytes:
    """An MP4 in memory, encoded like the bundled examples."""
    from tessera.demo.examples import encode_video as encode

    return encode(frames, fps)


AUDIO_RATE = 16_000


def random_audio(rng: random.Random, seconds: float) -> bytes:
    """A 16 kHz mono WAV of tone bursts ("words", 0.2-0.6 s at 150-800 Hz) between quiet gaps, plus faint
    noise: what speech looks like to a feature extractor, and never twice the same (no cache hits)."""
    import soundfile as sf

    gen = np.random.default_rng(rng.getrandbits(64))
    total = int(seconds * AUDIO_RATE)
    x = 0.003 * gen.standard_normal(total).astype(np.float32)
    pos = int(gen.uniform(0.05, 0.3) * AUDIO_RATE)
    while pos < total:
        n = min(total - pos, int(gen.uniform(0.2, 0.6) * AUDIO_RATE))
        t = np.arange(n) / AUDIO_RATE
        x[pos : pos + n] += 0.3 * np.sin(2 * np.pi * gen.uniform(150, 800) * t) * np.hanning(n)
        pos += n + int(gen.uniform(0.1, 0.4) * AUDIO_RATE)
    buf = io.BytesIO()
    sf.write(buf, x, AUDIO_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def data_uri(payload: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


@dataclass(frozen=True)
class BenchRequest:
    """One serving-benchmark request: text, encoded media and the output length to force."""

    text: str
    images: tuple[bytes, ...]
    image_mime: str
    videos: tuple[bytes, ...]
    output_len: int
    audios: tuple[bytes, ...] = ()  # WAV files

    def openai_messages(self) -> list[dict]:
        """Chat messages with media as data URIs (so any OpenAI-compatible server can read them); audio as
        OpenAI's `input_audio` parts."""
        content: list[dict] = [{"type": "image_url", "image_url": {"url": data_uri(b, self.image_mime)}}
                               for b in self.images]
        content += [{"type": "video_url", "video_url": {"url": data_uri(v, "video/mp4")}} for v in self.videos]
        content += [{"type": "input_audio", "input_audio": {"data": base64.b64encode(a).decode(), "format": "wav"}}
                    for a in self.audios]
        content.append({"type": "text", "text": self.text})
        return [{"role": "user", "content": content}]


def make_serving_dataset(name: str, num_prompts: int, *, seed: int = 0, image_resolution: str = "448x448",
                         image_count: int = 1, output_len: int = 128, input_len: int = 32,
                         video_frames: int = 8, audio_seconds: float = 4.0) -> list[BenchRequest]:
    """Requests for `tessera bench serving`.

    random-image: `image_count` noise images of `image_resolution` and `input_len` random words.
    random-video: one noise video of `video_frames` frames at `image_resolution`, plus random words.
    random-audio: one synthetic clip of `audio_seconds` (for audio models such as demo-asr), then
      "Transcribe the audio." and `input_len` random words.
    scenes: `image_count` demo-grammar scenes (their own canvas sizes) with a question demo-vl knows.
    """
    if name not in SERVING_DATASETS:
        raise ValueError(f"dataset: unknown {name!r}; expected one of {', '.join(SERVING_DATASETS)}")
    for field_name, value, low in (("num_prompts", num_prompts, 1), ("image_count", image_count, 0),
                                   ("output_len", output_len, 1), ("input_len", input_len, 0),
                                   ("video_frames", video_frames, 2)):
        if value < low:
            raise ValueError(f"{field_name}: must be >= {low}, got {value}")
    if name == "scenes" and image_count < 1:
        raise ValueError("image_count: the scenes dataset asks about images; it needs at least 1")
    if not 0.1 <= audio_seconds <= 600:
        raise ValueError(f"audio_seconds: must be in 0.1..600, got {audio_seconds}")
    res = Resolution.parse(image_resolution)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        if name == "scenes":
            samples = [scenes.image_sample(rng) for _ in range(image_count)]
            text = samples[0].question if len(samples) == 1 else "Describe the image."
            images = tuple(encode_image(s.frames[0], "PNG") for s in samples)
            out.append(BenchRequest(text, images, "image/png", (), output_len))
        elif name == "random-image":
            images = tuple(encode_image(random_image(rng, *res.draw(rng)), "JPEG") for _ in range(image_count))
            out.append(BenchRequest(random_text(rng, input_len), images, "image/jpeg", (), output_len))
        elif name == "random-audio":
            text = " ".join(["Transcribe the audio.", random_text(rng, input_len)]).strip()
            out.append(BenchRequest(text, (), "image/jpeg", (), output_len, (random_audio(rng, audio_seconds),)))
        else:  # random-video
            w, h = res.draw(rng)
            frames = [random_image(rng, w, h) for _ in range(video_frames)]
            out.append(BenchRequest(random_text(rng, input_len), (), "image/jpeg", (encode_video(frames),),
                                    output_len))
    return out


def poisson_intervals(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait after each request before sending the next: exponential gaps at `request_rate`
    requests/s (a Poisson process), or all zeros for an infinite rate (everything at once)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be positive (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed ^ 0x5EED)  # its own stream: changing the rate must not change the prompts
    return [rng.expovariate(request_rate) for _ in range(num)]


# ---------------------------------------------------------------- offline workloads


@dataclass(frozen=True)
class OfflineRequest:
    """One offline-benchmark request; the chat prompt is built later with the model's template."""

    question: str
    images: tuple[Image.Image, ...]
    output_len: int
    system: str | None = None


def offline_workload(name: str, *, seed: int = 0, num_requests: int = 64, max_output_len: int | None = None,
                     system_prompt: str = "", num_distinct_images: int = 8) -> list[OfflineRequest]:
    """The requests of workload a, b or c (d reuses a's first requests; see offline.py).

    a: one scene image each, mixed canvas sizes (128..512 px a side), output lengths 16..128.
    b: `num_distinct_images` scenes shared round-robin; request i shows image i % n, so the first n
       are first-seen and the rest repeats; the question varies so only the image prefix is shared.
    c: every request starts with `system_prompt` (512 tokens in the benchmark) and has its own image.
    """
    if name not in ("a", "b", "c"):
        raise ValueError(f"workload: expected a, b or c, got {name!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    rng = random.Random(f"tessera-bench-{name}-{seed}")
    cap = max_output_len or 1 << 30

    def length(lo: int, hi: int) -> int:
        return min(cap, rng.randint(lo, hi))

    if name == "a":
        samples = [scenes.image_sample(rng) for _ in range(num_requests)]
        return [OfflineRequest(s.question, s.frames, length(16, 128)) for s in samples]
    if name == "b":
        pool = [scenes.image_sample(rng).frames[0] for _ in range(num_distinct_images)]
        questions = ("Describe the image.", "How many shapes are there?", "What color is the circle?",
                     "What shape is the red object?")
        return [OfflineRequest(questions[(i // num_distinct_images) % len(questions)],
                               (pool[i % num_distinct_images],), min(cap, 32)) for i in range(num_requests)]
    if not system_prompt:
        raise ValueError("system_prompt: workload c needs the shared system prompt")
    samples = [scenes.image_sample(rng) for _ in range(num_requests)]
    return [OfflineRequest(s.question, s.frames, min(cap, 32), system_prompt) for s in samples]


def long_text(seed: int, num_words: int) -> str:
    """Deterministic filler text (for the shared system prompt of workload c)."""
    return random_text(random.Random(f"tessera-bench-system-{seed}"), num_words)


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    requests: list[OfflineRequest]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def head(self, n: int, output_len: int) -> Workload:
        reqs = [dataclasses.replace(r, output_len=output_len) for r in self.requests[:n]]
        return Workload(self.prompts[:n], reqs)
