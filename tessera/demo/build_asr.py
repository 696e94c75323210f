"""Builds the untrained demo-asr checkpoint skeleton: tokenizer, chat template, processor, config.

demo-asr is HF's `Qwen2AudioForConditionalGeneration`: a Whisper-style audio encoder, a linear
projector and a Qwen2 decoder. It shares demo-vl's BPE tokenizer (which already holds the audio
special tokens and every word of the speech grammar). The audio chunk is 6 s, not Whisper's 30: the
longest utterance of the grammar (six slow three-syllable words) is about 5.3 s, and a shorter
chunk keeps the encoder cheap on a CPU. Longer audio goes through /v1/audio/transcriptions,
which cuts it into 6 s windows.
"""

from __future__ import annotations

import json
from pathlib import Path

from tessera.demo.build_vl import build_tokenizer, media_first_chat_template

RATE = 16_000
CHUNK_SECONDS = 6
NUM_MEL_BINS = 80
AUDIO_TOKENS = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}

# The audio parts of a message come first, then its text, so a request gives the model "the audio followed
# by `Transcribe the audio.`" whatever the order of its parts.
CHAT_TEMPLATE = media_first_chat_template(
    "{% if content['type'] in ('audio', 'input_audio', 'audio_url') or 'audio' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>{% endif %}"
)

DEMO_TEXT = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
DEMO_AUDIO = dict(d_model=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=512)


def build_processor_files(out_dir: Path, *, num_mel_bins: int = NUM_MEL_BINS, chunk_seconds: int = CHUNK_SECONDS):
    """Tokenizer (with the audio tokens named) + WhisperFeatureExtractor + Qwen2AudioProcessor; returns it."""
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor, WhisperFeatureExtractor

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    tok_cfg.update(AUDIO_TOKENS)
    tok_cfg["model_specific_special_tokens"] = AUDIO_TOKENS
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=RATE, chunk_length=chunk_seconds,
                                        return_attention_mask=True)
    processor = Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return processor


def build_config(processor, *, text: dict | None = None, audio: dict | None = None):
    from transformers import Qwen2AudioConfig

    tokenizer, extractor = processor.tokenizer, processor.feature_extractor

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    text_cfg = dict(
        vocab_size=(len(tokenizer) + 63) // 64 * 64, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"), pad_token_id=tid("<|endoftext|>"),
        **(text or DEMO_TEXT),
    )
    # The encoder takes exactly 2 * max_source_positions mel frames: the extractor's padded chunk.
    audio_cfg = dict(num_mel_bins=extractor.feature_size, max_source_positions=extractor.nb_max_frames // 2,
                     **(audio or DEMO_AUDIO))
    return Qwen2AudioConfig(audio_config=audio_cfg, text_config=text_cfg, audio_token_index=tid("<|AUDIO|>"),
                            tie_word_embeddings=True)


def build_skeleton(out_dir: Path, **processor_kwargs):
    """Writes tokenizer and processor files; returns the model config (weights come from training)."""
    return build_config(build_processor_files(out_dir, **processor_kwargs))
