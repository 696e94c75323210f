"""Test helpers for Qwen2-Audio: tiny random checkpoints with a real tokenizer and processor, synthetic audio.

A checkpoint directory holds what `tessera serve` and transformers' Auto classes need: config + safetensors
(Qwen2AudioForConditionalGeneration.save_pretrained), the demo BPE tokenizer (which already has
<|audio_bos|>, <|audio_eos|> and <|AUDIO|>), an audio chat template, and the WhisperFeatureExtractor /
Qwen2AudioProcessor files. Audio is synthesised here (tones, noise, silence), never downloaded.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

RATE = 16000
INSTRUCTION = "Transcribe the audio."

# Qwen style; within a message the audio parts come first, then the text parts (the layout
# "the audio followed by `Transcribe the audio.`" whatever the order of the parts in a request).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('audio', 'input_audio', 'audio_url') or 'audio' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>{% endif %}"
    "{% endfor %}{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_audio_checkpoint(path: Path, *, num_kv_heads: int = 2, hidden: int = 64, layers: int = 2,
                                heads: int = 4, num_mel_bins: int = 16, chunk_length: int = 30,
                                seed: int = 0) -> Path:
    """A random Qwen2-Audio checkpoint; the encoder takes `chunk_length` seconds (Whisper: 30)."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from tessera.demo.build_vl import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    audio_tokens = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    tok_cfg.update(audio_tokens)
    tok_cfg["model_specific_special_tokens"] = audio_tokens
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=RATE, chunk_length=chunk_length,
                                        return_attention_mask=True)
    Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer,
                        chat_template=CHAT_TEMPLATE).save_pretrained(path)

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    vocab_size = (len(tokenizer) + 63) // 64 * 64
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"), pad_token_id=tid("<|endoftext|>"))
    audio = dict(num_mel_bins=num_mel_bins, d_model=32, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=64, max_source_positions=chunk_length * RATE // extractor.hop_length // 2)
    cfg = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=tid("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(cfg)
    with torch.no_grad():  # HF's init is tiny; larger weights keep greedy choices apart from float noise
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed_positions" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def tone(seconds: float, freq: float = 440.0, rate: int = RATE, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def noise(seconds: float, seed: int = 0, rate: int = RATE, amplitude: float = 0.1) -> np.ndarray:
    return (amplitude * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)


def speechlike(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """Bursts of tone ("words", 0.2-0.6 s) separated by near-silent gaps (0.1-0.5 s)."""
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    total = int(seconds * rate)
    n = 0
    while n < total:
        word = tone(rng.uniform(0.2, 0.6), freq=rng.uniform(200, 800), rate=rate)
        gap = noise(rng.uniform(0.1, 0.5), seed=int(rng.integers(1 << 30)), rate=rate, amplitude=0.002)
        parts += [word, gap]
        n += len(word) + len(gap)
    return np.concatenate(parts)[:total]


def wav_bytes(x: np.ndarray, rate: int = RATE, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt)
    return buf.getvalue()
