"""Whisper's processor: the checkpoint extractor's features, one clip per request, no placeholders."""

from __future__ import annotations

import pytest
import torch

from tessera.multimodal.media import MediaLimits
from tests.multimodal.processor_registry import create_processor
from tessera.multimodal.processors.whisper import WhisperAudioProcessor
from tests.audio_testing import speechlike, tone
from tests.whisper_testing import RATE, build_whisper_tokenizer


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperProcessor

    path = tmp_path_factory.mktemp("whisper-processor")
    tok = build_whisper_tokenizer(path, window_s=4)
    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, chunk_length=4)
    hf = WhisperProcessor(feature_extractor=extractor, tokenizer=tok)
    cfg = WhisperConfig(vocab_size=len(tok), num_mel_bins=16, d_model=32, max_source_positions=200,
                        architectures=["WhisperForConditionalGeneration"])
    proc = create_processor(hf, cfg, limits=MediaLimits.offline(), cache_size_bytes=64 << 20)
    yield proc
    proc.close()


def test_features_prompt_and_cache(processor):
    assert isinstance(processor, WhisperAudioProcessor) and processor.chunk_seconds == 4.0
    clip = speechlike(6.0, seed=1)  # longer than the window: truncated, as HF's extractor does
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    out = processor.process(prompt=prompt, audio_data=[clip])
    tok = processor.hf_processor.tokenizer
    assert out.input_ids == tok.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])
    [item] = out.mm_inputs.items
    ref = processor.hf_processor.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt").input_features[0]
    assert item.offsets == [] and torch.equal(item.feature, ref)
    again = processor.process(input_ids=out.input_ids, audio_data=[clip])
    assert processor.preprocess_cache_hits == 1 and again.mm_inputs.items[0].hash == item.hash
    other = processor.process(input_ids=out.input_ids, audio_data=[tone(1.0)])
    assert other.mm_inputs.items[0].hash != item.hash


def test_preprocessed_formats_and_refusals(processor):
    feats = torch.randn(16, 400)
    out = processor.process(input_ids=[1], audio_data=[{"format": "processor_output", "input_features": feats}])
    assert torch.equal(out.mm_inputs.items[0].feature, feats)
    emb = torch.randn(200, 32)
    out = processor.process(input_ids=[1], audio_data=[{"format": "precomputed_embedding", "feature": emb}])
    assert torch.equal(out.mm_inputs.items[0].precomputed_embedding, emb)
    with pytest.raises(ValueError, match="exactly one audio clip, got 2"):
        processor.process(input_ids=[1], audio_data=[tone(1.0), tone(2.0)])
    with pytest.raises(ValueError, match="input_features has shape"):
        processor.process(input_ids=[1], audio_data=[{"format": "processor_output", "input_features": feats[:, :10]}])
    with pytest.raises(ValueError, match="precomputed audio feature has shape"):
        processor.process(input_ids=[1], audio_data=[{"format": "precomputed_embedding", "feature": emb[:5]}])
