"""Qwen3-ASR and GLM-ASR against transformers on tiny random checkpoints (tests/speech_llm_testing.py): our
processor's ids and features, the encoder's embeddings (all items of a step in one call) and the prefill logits
(fp32, 1e-4) over the paged KV cache. Greedy tokens against HF `generate` are checked end to end through the
server (tests/server/test_speech_llm_server.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from paged_driver import PagedKV, Step, make_batch

from tessera.models.registry import load_model
from tessera.multimodal.geometry import SPEECH_MASK_KEY
from tessera.multimodal.media import MediaLimits
from tests.audio_testing import RATE, noise, speechlike, tone
from tests.multimodal.processor_registry import create_processor
from tests.speech_llm_testing import build_speech_llm

ATOL = 1e-4
CLIPS = {"short": lambda: tone(0.4, freq=330), "two_s": lambda: speechlike(2.0, seed=1),
         "five_s": lambda: np.concatenate([noise(0.5, seed=4, amplitude=0.01), speechlike(4.5, seed=5)])}


@dataclass
class Case:
    family: str
    hf: torch.nn.Module
    ours: torch.nn.Module
    processor: object  # ours
    hf_processor: object

    def request(self, clip: np.ndarray, language: str | None = None) -> dict:
        kwargs = {"sampling_rate": RATE, "language": language} if self.family == "qwen3_asr" else {}
        return self.hf_processor.apply_transcription_request(clip, **kwargs)

    def prompt(self, clip: np.ndarray, language: str | None = None) -> str:
        kwargs = {"language": language} if self.family == "qwen3_asr" else {}
        return self.hf_processor.apply_transcription_request(clip, tokenize=False, **kwargs)[0]


@pytest.fixture(scope="module", params=["qwen3_asr", "glmasr"])
def case(request, tmp_path_factory) -> Case:
    import transformers

    path = build_speech_llm(request.param, tmp_path_factory.mktemp(request.param))
    cls = "Qwen3ASRForConditionalGeneration" if request.param == "qwen3_asr" else "GlmAsrForConditionalGeneration"
    hf = getattr(transformers, cls).from_pretrained(path).eval()
    ours, config = load_model(path, torch.float32)
    hf_processor = transformers.AutoProcessor.from_pretrained(path)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    yield Case(request.param, hf, ours, processor, hf_processor)
    processor.close()


@pytest.mark.parametrize("language", [None, "en"])
def test_ids_embeddings_and_prefill_logits_match_hf(case, language):
    if case.family == "glmasr" and language:
        pytest.skip("GLM-ASR's transcription request has no language")
    for name, make in CLIPS.items():
        clip = make()
        ref = case.request(clip, language)
        out = case.processor.process(prompt=case.prompt(clip, language), audio_data=[clip])
        assert out.input_ids == ref["input_ids"][0].tolist(), name
        (item,) = out.mm_inputs.items
        with torch.inference_mode():
            embeds = case.ours.get_audio_feature([item])[0]
            hf_embeds = case.hf.model.get_audio_features(ref["input_features"],
                                                         ref["input_features_mask"]).pooler_output
            torch.testing.assert_close(embeds, hf_embeds, atol=1e-5, rtol=0)
            kv = PagedKV(case.ours.lm_config, page_size=4, num_pages=512, max_context_len=2048)
            ids = torch.tensor(out.input_ids)
            (start, end), = item.offsets
            step = Step(kv.new_request(), ids, torch.arange(len(ids)), torch.arange(start, end), embeds,
                        all_logits=True)
            logits = case.ours(make_batch(kv, [step]), kv.pool)
            hf_logits = case.hf(**ref).logits[0]
        torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)


def test_a_step_encodes_all_items_in_one_call_and_each_as_alone(case, monkeypatch):
    clips = [make() for make in CLIPS.values()]
    prompt = case.prompt(clips[0]).replace(case.hf_processor.audio_token, case.hf_processor.audio_token * 3, 1)
    out = case.processor.process(prompt=prompt, audio_data=clips)
    items = out.mm_inputs.items
    alone = [case.processor.process(prompt=case.prompt(c), audio_data=[c]).mm_inputs.items[0] for c in clips]
    for a, b in zip(items, alone):  # a clip's features are the ones the HF processor makes of it alone
        torch.testing.assert_close(a.feature, b.feature, atol=0, rtol=0)
        assert torch.equal(a.model_specific_data[SPEECH_MASK_KEY], b.model_specific_data[SPEECH_MASK_KEY])
    tower, calls = case.ours.audio_tower, []
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        together = case.ours.get_audio_feature(items)
        singles = [case.ours.get_audio_feature([it])[0] for it in items]
    assert len(calls) == 1 + len(items)
    assert [e.shape[0] for e in together] == [it.offsets[0][1] - it.offsets[0][0] for it in items]
    for a, b in zip(together, singles):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_inconsistent_configs_are_refused_by_name(case):
    import copy

    from tessera.models.config import ModelConfig

    hf_config = copy.deepcopy(case.hf.config)
    if case.family == "qwen3_asr":
        hf_config.audio_config.output_dim += 8
        field = "output_dim"
    else:
        hf_config.audio_config.intermediate_size += 8
        field = "intermediate_size"
    with pytest.raises(ValueError, match=f"audio_config.{field}"):
        type(case.ours)(ModelConfig.from_hf(hf_config))
    if case.family == "qwen3_asr":  # the original release's layout, which transformers reads as defaults
        original = copy.deepcopy(case.hf.config)
        original.thinker_config = {"audio_config": {}, "text_config": {}}
        with pytest.raises(ValueError, match="config.thinker_config"):
            type(case.ours)(ModelConfig.from_hf(original))


def test_engine_greedy_tokens_match_hf_generate(case, tmp_path_factory):
    """Through tessera.Engine, submitted together: a prompt with its clip, the same clip as token ids (one
    placeholder, expanded by our processor) and a text-only request."""
    from tessera import Engine

    clip = CLIPS["two_s"]()
    ref = case.request(clip)
    with torch.inference_mode():
        out = case.hf.generate(**ref, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    expected = out[0, ref["input_ids"].shape[1]:].tolist()
    prompt = case.prompt(clip)
    ids = case.hf_processor.tokenizer(prompt)["input_ids"]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    path = case.hf.name_or_path
    with Engine(str(path), page_size=4, chunked_prefill_size=32, show_progress=False) as engine:
        with_prompt, text_only = engine.generate([prompt, "Hello there."], sp, audio_data=[[clip], None])
        with_ids = engine.generate(input_ids=[ids], sampling_params=sp, audio_data=[[clip]])[0]
    assert with_prompt["output_ids"] == expected == with_ids["output_ids"]
    assert len(text_only["output_ids"]) == 8
