"""/v1/audio/transcriptions and /v1/audio/translations on `tessera serve` of a tiny random Whisper checkpoint.

Text is compared with HF's generate + batch_decode (language forced, and detected), verbose_json segments with
the timestamp tokens HF's generate produces, long audio is windowed with offset segment times, and 16 concurrent
requests of different lengths all finish with every KV slot (self- and cross-attention) back in the pool.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tessera.models.config import ModelConfig
from tessera.models.whisper_decoding import WhisperTokens, timed_segments
from tests.audio_testing import noise, speechlike, tone, wav_bytes
from tests.server.server_process import ServerProcess
from tests.whisper_testing import RATE, build_tiny_whisper_checkpoint

NAME = "tiny-whisper"
pytestmark = pytest.mark.slow  # a server process and HF references: ~40 s


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # A random model rarely stops: a short decoder context keeps each window's output short. Without max_length
    # in generation_config.json (as save_pretrained writes it), HF's generate stops after 20 new tokens.
    path = build_tiny_whisper_checkpoint(tmp_path_factory.mktemp("tiny-whisper-server"), max_target_positions=48)
    gen = json.loads((path / "generation_config.json").read_text())
    del gen["max_length"]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    # 16 requests x (400 cross-attention slots + up to 48 decoder tokens) do not fit 6144 slots: some wait.
    srv = ServerProcess("--model-path", str(checkpoint), "--served-model-name", NAME, "--max-total-tokens", "6144")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(checkpoint).eval()
    config = ModelConfig.load(checkpoint)
    return model, AutoProcessor.from_pretrained(checkpoint), WhisperTokens.from_generation_config(
        config.generation_config, config.hf_config)


def hf_generate(hf, clip, **kw):
    model, processor, _ = hf
    feats = processor.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        return model.generate(feats, task="transcribe", **kw)


def transcribe(client, clip, **kw):
    return client.audio.transcriptions.create(model=NAME, file=("clip.wav", wav_bytes(clip), "audio/wav"), **kw)


def test_text_matches_hf(client, hf):
    clip = speechlike(5.0, seed=2)
    ref = hf_generate(hf, clip, language="de")
    expected = hf[1].batch_decode(ref, skip_special_tokens=True)[0].strip()
    assert len(ref[0]) >= 20 and expected and transcribe(client, clip, language="de").text == expected
    assert transcribe(client, clip, language="de", response_format="text") == expected + "\n"
    events = list(transcribe(client, clip, language="de", stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == expected


def test_language_is_detected_when_not_given(client, hf):
    model, processor, tokens = hf
    clip = noise(3.0, seed=1)
    feats = processor.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt").input_features
    detected = tokens.language_of(int(model.detect_language(feats)[0]))
    result = transcribe(client, clip, response_format="verbose_json")
    assert result.language == detected
    ref = hf_generate(hf, clip, language=detected)
    assert transcribe(client, clip).text == processor.batch_decode(ref, skip_special_tokens=True)[0].strip()


def test_verbose_json_segments_come_from_timestamp_tokens(client, hf):
    _, processor, tokens = hf
    clip = speechlike(5.0, seed=2)
    ref = hf_generate(hf, clip, language="en", return_timestamps=True, return_dict_in_generate=True,
                      force_unique_generate_call=True).sequences[0].tolist()
    generated = ref[len(tokens.decoder_prompt("en", "transcribe", True)):]
    expected = [s for s in timed_segments(tokens, generated, 8.0) if processor.tokenizer.decode(s.tokens).strip()]
    assert any(tokens.is_timestamp(t) for t in generated)
    result = transcribe(client, clip, language="en", response_format="verbose_json",
                        timestamp_granularities=["segment"])
    assert result.task == "transcribe" and result.language == "en" and result.duration == pytest.approx(5.0)
    assert len(result.segments) == len(expected) >= 1
    for seg, ref_seg in zip(result.segments, expected):
        assert seg.tokens == ref_seg.tokens
        assert seg.start == pytest.approx(min(ref_seg.start, 5.0)) and seg.end == pytest.approx(min(ref_seg.end, 5.0))
        assert seg.text == processor.tokenizer.decode(ref_seg.tokens, skip_special_tokens=True).strip()
        assert seg.avg_logprob <= 0


def test_long_audio_is_windowed_with_offset_times(client):
    clip = speechlike(20.0, seed=4)  # 8 s windows: three of them
    result = transcribe(client, clip, language="en", response_format="verbose_json")
    assert result.duration == pytest.approx(20.0)
    starts = [s.start for s in result.segments]
    assert starts == sorted(starts) and max(s.end for s in result.segments) <= 20.0
    assert max(starts) >= 8.0, "segments of later windows are offset by the window's start"
    assert len({s.seek for s in result.segments}) >= 2
    srt = transcribe(client, clip, language="en", response_format="srt")
    assert srt.count(" --> ") == len([s for s in result.segments if s.text])
    vtt = transcribe(client, clip, language="en", response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and vtt.count(" --> ") == srt.count(" --> ")


def test_translation(client):
    result = client.audio.translations.create(model=NAME, file=("clip.wav", wav_bytes(tone(2.0)), "audio/wav"),
                                              response_format="verbose_json")
    assert result.task == "translate" and result.language


@pytest.mark.parametrize("data,form,message", [
    (b"not audio at all" * 40, {}, "file: "),
    (b"", {}, "file: the audio file is empty"),
    (None, {"language": "xx"}, "language: .*'xx'"),
    (None, {"language": "ja"}, "language: 'ja' is not a language of this checkpoint"),
])
def test_bad_requests_are_400(server, data, form, message):
    clip = wav_bytes(tone(1.0)) if data is None else data
    r = httpx.post(f"{server.base_url}/v1/audio/transcriptions", data={"model": NAME, **form},
                   files={"file": ("clip.wav", clip, "audio/wav")}, timeout=60)
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()


def test_concurrent_requests_free_every_kv_slot(server, client):
    clips = [speechlike(0.5 + 1.1 * i, seed=i) for i in range(16)]  # 0.5 .. 17 s: one to three windows

    def run(i: int) -> str:
        return transcribe(client, clips[i], language="en", response_format="verbose_json").text

    def abandon() -> None:  # a client that leaves a stream after its first event: its request is aborted
        files = {"file": ("clip.wav", wav_bytes(clips[-1]), "audio/wav")}
        with httpx.stream("POST", f"{server.base_url}/v1/audio/transcriptions", files=files, timeout=60,
                          data={"model": NAME, "stream": "true", "language": "en"}) as r:
            next(r.iter_lines())

    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        left = pool.submit(abandon)
        texts = list(pool.map(run, range(16)))
        left.result()
    assert all(isinstance(t, str) for t in texts)
    used: dict[str, float] = {}
    for _ in range(50):  # the abort reaches the scheduler shortly after the client leaves
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        used = {name: float(v) for name, v in re.findall(r"^(tessera_\w*kv_used_tokens)\{[^}]*\} (\S+)$", metrics,
                                                         re.M)}
        if not any(used.values()):
            break
        time.sleep(0.1)
    assert used == {"tessera_kv_used_tokens": 0.0, "tessera_cross_attention_kv_used_tokens": 0.0}


def test_translation_needs_the_translate_task(hf):
    from tessera.entrypoints.openai.errors import APIError
    from tessera.entrypoints.openai.transcript_format import TranscriptionRequest
    from tessera.entrypoints.openai.whisper_transcriptions import WhisperTranscriber

    tokens = hf[2]
    tm = SimpleNamespace(info=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=48)),
                         tokenizer=hf[1].tokenizer)
    req = TranscriptionRequest(b"x", NAME, None, "red circle", "json", 0.0, False)
    plan = WhisperTranscriber(SimpleNamespace(tm=tm), tokens).plan(req, "translate")
    assert plan.task == "translate" and plan.previous and not plan.timestamps
    no_translate = dataclasses.replace(tokens, task_to_id={"transcribe": tokens.task_to_id["transcribe"]})
    with pytest.raises(APIError, match="model: this Whisper checkpoint has no translate task") as e:
        WhisperTranscriber(SimpleNamespace(tm=tm), no_translate).plan(req, "translate")
    assert e.value.param == "model"
