"""QwenAudioProcessor against HF's Qwen2AudioProcessor: ids, placeholder counts, features and masks; decoded
files; the preprocessing cache; the three input formats; hashing; and refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.models.qwen2_audio import audio_output_len
from tessera.messages.items import PAD_VALUE_BASE, Modality
from tessera.multimodal.media import MediaError, MediaLimits, load_audio
from tessera.multimodal.processors.qwen_audio import QwenAudioProcessor
from tests.multimodal.processor_registry import architecture_of, create_processor, get_processor_class
from tests.audio_testing import INSTRUCTION, RATE, build_tiny_audio_checkpoint, noise, speechlike, tone, wav_bytes


@pytest.fixture(scope="module")
def audio_skeleton(tmp_path_factory) -> tuple[Path, object, object]:
    from transformers import AutoConfig, AutoProcessor

    path = build_tiny_audio_checkpoint(tmp_path_factory.mktemp("tiny-audio"))
    return path, AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)


@pytest.fixture
def make(audio_skeleton):
    _, hf_processor, config = audio_skeleton
    made = []

    def make_processor(processor=None, **kwargs):
        kwargs.setdefault("limits", MediaLimits.offline())
        proc = create_processor(processor or hf_processor, config, **kwargs)
        made.append(proc)
        return proc

    yield make_processor
    for p in made:
        p.close()


def prompt_for(hf_processor, num_clips: int, text: str = INSTRUCTION) -> str:
    content = [{"type": "audio"}] * num_clips + [{"type": "text", "text": text}]
    return hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)


def hf_reference(hf_processor, prompt: str, clips: list[np.ndarray]):
    return hf_processor(text=[prompt], audio=clips, sampling_rate=RATE, return_tensors="pt")


def assert_matches_hf(out, ref, audio_token_id: int) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    assert [i.modality for i in items] == [Modality.AUDIO] * ref["input_features"].shape[0]
    assert torch.equal(torch.stack([i.feature for i in items]), ref["input_features"])
    masks = torch.cat([i.model_specific_data["feature_attention_mask"] for i in items])
    assert torch.equal(masks, ref["feature_attention_mask"].to(masks.dtype))
    assert sum(i.num_tokens for i in items) == int((ref["input_ids"] == audio_token_id).sum())
    for item, mask in zip(items, ref["feature_attention_mask"]):
        assert item.num_tokens == audio_output_len(int(mask.sum()))
        (s, e), = item.offsets
        assert set(out.input_ids[s:e]) == {audio_token_id} and out.input_ids[s - 1] != audio_token_id
        assert item.pad_value >= PAD_VALUE_BASE


def test_registry(audio_skeleton):
    _, _, config = audio_skeleton
    assert architecture_of(config) == "Qwen2AudioForConditionalGeneration"
    assert get_processor_class("Qwen2AudioForConditionalGeneration") is QwenAudioProcessor


CLIP_SETS = {
    "short_tone": lambda: [tone(0.3)],
    "two_lengths": lambda: [noise(7.3, seed=1), speechlike(2.2, seed=2)],
    "three_with_a_truncated_one": lambda: [tone(1.0), speechlike(31.5, seed=3), noise(12.0, seed=4)],
}


@pytest.mark.parametrize("clips", list(CLIP_SETS))
def test_parity_with_hf(audio_skeleton, make, clips):
    _, hf_processor, config = audio_skeleton
    audio = CLIP_SETS[clips]()
    prompt = prompt_for(hf_processor, len(audio))
    out = make().process(prompt=prompt, audio_data=audio)
    assert_matches_hf(out, hf_reference(hf_processor, prompt, audio), config.audio_token_id)


def test_longer_than_a_chunk_is_truncated_like_hf(audio_skeleton, make):
    _, hf_processor, _ = audio_skeleton
    out = make().process(prompt=prompt_for(hf_processor, 1), audio_data=[speechlike(45.0, seed=5)])
    # 30 s = 3000 mel frames -> 1500 after conv2 -> 750 after the pool.
    assert out.mm_inputs.items[0].num_tokens == 750


@pytest.mark.parametrize("fmt,rate,channels", [("WAV", 44100, 2), ("FLAC", 22050, 1), ("OGG", 48000, 2)])
def test_encoded_files_are_decoded_resampled_and_mixed_down(audio_skeleton, make, fmt, rate, channels):
    _, hf_processor, config = audio_skeleton
    seconds = 2.7
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    x = np.stack([mono, mono], axis=1) if channels == 2 else mono
    data = wav_bytes(x, rate, fmt)
    prompt = prompt_for(hf_processor, 1)
    out = make().process(prompt=prompt, audio_data=[data])
    decoded = load_audio(data, limits=MediaLimits.offline(), sampling_rate=RATE)
    assert decoded.ndim == 1 and abs(len(decoded) / RATE - seconds) < 0.05
    assert_matches_hf(out, hf_reference(hf_processor, prompt, [decoded]), config.audio_token_id)


def test_cache_hits_and_input_ids_give_the_same_output(audio_skeleton, make):
    _, hf_processor, config = audio_skeleton
    a, b = tone(1.3), noise(4.4, seed=6)
    prompt = prompt_for(hf_processor, 2)
    proc = make(cache_size_bytes=64 << 20)
    first = proc.process(prompt=prompt_for(hf_processor, 1), audio_data=[a])
    mixed = proc.process(prompt=prompt, audio_data=[a, b])  # a hit + a miss: the extractor alone for b
    assert proc.preprocess_cache_hits == 1 and first.mm_inputs.items[0].hash == mixed.mm_inputs.items[0].hash
    ref = hf_reference(hf_processor, prompt, [a, b])
    assert_matches_hf(mixed, ref, config.audio_token_id)
    assert_matches_hf(proc.process(prompt=prompt, audio_data=[a, b]), ref, config.audio_token_id)  # all hits
    ids = hf_processor.tokenizer(prompt)["input_ids"]
    assert_matches_hf(make().process(input_ids=ids, audio_data=[a, b]), ref, config.audio_token_id)


def test_hash_covers_content_and_extractor_settings(audio_skeleton, make):
    _, hf_processor, _ = audio_skeleton
    prompt = prompt_for(hf_processor, 2)
    # Exactly representable in 16-bit FLAC (+ 0.0 turns the -0.0 of rounding into the +0.0 a decoder gives).
    x = (np.round(tone(1.0) * 32767) / 32768 + 0.0).astype(np.float32)
    base = make().process(prompt=prompt, audio_data=[x, wav_bytes(x, fmt="FLAC")]).mm_inputs.items
    assert base[0].hash == base[1].hash  # the same samples from an array and from a lossless file
    other = make().process(prompt=prompt, audio_data=[x, tone(1.0, freq=441)]).mm_inputs.items
    assert other[1].hash != base[1].hash
    dithered = copy.deepcopy(hf_processor)
    dithered.feature_extractor.dither = 1e-3
    changed = make(dithered).process(prompt=prompt, audio_data=[x, x]).mm_inputs.items
    assert changed[0].hash != base[0].hash


def test_processor_output_and_precomputed_embedding_formats(audio_skeleton, make):
    _, hf_processor, config = audio_skeleton
    clips = [tone(0.9), noise(3.1, seed=7)]
    prompt = prompt_for(hf_processor, 2)
    ref = hf_reference(hf_processor, prompt, clips)
    proc = make()
    given = {"format": "processor_output", "input_features": ref["input_features"],
             "feature_attention_mask": ref["feature_attention_mask"]}
    out = proc.process(prompt=prompt, audio_data=[given])
    assert_matches_hf(out, ref, config.audio_token_id)
    sizes = [audio_output_len(int(m.sum())) for m in ref["feature_attention_mask"]]
    hidden = config.get_text_config().hidden_size
    embeds = [torch.randn(n, hidden) for n in sizes]
    pre = proc.process(prompt=prompt, audio_data=[{"format": "precomputed_embedding", "feature": embeds}])
    assert pre.input_ids == ref["input_ids"][0].tolist()
    assert [i.num_tokens for i in pre.mm_inputs.items] == sizes
    assert all(torch.equal(i.precomputed_embedding, e) for i, e in zip(pre.mm_inputs.items, embeds))


def test_refusals_name_the_problem(audio_skeleton, make):
    _, hf_processor, _ = audio_skeleton
    proc = make()
    with pytest.raises(ValueError, match="1 audio placeholder.*2 audio item"):
        proc.process(prompt=prompt_for(hf_processor, 1), audio_data=[tone(0.5), tone(0.5)])
    with pytest.raises(ValueError, match="does not accept image inputs"):
        proc.process(prompt="x", image_data=[np.zeros((4, 4, 3), np.uint8)])
    with pytest.raises(MediaError, match="corrupt|unsupported audio|no decodable") as e:
        proc.process(prompt=prompt_for(hf_processor, 1), audio_data=[b"RIFF\x00\x00\x00\x00WAVEjunk"])
    assert e.value.status == 400
    bad = {"format": "processor_output", "input_features": torch.zeros(1, 16, 100),
           "feature_attention_mask": torch.ones(1, 100)}
    with pytest.raises(ValueError, match="input_features has shape"):
        proc.process(prompt=prompt_for(hf_processor, 1), audio_data=[bad])
    with pytest.raises(ValueError, match="language-model-only"):
        make(language_model_only=True).process(prompt=prompt_for(hf_processor, 1), audio_data=[tone(0.5)])
    with pytest.raises(MediaError, match="over the limit of 60 s"):
        make(limits=MediaLimits.offline(max_audio_seconds=60.0)).process(
            prompt=prompt_for(hf_processor, 1), audio_data=[wav_bytes(noise(61.0))])
