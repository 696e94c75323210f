"""Qwen3-ASR and GLM-ASR served over HTTP: /v1/audio/transcriptions and chat input_audio on tiny random
checkpoints (tests/speech_llm_testing.py), each window's tokens equal to transformers' `generate` on the prompt its
processor's `apply_transcription_request` builds.

Three clips (shorter than Qwen3-ASR's minimum length, 2 s, and 5 s: longer than the fixtures' GLM-ASR window of
4 s and Qwen3-ASR's attention window of 2 s), with and without a language, sent together with a text chat request
(batched with other traffic); verbose_json, srt, vtt, text and streaming.
"""

from __future__ import annotations

import base64
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from tessera.entrypoints.openai.speech_prompts import TranscriptionStyle
from tessera.multimodal.audio_windows import split_audio
from tests.audio_testing import RATE, noise, speechlike, tone, wav_bytes
from tests.server.server_process import ServerProcess
from tests.speech_llm_testing import build_speech_llm

CLIPS = {"short": lambda: tone(0.4, freq=330), "two_s": lambda: speechlike(2.0, seed=1),
         "five_s": lambda: np.concatenate([noise(0.5, seed=4, amplitude=0.01), speechlike(4.5, seed=5)])}
MAX_TOKENS_PER_SECOND, MIN_TOKENS = 10, 16  # transcriptions.py's budget per window


class Served:
    def __init__(self, family: str, path, server: ServerProcess):
        import transformers

        self.family, self.path, self.server = family, path, server
        self.processor = transformers.AutoProcessor.from_pretrained(path)
        cls = "Qwen3ASRForConditionalGeneration" if family == "qwen3_asr" else "GlmAsrForConditionalGeneration"
        self.hf = getattr(transformers, cls).from_pretrained(path).eval()
        self.client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)

    def hf_window(self, samples: np.ndarray, language: str | None) -> tuple[list[int], list[float]]:
        """HF's greedy tokens for one window, with the endpoint's token budget, and each step's top-2 margin."""
        kwargs = {"language": language} if self.family == "qwen3_asr" else {}
        if self.family == "qwen3_asr":
            kwargs["sampling_rate"] = RATE
        inputs = self.processor.apply_transcription_request(samples, **kwargs)
        budget = max(MIN_TOKENS, int(np.ceil(len(samples) / RATE * MAX_TOKENS_PER_SECOND)))
        with torch.inference_mode():
            out = self.hf.generate(**inputs, max_new_tokens=budget, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True)
        margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), margins

    def transcribe(self, data: bytes, **kw):
        return self.client.audio.transcriptions.create(model="tiny-speech", file=("clip.wav", data, "audio/wav"),
                                                       **kw)


@pytest.fixture(scope="module", params=["qwen3_asr", "glmasr"])
def served(request, tmp_path_factory):
    path = build_speech_llm(request.param, tmp_path_factory.mktemp(request.param))
    server = ServerProcess("--model-path", str(path), "--served-model-name", "tiny-speech",
                           "--max-total-tokens", "16384")
    yield Served(request.param, path, server)
    server.stop()


def _strip_eos(tokens: list[int], served: Served) -> list[int]:
    eos = set(served.hf.generation_config.eos_token_id or [])
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def assert_same_tokens(ours: list[int], ref: list[int], margins: list[float], served: Served, what) -> None:
    """Equal up to the first step where HF's top-2 logits are within float noise (1e-3) of each other: a random
    model's near-tie may go either way with a batch's summation order; at least 8 tokens must be compared."""
    ours, ref = _strip_eos(ours, served), _strip_eos(ref, served)
    tie = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
    assert ours[:tie] == ref[:tie], what
    assert tie >= 8 or len(ref) < 8, f"{what}: the fixture ties at step {tie}"
    if tie == len(margins):
        assert ours == ref, what


@pytest.mark.parametrize("language", [None, "en"])
def test_transcripts_are_hf_generate_tokens(served, language):
    if served.family == "glmasr" and language:
        pytest.skip("GLM-ASR's transcription request has no language: the prompt is the one tested without")
    clips = {name: make() for name, make in CLIPS.items()}
    kw = {"language": language} if language else {}
    with ThreadPoolExecutor(len(clips) + 1) as pool:  # the clips and a text chat arrive together
        chat = pool.submit(served.client.chat.completions.create, model="tiny-speech", max_tokens=8,
                           messages=[{"role": "user", "content": "Hello there."}])
        results = dict(zip(clips, pool.map(
            lambda x: served.transcribe(wav_bytes(x), response_format="verbose_json", **kw), clips.values())))
        assert chat.result().usage.completion_tokens > 0
    style = TranscriptionStyle.of(None, served.processor)
    for name, samples in clips.items():
        result = results[name]
        windows = split_audio(samples, RATE, float(served.processor.feature_extractor.chunk_length))
        assert len(result.segments) == len(windows), name
        texts, written = [], []
        for segment, w in zip(result.segments, windows):
            ref, margins = served.hf_window(samples[w.start:w.end], language)
            assert_same_tokens(segment.tokens, ref, margins, served, (name, segment.id))
            texts.append(segment.text)
            written.append(style.split(served.processor.tokenizer.decode(segment.tokens, skip_special_tokens=True),
                                       language)[1])
            assert (segment.start, segment.end) == (round(w.seg_start / RATE, 3), round(w.seg_end / RATE, 3))
        assert result.text == " ".join(t for t in texts if t), name
        assert result.duration == pytest.approx(len(samples) / RATE, abs=1e-3)
        assert result.language == (next((w for w in written if w), None) or language or "unknown"), name
    assert served.family == "qwen3_asr" or len(results["five_s"].segments) == 2  # GLM-ASR: two windows


