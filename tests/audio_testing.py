"""Test helpers for Qwen2-Audio: tiny random checkpoints with a real tokenizer and processor, synthetic audio.

A checkpoint directory holds what `tessera serve` and transformers' Auto classes need: config + safetensors
(Qwen2AudioForConditionalGeneration.save_pretrained), the demo BPE tokenizer (which already has
<|audio_bos|>, <|audio_eos|> and <|AUDIO|>), an audio chat template, and the WhisperFeatureExtractor /
Qwen2AudioProcessor files. Audio is synthesised here (tones, noise, silence), never downloaded.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from tessera.demo.build_asr import CHAT_TEMPLATE, RATE, build_config, build_processor_files
from tessera.demo.speech import INSTRUCTION

__all__ = ["CHAT_TEMPLATE", "INSTRUCTION", "RATE", "build_tiny_audio_checkpoint", "noise", "speechlike", "tone",
           "wav_bytes"]


def build_tiny_audio_checkpoint(path: Path, *, num_kv_heads: int = 2, hidden: int = 64, layers: int = 2,
                                heads: int = 4, num_mel_bins: int = 16, chunk_length: int = 30,
                                seed: int = 0) -> Path:
    """A random Qwen2-Audio checkpoint laid out like demo-asr; the encoder takes `chunk_length` seconds."""
    from transformers import Qwen2AudioForConditionalGeneration

    processor = build_processor_files(path, num_mel_bins=num_mel_bins, chunk_seconds=chunk_length)
    cfg = build_config(
        processor,
        text=dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=num_kv_heads),
        audio=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64),
    )
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
