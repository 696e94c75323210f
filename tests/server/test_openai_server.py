"""Integration tests: a real `tessera serve` driven by the official openai client and raw HTTP."""

from __future__ import annotations

import base64
import io
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from PIL import Image

from tessera.config import ASSETS_DIR
from tessera.demo import scenes
from tests.server.server_process import (
    free_port,
    wait_until_idle,
)

EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"
EXAMPLE_VIDEO = ASSETS_DIR / "examples" / "moving.mp4"


def data_uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def media_dir(vl_media_dir):
    return vl_media_dir


@pytest.fixture(scope="module")
def server(vl_server):  # shared with test_api_conformance (one demo-vl per session)
    return vl_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def ask(client, content, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="demo-vl", messages=[{"role": "user", "content": content}], **kw)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def test_models_and_model_info(server, client):
    assert [m.id for m in client.models.list().data] == ["demo-vl"]
    info = httpx.get(f"{server.base_url}/model_info").json()
    assert info["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert info["has_image_understanding"] and info["has_video_understanding"]
    assert not info["has_audio_understanding"]


def test_answers_scene_questions_like_hf(client):
    """Through the API the demo model gives HF transformers' greedy answers to every question type,
    and its reliable question (counting) is answered correctly."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = ASSETS_DIR / "demo-vl"
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    rng = random.Random(77)
    samples = [scenes.image_sample(rng, q) for q in scenes.IMAGE_QUESTION_TYPES for _ in range(2)]
    samples += [scenes.image_sample(rng, "count") for _ in range(6)]
    num_right = 0
    for s in samples:
        msgs = [{"role": "user", "content": [{"type": "image"}, text_part(s.question)]}]
        text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[s.frames[0]], return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        hf_answer = processor.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)[0]
        reply = ask(client, [image_part(data_uri(s.frames[0])), text_part(s.question)])
        assert reply.choices[0].message.content == hf_answer.strip()
        assert reply.usage.prompt_tokens == enc["input_ids"].shape[1]
        if s.question_type == "count":
            num_right += reply.choices[0].message.content == s.answer
    assert num_right >= 7  # of 8 counting questions (the model's measured count accuracy is in docs/models.md)


def test_local_path_and_file_uri(client, media_dir):
    question = text_part("How many shapes are there?")
    a = ask(client, [image_part(str(media_dir / "scene.png")), question])
    b = ask(client, [image_part(f"file://{media_dir / 'scene.png'}"), question])
    c = ask(client, [question, image_part(data_uri(Image.open(EXAMPLE_IMAGE)))])  # text first, as in the seed docs
    assert a.choices[0].message.content == b.choices[0].message.content == c.choices[0].message.content == "three"


def test_video_url(client, media_dir):
    """A video by local path gives HF's greedy answer for the same decoded frames."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tessera.multimodal.media import load_video
    from tessera.multimodal.media_source import MediaLimits

    question = "Which way is the green circle moving?"
    reply = ask(client, [{"type": "video_url", "video_url": {"url": str(media_dir / "moving.mp4")}},
                         text_part(question)])
    path = ASSETS_DIR / "demo-vl"
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    clip = load_video(str(media_dir / "moving.mp4"), limits=MediaLimits.offline())
    frames = clip.frames if hasattr(clip, "frames") else clip
    msgs = [{"role": "user", "content": [{"type": "video"}, text_part(question)]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], videos=[list(frames)], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    hf_answer = processor.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)[0].strip()
    assert reply.choices[0].message.content == hf_answer
    assert reply.usage.prompt_tokens == enc["input_ids"].shape[1]


def test_several_images_in_one_message(client):
    rng = random.Random(5)
    imgs = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    reply = ask(client, [image_part(data_uri(imgs[0])), image_part(data_uri(imgs[1])), text_part("Describe the image.")])
    assert reply.choices[0].finish_reason in ("stop", "length")
    single = ask(client, [image_part(data_uri(imgs[0])), text_part("Describe the image.")])
    assert reply.usage.prompt_tokens > single.usage.prompt_tokens


def test_stream_equals_non_stream_and_usage(client):
    content = [image_part(data_uri(Image.open(EXAMPLE_IMAGE))), text_part("Describe the image.")]
    full = ask(client, content)
    chunks = list(ask(client, content, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The second identical request reused the image's KV through the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens - 2


def test_n_logprobs_seed(client):
    reply = ask(client, "Say something.", n=3, temperature=1.0, seed=11, logprobs=True, top_logprobs=2,
                max_tokens=6)
    assert len(reply.choices) == 3
    for ch in reply.choices:
        assert ch.logprobs.content and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
        assert all(t.logprob <= 0 for t in ch.logprobs.content)
    again = ask(client, "Say something.", n=3, temperature=1.0, seed=11, max_tokens=6)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_completions_and_native_generate(server, client):
    comp = client.completions.create(model="demo-vl", prompt="Hello", max_tokens=4, temperature=0)
    assert 0 < comp.usage.completion_tokens <= 4
    native = httpx.post(f"{server.base_url}/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=60).json()
    assert native["text"] == comp.choices[0].text
    assert native["meta_info"]["completion_tokens"] == comp.usage.completion_tokens


@pytest.mark.parametrize("body,status,needle", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]},
     400, "base64"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
     400, "outside the allowed"),
    ({"messages": [{"role": "user", "content": [{"type": "fancy"}]}]}, 400, "unsupported"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi " * 5000}]}, 400, "context"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and "type" in err


def test_unfetchable_url_is_422(server):
    url = f"http://127.0.0.1:{free_port()}/missing.png"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [image_part(url), text_part("hi")]}]})
    assert r.status_code == 422, r.text


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