def test_a_written_language_is_reported_and_cut_from_the_transcript():
    class Qwen3Like:  # the two methods the style reads
        apply_transcription_request = parse_output = None

    style = TranscriptionStyle.of(None, Qwen3Like())
    assert style.split("language English<asr_text> hello there", None) == ("hello there", "en")
    assert style.split("language Cantonese<asr_text>你好", None) == ("你好", "yue")
    assert style.split("language None<asr_text>", None) == ("", None)
    assert style.split("no marker at all", None) == ("no marker at all", None)
    assert style.split("forced <asr_text> stays", "en") == ("forced <asr_text> stays", None)
    assert style.reported_language(["fr", None, "fr", "en"], "de") == "fr"


def test_formats_and_stream_agree(served):
    data = wav_bytes(CLIPS["five_s"]())
    verbose = served.transcribe(data, response_format="verbose_json", language="en")
    assert served.transcribe(data, language="en").text == verbose.text
    assert served.transcribe(data, response_format="text", language="en") == verbose.text + "\n"
    cues = [s for s in verbose.segments if " ".join(s.text.split())]
    srt = served.transcribe(data, response_format="srt", language="en")
    assert len(re.findall(r"^\d+\n\d\d:\d\d:\d\d,\d\d\d --> ", srt, flags=re.M)) == len(cues)
    vtt = served.transcribe(data, response_format="vtt", language="en")
    # A prompt is context: Qwen3-ASR's system turn; GLM-ASR's request has none, so it leads as one.
    assert served.transcribe(data, language="en", prompt="Names: Ada, Grace.").text is not None
    assert vtt.startswith("WEBVTT\n\n") and vtt.count(" --> ") == len(cues)
    for language in ("en", None):
        form = {"model": "tiny-speech", "stream": "true", **({"language": language} if language else {})}
        with httpx.stream("POST", f"{served.server.base_url}/v1/audio/transcriptions",
                          files={"file": ("clip.wav", data, "audio/wav")},
                          data=form,
                          timeout=300) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        parsed = [json.loads(e) for e in events[:-1]]
        done = parsed[-1]
        assert done["type"] == "transcript.text.done"
        assert "".join(p["delta"] for p in parsed[:-1]) == done["text"]
        expected = verbose.text if language else served.transcribe(data).text
        assert done["text"] == expected


def test_chat_with_input_audio(served):
    samples = CLIPS["two_s"]()
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(samples)).decode(),
                                                       "format": "wav"}}]
    reply = served.client.chat.completions.create(model="tiny-speech", max_tokens=6, temperature=0,
                                                  messages=[{"role": "user", "content": content}])
    chat = [{"role": "user", "content": [{"type": "audio", "audio": samples}]}]
    kwargs = {"sampling_rate": RATE} if served.family == "qwen3_asr" else {}
    inputs = served.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                  **kwargs)
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    with torch.inference_mode():
        ref = served.hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert reply.choices[0].message.content == served.processor.tokenizer.decode(ref, skip_special_tokens=True)


def _long_flac(seconds: float) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * RATE), np.float32), RATE, format="FLAC")
    return buf.getvalue()


@pytest.mark.parametrize("data,message", [
    (b"RIFF\x00\x00\x00\x00WAVEjunk", "file: .*(corrupt|unsupported audio|no decodable)"),
    (b"not audio at all" * 40, "file: "),
    ("too_long", r"file: .*over the limit of 1200 s"),
])
def test_bad_audio_is_a_400_naming_the_file(served, data, message):
    body = _long_flac(1201.0) if data == "too_long" else data
    r = httpx.post(f"{served.server.base_url}/v1/audio/transcriptions", files={"file": ("clip", body, "audio/x")},
                   data={"model": "tiny-speech"}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "file" and re.search(message, r.json()["error"]["message"]), r.json()


def test_a_language_qwen3_asr_does_not_transcribe_is_a_400(served):
    r = httpx.post(f"{served.server.base_url}/v1/audio/transcriptions", data={"model": "tiny-speech", "language": "sw"},
                   files={"file": ("clip.wav", wav_bytes(CLIPS["short"]()), "audio/wav")}, timeout=60)
    if served.family == "glmasr":  # no language slot: the request's language is only reported
        assert r.status_code == 200 and r.json()["text"] is not None
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == "language", r.text
    assert "not 'sw'" in r.json()["error"]["message"]


def test_a_stream_holds_back_the_language_prefix():
    """The deltas of Qwen3-ASR's `language English<asr_text> hello world` are the transcript only, and add up to
    the done event's text; a window that never writes the marker streams all of its text."""
    import asyncio
    from types import SimpleNamespace

    from tessera.entrypoints.openai.transcriptions import TranscriptionServing
    from tessera.frontend.result import GenerateResult
    from tessera.messages.finish import FinishReason

    windows = [["lang", "uage English", "<asr_", "text> hel", "lo", " world "], ["no marker", " here"]]

    async def generate(req):
        for i, delta in enumerate(windows[req]):
            last = i == len(windows[req]) - 1
            yield GenerateResult(str(req), "", delta, [], FinishReason.stop() if last else None, prompt_tokens=3,
                                 completion_tokens=i + 1, cached_tokens=0, e2e_latency=0.0, ttft=None)

    serving = TranscriptionServing(SimpleNamespace(tm=SimpleNamespace(generate=generate)))

    async def events():
        return [json.loads(e[len("data: "):]) for e in [x async for x in serving._stream([0, 1], "<asr_text>")]
                if e != "data: [DONE]\n\n"]

    parsed = asyncio.run(events())
    deltas = [p["delta"] for p in parsed if p["type"] == "transcript.text.delta"]
    assert deltas == ["hel", "lo", " world", " no marker here"]
    assert parsed[-1]["text"] == "hello world no marker here" == "".join(deltas)
