"""The shipped demo-asr checkpoint: standard HF layout, loads offline with the Auto classes, transcribes the
committed espeak-ng fixtures (made once by `python -m tessera.demo.speech`, from a seed never used in training),
and tessera.Engine's greedy tokens and logprobs equal HF's on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tessera import Engine
from tessera.config import ASSETS_DIR
from tessera.demo import speech

DEMO = ASSETS_DIR / "demo-asr"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "speech"


def fixtures() -> list[tuple[str, np.ndarray, str]]:
    meta = json.loads((FIXTURES / "transcripts.json").read_text())
    out = []
    for name, info in sorted(meta.items()):
        x, rate = sf.read(FIXTURES / name, dtype="float32")
        assert rate == speech.RATE and x.ndim == 1
        out.append((name, x, info["transcript"]))
    return out


def test_fixtures_follow_the_grammar() -> None:
    for _, x, transcript in fixtures():
        words = transcript.split()
        assert speech.MIN_WORDS <= len(words) <= speech.MAX_WORDS and set(words) <= set(speech.WORDS)
        assert transcript == " ".join(words) == transcript.lower()
        assert 0.2 < len(x) / speech.RATE < 6.0


def test_checkpoint_files_and_size() -> None:
    # transformers 5 keeps the feature extractor's settings inside processor_config.json.
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "processor_config.json", "chat_template.jinja", "generation_config.json"):
        assert (DEMO / name).exists(), name
    assert (DEMO / "model.safetensors").stat().st_size <= 30 * 2**20


@pytest.fixture(scope="module")
def hf_asr():
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    processor = AutoProcessor.from_pretrained(DEMO)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForMultimodalLM.from_pretrained(DEMO).eval()
    assert type(model).__name__ == "Qwen2AudioForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    return model, processor


def prompt(processor) -> str:
    msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": speech.INSTRUCTION}]}]
    return processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def hf_greedy(model, processor, clip: np.ndarray, max_new: int = 16):
    enc = processor(text=[prompt(processor)], audio=[clip], sampling_rate=speech.RATE, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
    return ids, logprobs


def test_hf_transcribes_the_fixtures(hf_asr) -> None:
    model, processor = hf_asr
    got = [(processor.decode(hf_greedy(model, processor, x)[0], skip_special_tokens=True).strip(), ref)
           for _, x, ref in fixtures()]
    assert all(hyp == ref for hyp, ref in got), got


def test_engine_matches_hf_on_demo_asr(hf_asr) -> None:
    model, processor = hf_asr
    cases = fixtures()
    expected = [hf_greedy(model, processor, x) for _, x, _ in cases]
    with Engine("demo-asr", chunked_prefill_size=40, page_size=4, show_progress=False) as engine:
        outs = engine.generate([prompt(processor)] * len(cases), {"temperature": 0, "max_new_tokens": 16},
                               audio_data=[x for _, x, _ in cases], return_logprob=True)
    for (name, _, ref), (ids, logprobs), out in zip(cases, expected, outs):
        assert out["output_ids"] == ids, name
        assert [lp for lp, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=2e-4)
        assert out["text"].strip() == ref
