"""/v1/audio/transcriptions on a real `tessera serve` of a tiny random Qwen2-Audio checkpoint.

The model is random, so its words are noise: these tests check formats, timing, windowing and refusals.
Word accuracy is demo-asr's business.
"""

from __future__ import annotations

import base64
import json
import re

import httpx
import numpy as np
import openai
import pytest

from tessera.entrypoints.openai.transcript_format import cue_text, format_srt, format_vtt
from tests.audio_testing import RATE, build_tiny_audio_checkpoint, speechlike, wav_bytes
from tests.server.server_process import ServerProcess

LONG_S = 70.0
SRT_CUE = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)\n(.+)")
VTT_CUE = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d\d\d) --> (\d\d):(\d\d):(\d\d)\.(\d\d\d)\n(.+)")


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory):
    path = build_tiny_audio_checkpoint(tmp_path_factory.mktemp("tiny-asr-server"))
    srv = ServerProcess("--model-path", str(path), "--served-model-name", "tiny-asr", "--max-total-tokens", "16384")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(audio_server):
    return openai.OpenAI(base_url=f"{audio_server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def short_wav() -> bytes:
    return wav_bytes(speechlike(3.0, seed=1))


@pytest.fixture(scope="module")
def long_wav() -> bytes:
    return wav_bytes(speechlike(LONG_S, seed=2))


def transcribe(client, data: bytes, **kw):
    return client.audio.transcriptions.create(model="tiny-asr", file=("clip.wav", data, "audio/wav"), **kw)


def _seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def test_model_info_reports_audio(audio_server):
    info = httpx.get(f"{audio_server.base_url}/model_info").json()
    assert info["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert info["has_audio_understanding"] and not info["has_image_understanding"]


def test_json_text_and_stream_agree(client, short_wav):
    result = transcribe(client, short_wav)
    assert isinstance(result.text, str) and result.text == result.text.strip() and result.text
    assert result.usage.type == "duration" and result.usage.seconds == 3
    text = transcribe(client, short_wav, response_format="text")
    assert isinstance(text, str) and text == result.text + "\n"
    events = list(transcribe(client, short_wav, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert [e.type for e in events][-1] == "transcript.text.done" and deltas
    done = events[-1]
    assert "".join(deltas) == done.text == result.text  # greedy: the same text streamed or not
    assert done.usage.input_tokens > 0 and done.usage.output_tokens == len(transcribe(
        client, short_wav, response_format="verbose_json").segments[0].tokens)
    prompted = transcribe(client, short_wav, prompt="Digits, colors and shapes.", language="en")
    assert isinstance(prompted.text, str)  # the prompt becomes the system message


def test_verbose_json_segments_cover_a_long_clip(client, long_wav, short_wav):
    result = transcribe(client, long_wav, response_format="verbose_json", timestamp_granularities=["segment"])
    assert result.duration == pytest.approx(LONG_S, abs=1e-3)
    segments = result.segments
    assert len(segments) == 3  # 70 s in windows of at most 30 s
    assert segments[0].start == 0 and segments[-1].end == pytest.approx(LONG_S, abs=1e-3)
    for a, b in zip(segments, segments[1:]):
        assert a.end == b.start and a.id + 1 == b.id
    clip = speechlike(LONG_S, seed=2)
    for s in segments:
        assert 0 < s.end - s.start <= 30.0
        if s is not segments[-1]:  # cut within the 2 s searched before the window's end, in a quiet gap
            assert s.end - s.start >= 27.7
            around_cut = clip[int(s.end * RATE) - 160: int(s.end * RATE) + 160]
            assert np.sqrt(np.mean(around_cut ** 2)) < 0.01  # the tone "words" are 0.3 loud
        assert isinstance(s.tokens, list) and all(isinstance(t, int) for t in s.tokens)
        assert s.avg_logprob <= 0 and s.compression_ratio > 0 and s.temperature == 0
    assert result.text == " ".join(s.text for s in segments if s.text)
    assert result.language == "unknown"  # no language detected, named or declared by the checkpoint
    named = transcribe(client, short_wav, response_format="verbose_json", language="de")
    assert named.language == "de"


def test_srt_and_vtt_of_a_long_clip(client, long_wav):
    verbose = transcribe(client, long_wav, response_format="verbose_json")
    srt = transcribe(client, long_wav, response_format="srt")
    cues = srt.strip("\n").split("\n\n")
    expected = [s for s in verbose.segments if cue_text(s.text)]
    assert len(cues) == len(expected) >= 2
    for i, (cue, seg) in enumerate(zip(cues, expected), start=1):
        m = SRT_CUE.fullmatch(cue)
        assert m, cue
        assert int(m.group(1)) == i and m.group(10) == cue_text(seg.text)
        assert _seconds(*m.group(2, 3, 4, 5)) == pytest.approx(seg.start, abs=1e-3)
        assert _seconds(*m.group(6, 7, 8, 9)) == pytest.approx(seg.end, abs=1e-3)
    assert cues[-1].split("\n")[1].endswith("--> 00:01:10,000")
    vtt = transcribe(client, long_wav, response_format="vtt", language="en")
    assert vtt.startswith("WEBVTT\n\n")
    vtt_cues = vtt[len("WEBVTT\n\n"):].strip("\n").split("\n\n")
    assert len(vtt_cues) == len(expected)
    for cue, seg in zip(vtt_cues, expected):
        m = VTT_CUE.fullmatch(cue)
        assert m, cue
        assert _seconds(*m.group(1, 2, 3, 4)) == pytest.approx(seg.start, abs=1e-3)
        assert m.group(9) == cue_text(seg.text)


def test_formatters_on_fixed_segments():
    segments = [{"start": 0.0, "end": 1.5, "text": "one two"}, {"start": 1.5, "end": 2.0, "text": " \n"},
                {"start": 2.0, "end": 3725.0421, "text": "red\n\ncircle --> up"}]
    assert format_srt(segments) == ("1\n00:00:00,000 --> 00:00:01,500\none two\n\n"
                                    "2\n00:00:02,000 --> 01:02:05,042\nred circle -> up\n\n")
    assert format_vtt(segments) == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\none two\n\n"
                                    "00:00:02.000 --> 01:02:05.042\nred circle -> up\n\n")


def test_stream_of_a_long_clip_over_raw_http(audio_server, long_wav):
    files = {"file": ("clip.wav", long_wav, "audio/wav")}
    data = {"model": "tiny-asr", "stream": "true", "response_format": "text"}
    events = []
    with httpx.stream("POST", f"{audio_server.base_url}/v1/audio/transcriptions", files=files, data=data,
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[-1]["type"] == "transcript.text.done"
    assert "".join(p["delta"] for p in parsed[:-1]) == parsed[-1]["text"]


@pytest.mark.parametrize("data,form,message", [
    (b"RIFF\x00\x00\x00\x00WAVEjunk", {}, "file: .*(corrupt|unsupported audio|no decodable)"),
    (b"not audio at all" * 40, {}, "file: "),
    (None, {"response_format": "docx"}, "response_format: Input should be 'json', .*got 'docx'"),
    (None, {"temperature": "hot"}, "temperature: Input should be a valid number"),
    (None, {"language": "english please"}, "language: expected an ISO-639-1 code"),
    (None, {"language": "xx"}, "language: expected an ISO-639-1 code"),  # well formed, but no such language
    (None, {"stream": "true", "response_format": "srt"}, "stream: streaming is supported with"),
    (None, {"timestamp_granularities[]": "word"}, "timestamp_granularities: only 'segment'"),
    (None, {"speaker": "me"}, "speaker: unknown field"),
])
def test_bad_requests_are_400_with_the_field_named(audio_server, short_wav, data, form, message):
    files = {"file": ("clip.wav", data if data is not None else short_wav, "audio/wav")}
    r = httpx.post(f"{audio_server.base_url}/v1/audio/transcriptions", files=files,
                   data={"model": "tiny-asr", **form}, timeout=60)
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()


def test_missing_file_and_json_body_are_refused(audio_server, client):
    r = httpx.post(f"{audio_server.base_url}/v1/audio/transcriptions", data={"model": "tiny-asr"},
                   files={"other": ("x", b"y")}, timeout=30)
    assert r.status_code == 400 and "other: unknown field" in r.json()["error"]["message"]
    r = httpx.post(f"{audio_server.base_url}/v1/audio/transcriptions", json={"model": "tiny-asr"}, timeout=30)
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="file: "):
        transcribe(client, b"\x00" * 300)


def test_chat_with_input_audio(client, short_wav):
    reply = client.chat.completions.create(
        model="tiny-asr", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(short_wav).decode(), "format": "wav"}},
            {"type": "text", "text": "Transcribe the audio."}]}])
    assert reply.usage.completion_tokens == 6 or reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 75  # 3 s of audio is 75 placeholder tokens


def test_a_vision_model_refuses_transcription(short_wav, vl_server):
    r = httpx.post(f"{vl_server.base_url}/v1/audio/transcriptions", data={"model": "demo-vl"},
                   files={"file": ("clip.wav", short_wav, "audio/wav")}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "does not understand audio" in message and "Qwen2VLForConditionalGeneration" in message
    assert r.json()["error"]["param"] == "model"
