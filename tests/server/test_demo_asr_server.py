"""demo-asr served over HTTP: the committed espeak-ng fixtures come back as their transcripts through the
official openai client (transcriptions endpoint, every text format, and chat with input_audio)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import openai
import pytest

from tessera.demo.speech import INSTRUCTION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "speech"
CASES = sorted(json.loads((FIXTURES / "transcripts.json").read_text()).items())


@pytest.fixture(scope="module")
def client(demo_asr_server):
    return openai.OpenAI(base_url=f"{demo_asr_server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.mark.parametrize("name,info", CASES)
def test_transcriptions_of_the_fixtures(client, name, info):
    data = (FIXTURES / name).read_bytes()
    result = client.audio.transcriptions.create(model="demo-asr", file=(name, data, "audio/wav"))
    assert result.text == info["transcript"]
    text = client.audio.transcriptions.create(model="demo-asr", file=(name, data, "audio/wav"),
                                              response_format="text")
    assert text == info["transcript"] + "\n"
    srt = client.audio.transcriptions.create(model="demo-asr", file=(name, data, "audio/wav"),
                                             response_format="srt")
    assert srt.split("\n")[2] == info["transcript"]


def test_chat_with_input_audio(client):
    name, info = CASES[0]
    audio = base64.b64encode((FIXTURES / name).read_bytes()).decode()
    reply = client.chat.completions.create(
        model="demo-asr", temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": INSTRUCTION},  # the template puts audio first whatever the order
            {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]}])
    assert reply.choices[0].message.content == info["transcript"]
    assert reply.choices[0].finish_reason == "stop"


def test_serving_benchmark_random_audio(demo_asr_server):
    import asyncio

    from tessera.bench.serving import ServingConfig, run_benchmark_async

    cfg = ServingConfig(base_url=demo_asr_server.base_url, dataset="random-audio", num_prompts=4, output_len=3,
                        input_len=0, audio_seconds=2.0, max_concurrency=2, disable_tqdm=True)
    m = asyncio.run(run_benchmark_async(cfg))["metrics"]
    assert (m["num_completed"], m["num_failed"]) == (4, 0), m["errors"]
    assert m["total_output_tokens"] == 4 * 3
    assert m["total_input_tokens"] > 4 * 50  # 2 s of audio is 50 placeholder tokens


def test_long_audio_is_cut_into_windows_and_joined(client):
    """The six fixtures one every 6.5 s (about 33 s): demo-asr's 6 s windows are cut in the silences between
    them, one utterance per window (the model knows utterances of at most six words), and the window
    transcripts join in order. Each window holds up to 4 s of silence around its utterance (what demo-asr's
    last training phase was for)."""
    import io

    import numpy as np
    import soundfile as sf

    period = int(6.5 * 16000)
    clips = [sf.read(FIXTURES / name, dtype="float32")[0] for name, _ in CASES]
    parts = [np.pad(clip, (0, period - len(clip))) for clip in clips[:-1]] + [np.pad(clips[-1], (0, 4800))]
    audio = np.concatenate(parts)
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="WAV", subtype="PCM_16")
    result = client.audio.transcriptions.create(model="demo-asr", file=("long.wav", buf.getvalue(), "audio/wav"),
                                                response_format="verbose_json")
    assert result.duration == pytest.approx(len(audio) / 16000, abs=1e-3)
    assert len(result.segments) == 6 and all(s.end - s.start <= 6.0 for s in result.segments)
    assert [s.text for s in result.segments] == [info["transcript"] for _, info in CASES]
    assert result.text == " ".join(info["transcript"] for _, info in CASES)
    assert result.language == "en"  # demo-asr cannot tell languages apart: its checkpoint declares its training's


def test_the_warm_up_sends_audio_to_an_audio_model(demo_asr_server):
    """demo-asr's warm-up requests carry a clip (a text-only warm-up left the audio path cold)."""
    assert "warm-up requests done (4, each audio and text)" in demo_asr_server.output()
