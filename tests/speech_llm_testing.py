"""Tiny random Qwen3-ASR and GLM-ASR checkpoints, built offline: one table of configs, one builder.

A checkpoint holds what `tessera serve` and transformers' Auto classes need: config + safetensors, the demo BPE
tokenizer with the family's audio tokens added, its chat template and its processor (Qwen3ASRFeatureExtractor or
WhisperFeatureExtractor). Weights are made able to fail (shared/design/FAMILY-FIXTURES.md): every parameter random,
norm weights and biases included, and the projector scaled so that audio tokens are about text-sized; the builder
checks that the logits depend on the audio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tessera.demo.build_vl import build_tokenizer
from tests.audio_testing import RATE, speechlike, tone

__all__ = ["SPEECH_LLMS", "SpeechLLM", "build_speech_llm"]

_AUDIO_PART = "content['type'] in ('audio', 'input_audio', 'audio_url') or 'audio' in content"


def _template(system: str, turn: str, audio: str, end: str, assistant: str) -> str:
    """A chat template: an optional system turn, then each message with its audio parts replaced by `audio`."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}" + system + "{% endif %}"
        + turn + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if " + _AUDIO_PART + " %}" + audio +
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + assistant + "{% endif %}"
    )


@dataclass(frozen=True)
class SpeechLLM:
    """One family's fixture: its tokens, chat template, processor and config arguments."""

    name: str
    tokens: dict[str, str]  # the tokenizer's named audio tokens (extra_special_tokens)
    added: tuple[str, ...]  # further added tokens: (special ones, ...)
    plain: tuple[str, ...]  # added tokens that decode as text (Qwen3-ASR's <asr_text>)
    chat_template: str
    eos: tuple[str, ...]
    text: dict = field(default_factory=dict)
    audio: dict = field(default_factory=dict)


QWEN3_ASR = SpeechLLM(
    "qwen3_asr",
    tokens={"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"},
    added=("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>"), plain=("<asr_text>",),
    chat_template=_template("<|im_start|>system\n<|im_end|>\n", "<|im_start|>{{ message['role'] }}\n",
                            "<|audio_start|><|audio_pad|><|audio_end|>", "<|im_end|>\n", "<|im_start|>assistant\n"),
    eos=("<|im_end|>", "<|endoftext|>"),
    text=dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16),
    # Attention windows of 200 mel frames (2 s): the test clips span several.
    audio=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
               output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8),
)
GLM_ASR = SpeechLLM(
    "glmasr",
    tokens={"audio_token": "<|pad|>"},
    added=("<|pad|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|user|>", "<|assistant|>", "<|system|>"), plain=(),
    chat_template=_template("", "<|{{ message['role'] }}|>\n", "<|begin_of_audio|><|pad|><|end_of_audio|>\n", "",
                            "<|assistant|>\n"),
    eos=("<|user|>", "<|endoftext|>"),
    text=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096),
    # intermediate_size is 4 x hidden_size: the projector reads four encoder frames at a time.
    audio=dict(num_mel_bins=16, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
)
SPEECH_LLMS = {f.name: f for f in (QWEN3_ASR, GLM_ASR)}
GLM_CHUNK_SECONDS = 4  # GLM-ASR's window (Whisper's 30 s in the real checkpoint): a 5 s clip takes two


def _processor(spec: SpeechLLM, path: Path):
    from transformers import (GlmAsrProcessor, PreTrainedTokenizerFast, Qwen3ASRFeatureExtractor, Qwen3ASRProcessor,
                              WhisperFeatureExtractor)
    from tokenizers import AddedToken

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec.added], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    tokenizer.save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(spec.tokens, model_specific_special_tokens=spec.tokens)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    mel = spec.audio["num_mel_bins"]
    if spec.name == QWEN3_ASR.name:
        extractor = Qwen3ASRFeatureExtractor(feature_size=mel, sampling_rate=RATE, n_window=spec.audio["n_window"])
        processor = Qwen3ASRProcessor(feature_extractor=extractor, tokenizer=tokenizer,
                                      chat_template=spec.chat_template)
    else:
        extractor = WhisperFeatureExtractor(feature_size=mel, sampling_rate=RATE, chunk_length=GLM_CHUNK_SECONDS,
                                            return_attention_mask=True)
        processor = GlmAsrProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=spec.chat_template)
    processor.save_pretrained(path)
    return processor


def _config(spec: SpeechLLM, tokenizer):
    from transformers import GlmAsrConfig, Qwen3ASRConfig

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    eos = [tid(t) for t in spec.eos]
    text = dict(vocab_size=(len(tokenizer) + 63) // 64 * 64, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=tid("<|endoftext|>"),
                eos_token_id=eos, pad_token_id=tid("<|endoftext|>"), **spec.text)
    audio_token = tid(spec.tokens["audio_token"])
    if spec.name == QWEN3_ASR.name:
        return Qwen3ASRConfig(audio_config=spec.audio, text_config=text, audio_token_id=audio_token,
                              eos_token_id=eos, pad_token_id=tid("<|endoftext|>"), tie_word_embeddings=True)
    return GlmAsrConfig(audio_config=spec.audio, text_config=text, audio_token_id=audio_token, tie_word_embeddings=True)


def _randomize(model: torch.nn.Module, projector_scale: float) -> None:
    """Every weight random (norms and biases too: HF starts them at 1 and 0, so a dropped one would go unseen);
    the projector's output scaled so that audio tokens are about as large as text embeddings."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.1)
        model.model.multi_modal_projector.linear_2.weight.mul_(projector_scale)


def _check_audio_matters(model, processor, spec: SpeechLLM) -> None:
    """The fixture must be able to fail: two clips give different prefill logits, with a clear top-2 margin."""
    logits = []
    kwargs = {"sampling_rate": RATE} if spec.name == QWEN3_ASR.name else {}
    for clip in (tone(1.5), speechlike(1.5, seed=3)):
        inputs = processor.apply_transcription_request(clip, **kwargs)
        with torch.inference_mode():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3), "the fixture's output does not depend on the audio"
    top2 = logits[0].topk(2).values
    assert float(top2[0] - top2[1]) > 1e-4, "the fixture's top-2 logits are tied"


def build_speech_llm(name: str, path: Path, seed: int = 0, text: dict | None = None,
                     audio: dict | None = None) -> Path:
    """A random checkpoint of family `name` ("qwen3_asr" or "glmasr") at `path`; `text` / `audio` override the
    table's sizes (the transcription benchmark's larger model)."""
    from transformers import GlmAsrForConditionalGeneration, Qwen3ASRForConditionalGeneration

    spec = SPEECH_LLMS[name]
    spec = replace(spec, text={**spec.text, **(text or {})}, audio={**spec.audio, **(audio or {})})
    processor = _processor(spec, path)
    cfg = _config(spec, processor.tokenizer)
    torch.manual_seed(seed)
    cls = Qwen3ASRForConditionalGeneration if spec.name == QWEN3_ASR.name else GlmAsrForConditionalGeneration
    model = cls(cfg).eval()
    _randomize(model, projector_scale=0.5)
    _check_audio_matters(model, processor, spec)
    model.save_pretrained(path)
    gen = {"do_sample": False, "eos_token_id": cfg.get_text_config().eos_token_id,
           "pad_token_id": cfg.get_text_config().pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


if __name__ == "__main__":  # a quick look: python -m tests.speech_llm_testing /tmp/x qwen3_asr
    import sys

    print(build_speech_llm(sys.argv[2], Path(sys.argv[1])))
