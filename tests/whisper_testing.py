"""Test helpers for Whisper: tiny random checkpoints with a real Whisper tokenizer, processor and generation config.

A checkpoint directory holds what `tessera serve` and transformers need: config + safetensors
(WhisperForConditionalGeneration.save_pretrained), a WhisperTokenizer laid out like OpenAI's (byte-level BPE text
tokens, then <|endoftext|>, <|startoftranscript|>, every language token in Whisper's order, the task tokens,
<|startofprev|>, <|nospeech|>, <|notimestamps|> and one timestamp token per 20 ms of the window), the
WhisperFeatureExtractor, and a generation_config.json with lang_to_id, task_to_id, no_timestamps_token_id,
suppress_tokens and begin_suppress_tokens (what HF generate reads for language, task and timestamps).

Random weights are shaped so that a parity test can fail (FAMILY-FIXTURES.md): norms get random scales and
biases, the <|endoftext|> row (HF zeroes it as the padding row) is random so the model can stop, and the
timestamp rows are scaled so that timestamps neither always win nor never appear.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RATE = 16_000
# Words for the tiny BPE (trained here, deterministically): enough merges for short words, and " " (a
# begin-suppressed token) exists as its own token, as in Whisper.
_CORPUS = (
    "the quick brown fox jumps over the lazy dog . red green blue circle square triangle one two three four "
    "five six seven eight nine zero hello world speech audio model whisper transcribe translate , ! ? "
)
TEXT_VOCAB = 320
# Languages of the tiny checkpoint's generation_config.lang_to_id (the tokenizer has all of Whisper's).
LANGUAGES = ("en", "de", "fr", "es", "zh")


def build_whisper_tokenizer(out_dir: Path, window_s: float):
    """Writes and returns a WhisperTokenizer with Whisper's special-token layout and window_s / 0.02 + 1
    timestamp tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import (
        LANGUAGES as ALL_LANGUAGES,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([_CORPUS] * 4, trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = WhisperTokenizer(vocab=state["vocab"], merges=merges)
    specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in ALL_LANGUAGES],
                "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                "<|notimestamps|>"]
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials], special_tokens=True)
    num_ts = int(round(window_s / 0.02)) + 1
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(num_ts)])
    tok.save_pretrained(out_dir)
    tok = WhisperTokenizer.from_pretrained(out_dir)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == len(state["vocab"]), "text tokens must come first"
    return tok


def build_tiny_whisper_checkpoint(path: Path, *, d_model: int = 64, layers: int = 2, heads: int = 4,
                                  num_mel_bins: int = 16, window_s: int = 8, max_target_positions: int = 128,
                                  seed: int = 0, timestamp_scale: float = 0.6) -> Path:
    """A random WhisperForConditionalGeneration whose encoder takes `window_s` seconds of audio."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    path.mkdir(parents=True, exist_ok=True)
    tok = build_whisper_tokenizer(path, window_s)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=RATE, chunk_length=window_s)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tok).save_pretrained(path)

    def tid(token: str) -> int:
        return int(tok.convert_tokens_to_ids(token))

    eot, sot = tid("<|endoftext|>"), tid("<|startoftranscript|>")
    no_ts = tid("<|notimestamps|>")
    space = tid("Ġ")
    # Whisper suppresses a set of punctuation-like text tokens and the special tokens that must never be
    # generated; <|startofprev|> is second to last, where HF's long-form code looks for it.
    suppress = sorted({tid(t) for t in ("!", "?")}) + [tid("<|translate|>"), tid("<|transcribe|>"),
                                                       tid("<|startoflm|>"), tid("<|startofprev|>"),
                                                       tid("<|nospeech|>")]
    begin_suppress = [space, eot]
    cfg = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=num_mel_bins, d_model=d_model, encoder_layers=layers,
        decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_source_positions=extractor.nb_max_frames // 2,
        max_target_positions=max_target_positions, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, suppress_tokens=suppress, begin_suppress_tokens=begin_suppress,
        architectures=["WhisperForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    timestamp_begin = no_ts + 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("encoder.embed_positions.weight"):
                continue  # sinusoidal, as HF initialises it
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif name.endswith("layer_norm.weight"):
                p.uniform_(0.5, 1.5)
            else:  # biases, norm biases
                p.normal_(0, 0.1)
        emb = model.model.decoder.embed_tokens.weight  # proj_out is tied to it
        emb[timestamp_begin:] *= timestamp_scale
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress, no_timestamps_token_id=no_ts,
        lang_to_id={f"<|{c}|>": tid(f"<|{c}|>") for c in LANGUAGES},
        task_to_id={"transcribe": tid("<|transcribe|>"), "translate": tid("<|translate|>")},
        is_multilingual=True, max_initial_timestamp_index=50, max_length=max_target_positions,
        return_timestamps=False, prev_sot_token_id=tid("<|startofprev|>"),
    )
    model.save_pretrained(path)
    return path
