"""tessera.Engine on a tiny random Whisper checkpoint: greedy tokens identical to HF generate.

Several clips batched together, with and without timestamps, with the language forced, and language detection
(a prompt ending in <|startoftranscript|>) against HF's detect_language. The pool is small enough that requests
wait for cross-attention slots and get retracted; afterwards every KV slot (self and cross) is free.
"""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tessera.models.config import ModelConfig
from tessera.models.whisper_decoding import WhisperTokens
from tests.audio_testing import noise, speechlike, tone
from tests.engine.hf_reference import check_speculative_matches, speculative_oracle
from tests.whisper_testing import RATE, build_tiny_whisper_checkpoint

MAX_NEW = 20


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    return build_tiny_whisper_checkpoint(tmp_path_factory.mktemp("tiny-whisper-engine"))


@pytest.mark.slow  # HF references and an Engine: ~20 s
def test_engine_matches_hf_generate(tiny_whisper):
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(tiny_whisper).eval()
    extractor = AutoProcessor.from_pretrained(tiny_whisper).feature_extractor
    config = ModelConfig.load(tiny_whisper)
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    clips = [tone(1.5), speechlike(5.0, seed=2), noise(3.0, seed=1), speechlike(9.5, seed=3)]  # the last: truncated
    cases = [(clip, lang, ts) for clip in clips for lang, ts in (("en", False), ("de", True))]
    feats = extractor(clips, sampling_rate=RATE, return_tensors="pt").input_features
    expected = []
    with torch.no_grad():
        for lang, ts in (("en", False), ("de", True)):  # HF batches the clips too
            out = hf.generate(feats, language=lang, task="transcribe", return_timestamps=ts, max_new_tokens=MAX_NEW,
                              return_dict_in_generate=True, force_unique_generate_call=True)
            expected.append([[t for t in seq if t != tokens.eot] for seq in out.sequences.tolist()])
        detected = hf.detect_language(feats).tolist()
    prompts = [tokens.decoder_prompt(lang, "transcribe", ts) for _, lang, ts in cases]
    # Per request: 400 cross-attention slots + up to 24 of its own; 1536 slots hold 3 at once, not 8.
    with Engine(str(tiny_whisper), page_size=4, max_running_requests=8, max_total_tokens=1536,
                show_progress=False) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW},
                               audio_data=[clip for clip, _, _ in cases])
        langs = engine.generate(input_ids=[tokens.language_prompt()] * len(clips),
                                sampling_params={"temperature": 0, "max_new_tokens": 1}, audio_data=clips)
        stats = engine.get_stats()
        with pytest.raises(ValueError, match="one audio clip"):
            engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = expected[i % 2][i // 2]
        assert prompt + [t for t in out["output_ids"] if t != tokens.eot] == ref, f"case {i}"
    assert [o["output_ids"] for o in langs] == [[d] for d in detected]
    assert stats.kv_used_tokens == 0 and stats.cross_kv_used_tokens == 0 and stats.radix_cache_tokens == 0
    # Speculative decoding (drafts: the references with every third token wrong) keeps the tokens, timestamp
    # rules included (each verify row applies them after its drafts).
    refs = [expected[i % 2][i // 2][len(p):] for i, p in enumerate(prompts)]
    oracle = speculative_oracle(prompts, refs)
    with Engine(str(tiny_whisper), page_size=4, max_running_requests=8, max_total_tokens=1536, show_progress=False,
                speculative_algorithm="ORACLE", speculative_oracle_path=oracle) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW},
                               audio_data=[clip for clip, _, _ in cases])
        check_speculative_matches(engine, [{"output_ids": [t for t in o["output_ids"] if t != tokens.eot]}
                                           for o in outs], refs)
        assert engine.get_stats().cross_kv_used_tokens == 0
    assert stats.num_retractions > 0 or stats.num_forward_steps > MAX_NEW * 3  # it could not run all 8 at once
