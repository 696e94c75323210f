"""Our Whisper decoder and decoding rules against transformers, on a tiny random checkpoint.

Logits: two requests in one paged step (page size 4), the cross-attention K/V written into the pool from our
encoder output, compared with HF's forward. Rules: WhisperTokens.apply against HF's own logits processors
(begin-suppress, suppress, timestamps) on random scores and random histories.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_driver import PagedKV, Step, make_batch

from tessera.models.registry import load_model
from tessera.models.whisper_decoding import TimedSegment, WhisperTokens, timed_segments
from tessera.messages.items import Modality, MultimodalDataItem
from tests.audio_testing import noise, speechlike, tone
from tests.whisper_testing import RATE, build_tiny_whisper_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    path = build_tiny_whisper_checkpoint(tmp_path_factory.mktemp("tiny-whisper-model"))
    hf = WhisperForConditionalGeneration.from_pretrained(path).eval()
    ours, config = load_model(path, torch.float32)
    return hf, ours, config, AutoProcessor.from_pretrained(path)


def features(processor, clips):
    return processor.feature_extractor(clips, sampling_rate=RATE, return_tensors="pt").input_features


def test_fixture_can_fail(whisper):
    """Outputs depend on the audio, timestamps and text both appear, and greedy choices are not ties."""
    hf, _, config, processor = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    feats = features(processor, [tone(1.5), speechlike(5.0, seed=2), noise(3.0, seed=1)])
    with torch.no_grad():
        out = hf.generate(feats, language="en", task="transcribe", return_timestamps=True, max_new_tokens=12,
                          return_dict_in_generate=True, force_unique_generate_call=True, output_scores=True)
    seqs = out.sequences.tolist()
    assert len({tuple(s) for s in seqs}) == len(seqs)
    generated = [t for s in seqs for t in s[3:]]
    assert any(tokens.is_timestamp(t) for t in generated) and any(t < tokens.eot for t in generated)
    scores = torch.cat([s.float() for s in out.scores])
    top2 = scores[torch.isfinite(scores).sum(-1) > 1].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 1e-3


def test_config_describes_the_decoder(whisper):
    _, _, config, _ = whisper
    hf_cfg = config.hf_config
    assert (config.num_layers, config.num_heads, config.intermediate_size) == (
        hf_cfg.decoder_layers, hf_cfg.decoder_attention_heads, hf_cfg.decoder_ffn_dim)
    assert config.cross_attention_len == hf_cfg.max_source_positions
    assert config.max_position_embeddings == hf_cfg.max_target_positions


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_logits_match_hf(whisper, page_size):
    hf, ours, config, processor = whisper
    feats = features(processor, [tone(1.5), speechlike(5.0, seed=2)])
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    prompts = [tokens.decoder_prompt("en", "transcribe", False) + [235, 118, 44],
               tokens.decoder_prompt("de", "transcribe", True) + [60]]
    kv = PagedKV(config, page_size=page_size, num_pages=2048 // page_size, max_reqs=8, max_context_len=512)
    with torch.inference_mode():
        enc = ours.encode_audio([MultimodalDataItem(Modality.AUDIO, i, [], feature=f) for i, f in enumerate(feats)])
        torch.testing.assert_close(torch.stack(enc), hf.model.encoder(feats).last_hidden_state, atol=ATOL, rtol=0)
        cross_rows = [kv.new_request() for _ in prompts]
        state = type(ours).request_state  # the engine's path: the family's hook, as the worker calls it
        cross = [kv.extend(r, state.extra_slots(config, [])) for r in cross_rows]
        state.fill(ours, enc, cross, kv.pool)
        rows = [kv.new_request() for _ in prompts]
        # Prefill all but the last token, then one decode step each: both cross-attention paths.
        fb = make_batch(kv, [Step(r, torch.tensor(p[:-1]), torch.arange(len(p) - 1), all_logits=True)
                             for r, p in zip(rows, prompts)])
        fb.state_slots = torch.stack(cross)
        prefill = ours(fb, kv.pool)
        fb = make_batch(kv, [Step(r, torch.tensor(p[-1:]), torch.tensor([len(p) - 1])) for r, p in zip(rows, prompts)])
        fb.state_slots = torch.stack(cross)
        decode = ours(fb, kv.pool)
        n0 = len(prompts[0]) - 1
        for b, p in enumerate(prompts):
            ref = hf(input_features=feats[b:b + 1], decoder_input_ids=torch.tensor([p])).logits[0]
            mine = prefill[:n0] if b == 0 else prefill[n0:]
            torch.testing.assert_close(mine, ref[:-1], atol=ATOL, rtol=0)
            torch.testing.assert_close(decode[b], ref[-1], atol=ATOL, rtol=0)


def test_rules_match_hf_logits_processors(whisper):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    _, _, config, _ = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    gen = GenerationConfig(**config.generation_config)
    rng = random.Random(0)
    begin = tokens.timestamp_begin
    vocab = config.vocab_size
    for timestamps in (False, True):
        prompt = tokens.decoder_prompt("en", "transcribe", timestamps)
        procs = [SuppressTokensAtBeginLogitsProcessor(tokens.begin_suppress, len(prompt)),
                 SuppressTokensLogitsProcessor(tokens.suppress)]
        if timestamps:
            procs.append(WhisperTimeStampLogitsProcessor(gen, begin_index=len(prompt)))
        for trial in range(40):
            n = rng.randrange(0, 8)
            out = [rng.choice([rng.randrange(0, 300), rng.randrange(begin, vocab), begin + 5 * trial % 50])
                   for _ in range(n)]
            scores = torch.randn(1, vocab) * 3
            scores[0, begin:] -= rng.choice([0.0, 2.0, 6.0])
            ref = scores.clone()
            for proc in procs:
                ref = proc(torch.tensor([prompt + out]), ref)
            mine = tokens.apply(scores, [prompt], [out])
            torch.testing.assert_close(mine, ref, atol=0, rtol=0)


def test_language_prompt_allows_only_languages(whisper):
    _, _, config, _ = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    scores = tokens.apply(torch.randn(2, config.vocab_size), [tokens.language_prompt()] * 2, [[], []])
    assert set(torch.isfinite(scores).nonzero()[:, 1].tolist()) == set(tokens.lang_to_id.values())


def test_decoder_prompt_refuses_what_the_checkpoint_lacks(whisper):
    _, _, config, _ = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    with pytest.raises(ValueError, match="language: 'xx'"):
        tokens.decoder_prompt("xx", "transcribe", False)
    no_translate = WhisperTokens(**{**tokens.__dict__, "task_to_id": {"transcribe": 1}})
    with pytest.raises(ValueError, match="no 'translate' task"):
        no_translate.decoder_prompt("en", "translate", False)


def test_timed_segments(whisper):
    _, _, config, _ = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    b = tokens.timestamp_begin
    out = [b, 10, 11, b + 50, b + 50, 12, b + 120, tokens.eot]
    assert timed_segments(tokens, out, 8.0) == [TimedSegment(0.0, 1.0, [10, 11], (0, 4)),
                                                TimedSegment(1.0, 2.4, [12], (4, 7))]
    # unfinished last segment runs to the window's end; no timestamps at all: one segment
    assert timed_segments(tokens, [b + 5, 10, 11], 8.0) == [TimedSegment(0.1, 8.0, [10, 11], (0, 3))]
    assert timed_segments(tokens, [10, 11, tokens.eot], 8.0) == [TimedSegment(0.0, 8.0, [10, 11], (0, 2))]


def test_output_budget_follows_hf_generate(whisper):
    """HF's generate on a 4-token prompt: 20 new tokens when generation_config has no max_length, max_length
    new tokens when it has one (counted after the prompt), never past max_target_positions."""
    _, _, config, _ = whisper
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)
    unset = WhisperTokens(**{**tokens.__dict__, "max_length": None})
    assert unset.output_budget(4, 128) == 20 and unset.output_budget(3, 128) == 20
    assert WhisperTokens(**{**tokens.__dict__, "max_length": 30}).output_budget(4, 128) == 30
    assert tokens.output_budget(4, 128) == 124  # max_length 128: the decoder's positions bound it
    assert WhisperTokens(**{**tokens.__dict__, "max_new_tokens": 7}).output_budget(4, 128) == 7
    # A generation config without suppress lists suppresses nothing (HF does not read the model config then).
    bare = WhisperTokens.from_generation_config({"decoder_start_token_id": tokens.sot}, config.hf_config)
    assert bare.suppress == () and bare.begin_suppress == () and bare.eot == tokens.eot