def _stats(server) -> dict:
    return httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["stats"]


def test_disconnect_mid_stream_frees_kv(server):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True, "max_tokens": 3000,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    s = wait_until_idle(server.base_url)
    assert s["num_running"] == 0 and s["kv_used_tokens"] == 0, s


def test_health_stays_responsive_during_heavy_preprocessing(server):
    big = Image.new("RGB", (2000, 1500), (255, 255, 255))
    uri = data_uri(big)
    body = {"messages": [{"role": "user", "content": [image_part(uri), text_part("How many shapes are there?")]}],
            "max_tokens": 4}

    def post(_):
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300).status_code

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post, i) for i in range(16)]
        time.sleep(0.5)
        worst = 0.0
        for _ in range(5):
            t0 = time.monotonic()
            assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.2)
        codes = [f.result() for f in futures]
    assert codes == [200] * 16
    assert worst < 1.0, f"/health took {worst:.2f}s while preprocessing"


def test_metrics_exposes_serving_figures(server, client):
    content = [image_part(data_uri(Image.open(EXAMPLE_IMAGE))), text_part("How many shapes are there?")]
    ask(client, content)
    ask(client, content)  # a repeat: prefix and encoder caches hit
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):  # summed over label sets
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert values["tessera_requests_total"] >= 2
    assert values["tessera_prefix_cache_hit_rate"] > 0
    # demo-vl's ~224x224 features are small: the example image is preprocessed by the frontend (eager), whose
    # preprocessing cache serves the repeat.
    eager = [line for line in text.splitlines() if line.startswith("tessera_mm_items{") and "eager" in line]
    assert eager and float(eager[0].rsplit(" ", 1)[1]) >= 2
    assert values["tessera_preprocess_cache_hit_rate"] > 0
    assert values["tessera_mm_transport_bytes"] > 0
    assert values["tessera_time_to_first_token_seconds_count"] >= 2
    # The device's time: busy in steps, idle between consecutive ones (the scheduler's host work).
    assert values["tessera_device_busy_seconds"] > 0 and values["tessera_device_idle_between_steps_seconds"] > 0
    assert 0 < values["tessera_device_idle_fraction"] < 1
    for name in ("tessera_requests_total", "tessera_time_to_first_token_seconds", "tessera_inter_token_latency_seconds",
                 "tessera_num_running_reqs", "tessera_num_queue_reqs", "tessera_kv_cache_usage",
                 "tessera_prefix_cache_hit_rate", "tessera_encoder_cache_hit_rate",
                 "tessera_preprocess_cache_hit_rate", "tessera_mm_transport_bytes", "tessera_mm_items"):
        assert name in text
