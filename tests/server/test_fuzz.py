"""Fuzzing the request paths with hypothesis, 10,000+ generated inputs in all: chat bodies and native /generate
bodies through the real ASGI app (middleware, routes, validation, tokenization, media loading and
preprocessing of demo-vl, with a stand-in for the scheduler), the multipart transcription form, and the media
loaders. Whatever arrives: never a 5xx, never a crash; every refusal a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
COUNTS = {"chat": 2000, "generate": 2000, "form": 3500, "loaders": 2500}
SEEN: dict[str, int] = {k: 0 for k in COUNTS}


def _png(size=(16, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _wav() -> bytes:
    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    return buf.getvalue()


PNG, WAV = _png(), _wav()
B64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
URLS = st.sampled_from([
    f"data:image/png;base64,{B64(PNG)}", f"data:image/png;base64,{B64(PNG[:40])}", "data:image/png;base64,!!",
    "data:,", "data:image/png,rawbytes", B64(PNG), "/etc/passwd", "file:///etc/passwd", "relative/x.png",
    "http://127.0.0.1:1/x.png", "http://169.254.169.254/", "http://[::1]/", "http://[bad", "ftp://x/y",
    "javascript:alert(1)", "", " ", "\x00", "data:video/mp4;base64,AAAA", f"data:audio/wav;base64,{B64(WAV)}",
])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
SMALL_INT = st.integers(-3, 40) | st.sampled_from([2**31, 2**63, -2**63, 10**9])
PARAM_VALUE = SMALL_INT | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none() \
    | st.text(max_size=10) | st.lists(st.integers(-5, 200) | st.text(max_size=5), max_size=3) | JSON

PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40) | JSON}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": URLS}) | JSON}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": URLS})}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries(
        {"data": st.sampled_from([B64(WAV), "!!", ""]), "format": st.sampled_from(["wav", "mp3", "x"])})}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "audio_url", "fancy", "", "refusal"])}),
    JSON,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]) | JSON},
    optional={"content": st.text(max_size=60) | st.lists(PART, max_size=4) | JSON,
              "name": st.text(max_size=5), "tool_calls": JSON, "tool_call_id": JSON})
CHAT_PARAMS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
               "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs", "top_logprobs",
               "stream", "stream_options", "ignore_eos", "logit_bias", "response_format", "tools", "tool_choice",
               "model", "user", "min_tokens", "skip_special_tokens"]
CHAT_BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={k: PARAM_VALUE for k in CHAT_PARAMS})
SP_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n", "seed",
           "ignore_eos", "min_new_tokens", "frequency_penalty", "repetition_penalty", "skip_special_tokens", "json_schema",
           "regex", "bogus"]
GENERATE_BODY = st.fixed_dictionaries({}, optional={
    "text": st.text(max_size=60) | st.lists(st.text(max_size=10), max_size=3) | JSON,
    "input_ids": st.lists(st.integers(-5, 200000), max_size=20) | st.lists(st.lists(st.integers(0, 300), max_size=5),
                                                                          max_size=3) | JSON,
    "sampling_params": st.dictionaries(st.sampled_from(SP_KEYS), PARAM_VALUE, max_size=5) | JSON,
    "image_data": URLS | st.lists(URLS, max_size=3) | JSON, "audio_data": URLS | JSON, "video_data": URLS | JSON,
    "stream": st.booleans() | JSON, "return_logprob": st.booleans() | JSON, "top_logprobs_num": SMALL_INT | JSON,
    "rid": st.text(max_size=8) | JSON, "logprob_start_len": SMALL_INT, "modalities": JSON, "cache_salt": JSON,
    "bogus": JSON})




@pytest.fixture(scope="module")
def client():
    from tests.server.stub_app import stub_client

    with stub_client() as c:
        yield c


def check(r) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["code"] == r.status_code, r.text[:300]
        assert "Traceback" not in err["message"]


@pytest.mark.slow
@settings(max_examples=COUNTS["chat"], **FUZZ)
@given(body=CHAT_BODY | JSON)
@example(body={"messages": [{"role": "user", "content": "hi"}], "n": 10**9})
def test_fuzz_chat_completions(client, body):
    SEEN["chat"] += 1
    check(client.post("/v1/chat/completions", content=json.dumps(body, allow_nan=True).encode()))


@pytest.mark.slow
@settings(max_examples=COUNTS["generate"], **FUZZ)
@given(body=GENERATE_BODY | JSON, raw=st.binary(max_size=40) | st.none())
@example(body={"text": "", "sampling_params": {"n": 0}}, raw=None)  # was a 500 (no output to return)
@example(body={"text": "hi", "sampling_params": {"n": 10**9}}, raw=None)  # built 10**9 requests: out of memory
@example(body={"text": "", "sampling_params": {"max_new_tokens": None, "seed": ""}}, raw=None)  # was a 500 (seed + i)
@example(body={"text": "hi", "sampling_params": {"n": 2, "seed": [1]}}, raw=None)
def test_fuzz_native_generate(client, body, raw):
    SEEN["generate"] += 1
    content = raw if raw is not None and body == {} else json.dumps(body, allow_nan=True).encode()
    check(client.post("/generate", content=content))


FORM_FIELDS = ["model", "language", "prompt", "response_format", "temperature", "stream", "timestamp_granularities[]",
               "include[]", "bogus", "file"]


def _multipart(fields: list[tuple[str, bytes, bool]], boundary: str) -> bytes:
    out = []
    for name, value, as_file in fields:
        disposition = f'form-data; name="{name}"' + ('; filename="a.wav"' if as_file else "")
        out.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    return b"".join(out) + f"--{boundary}--\r\n".encode()


@pytest.mark.slow
@settings(max_examples=COUNTS["form"], **FUZZ)
@given(fields=st.lists(st.tuples(st.sampled_from(FORM_FIELDS) | st.text(max_size=6),
                                 st.binary(max_size=30) | st.sampled_from([WAV, b"en", b"json", b"srt", b"0.5", b"true",
                                                                           b"nan", b"segment", b"demo-asr"]),
                                 st.booleans()), max_size=6),
       boundary=st.sampled_from(["b0undary", "x", "----WebKitFormBoundary7MA4YWxkTrZu0gW"]),
       content_type=st.sampled_from(["multipart/form-data; boundary={b}", "multipart/form-data",
                                     "multipart/form-data; boundary=other", "application/json", ""]),
       garbage=st.binary(max_size=60) | st.none())
def test_fuzz_transcription_form(fields, boundary, content_type, garbage):
    import asyncio

    from starlette.requests import Request

    from tessera.entrypoints.openai.errors import APIError
    from tessera.entrypoints.openai.transcriptions import parse_transcription_form

    SEEN["form"] += 1
    body = garbage if garbage is not None and not fields else _multipart(fields, boundary)
    headers = [(b"content-type", content_type.format(b=boundary).encode()),
               (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions", "headers": headers,
             "query_string": b""}
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def parse():
        try:
            await parse_transcription_form(Request(scope, receive), max_bytes=1 << 20)
        except APIError as e:
            assert 400 <= e.status < 500 and e.message

    asyncio.run(parse())


@pytest.mark.slow
@settings(max_examples=COUNTS["loaders"], **FUZZ)
@given(data=st.binary(max_size=300) | st.sampled_from([PNG, PNG[:60], WAV, WAV[:50]]).map(bytes)
       | st.tuples(st.sampled_from([PNG, WAV]), st.integers(0, 200), st.binary(min_size=1, max_size=8)).map(
           lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]):]),
       which=st.sampled_from(["image", "video", "audio"]),
       as_text=st.booleans())
def test_fuzz_media_loaders(data, which, as_text):
    from tessera.multimodal.media import MediaError, MediaLimits, load_audio, load_image, load_video

    SEEN["loaders"] += 1
    limits = MediaLimits(max_image_pixels=1 << 20, max_video_frames=8, max_video_source_frames=256,
                         max_audio_seconds=10.0)
    src = f"data:application/octet-stream;base64,{B64(data)}" if as_text else data
    try:
        if which == "image":
            load_image(src, limits=limits)
        elif which == "video":
            load_video(src, limits=limits)
        else:
            load_audio(src, limits=limits, sampling_rate=16000)
    except MediaError as e:
        assert 400 <= e.status < 600 and str(e)


@pytest.mark.parametrize("n", [0, -1, 129, 10**9, True, 1.5, "2"])
def test_n_is_checked_before_it_sizes_anything(n):
    """Regression (found by the fuzzing below): n is bounded before the requests are fanned out."""
    from tessera.entrypoints.openai.errors import APIError
    from tessera.entrypoints.openai.serving import OpenAIServing
    from tessera.messages.sampling import SamplingParams

    serving = object.__new__(OpenAIServing)  # fan_out needs no engine
    with pytest.raises(APIError, match=r"n: must be an integer in \[1, 128\]"):
        serving.fan_out({"text": "hi"}, SamplingParams(n=n))
    assert len(serving.fan_out({"text": "hi"}, SamplingParams(n=128))) == 128


def test_batches_are_bounded(client):
    big = {"text": ["hi"] * 1025, "sampling_params": {"max_new_tokens": 1}}
    r = client.post("/generate", json=big)
    assert r.status_code == 400 and "at most 1024 prompts" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": ["hi"] * 1025, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.slow
def test_fuzz_volume():
    """Runs last in this file: the generated inputs really added up to 10,000 or more."""
    if any(SEEN[k] == 0 for k in SEEN):
        pytest.skip("run the whole file to count the inputs")
    assert sum(SEEN.values()) >= 10_000, SEEN
