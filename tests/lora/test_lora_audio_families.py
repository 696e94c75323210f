"""LoRA parity with HF transformers + PEFT (fp32) on the audio families, with audio: PEFT's "all-linear" adapter.

Qwen2-Audio: the language model's linears, the audio tower's (transformers' own nn.Linear) and the projector's.
Whisper: the decoder's linears run on each step's tokens; the encoder's, and cross-attention's K/V projections
(computed once per request from its encoder output), under the request's adapter when its audio is encoded and
its cross K/V written. A batch holds the adapter's requests and the base model's on the same audio.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tessera import Engine
from tests.audio_testing import RATE, build_tiny_audio_checkpoint, speechlike, tone
from tests.lora.lora_testing import make_adapter

MAX_NEW = 6


def _towers_targeted(adapter, *prefixes: str) -> bool:
    keys = load_file(adapter / "adapter_model.safetensors")
    return all(any(k.startswith(f"base_model.model.{p}") for k in keys) for p in prefixes)


def test_qwen2_audio_all_linear_adapter_matches_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tests.engine.test_engine_audio import chat_prompt

    path = build_tiny_audio_checkpoint(tmp_path / "base", num_kv_heads=2)

    def load():
        return Qwen2AudioForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()

    adapter = make_adapter(load(), tmp_path / "ad", seed=7, r=4, alpha=8, targets="all-linear", scale=0.2)
    assert _towers_targeted(adapter, "model.audio_tower.", "model.multi_modal_projector.", "model.language_model.")
    processor = AutoProcessor.from_pretrained(path)
    clip = [speechlike(2.0, seed=2)]
    prompt = chat_prompt(processor, 1)

    @torch.no_grad()
    def greedy(model) -> list[int]:
        enc = processor(text=[prompt], audio=clip, sampling_rate=RATE, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    base_want, want = greedy(load()), greedy(PeftModel.from_pretrained(load(), adapter).eval())
    assert want != base_want, "the adapter must change HF's tokens"
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with Engine(str(path), lora_paths=[f"ad={adapter}"], page_size=4, max_total_tokens=4096,
                show_progress=False) as engine:
        outs = engine.generate([prompt, prompt], sp, audio_data=[clip, clip], lora_path=["ad", None])
    assert [o["output_ids"] for o in outs] == [want, base_want]


def test_whisper_all_linear_adapter_matches_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    from tessera.models.config import ModelConfig
    from tessera.models.whisper_decoding import WhisperTokens
    from tests.whisper_testing import build_tiny_whisper_checkpoint

    path = build_tiny_whisper_checkpoint(tmp_path / "base")

    def load():
        return WhisperForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()

    adapter = make_adapter(load(), tmp_path / "ad", seed=7, r=4, alpha=8, targets="all-linear", scale=0.2)
    assert _towers_targeted(adapter, "model.encoder.", "model.decoder.")
    assert any("encoder_attn.k_proj" in k for k in load_file(adapter / "adapter_model.safetensors"))
    clips = [tone(1.5), speechlike(3.0, seed=2)]
    feats = AutoProcessor.from_pretrained(path).feature_extractor(clips, sampling_rate=RATE,
                                                                  return_tensors="pt").input_features
    config = ModelConfig.load(path)
    tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)

    @torch.no_grad()
    def greedy(model) -> list[list[int]]:
        out = model.generate(input_features=feats, language="en", task="transcribe", max_new_tokens=MAX_NEW,
                             return_dict_in_generate=True, force_unique_generate_call=True)  # the prompt kept
        return [[t for t in seq if t != tokens.eot] for seq in out.sequences.tolist()]

    base_want, want = greedy(load()), greedy(PeftModel.from_pretrained(load(), adapter).eval())
    assert want != base_want, "the adapter must change HF's tokens"
    prompt = tokens.decoder_prompt("en", "transcribe", False)
    with Engine(str(path), lora_paths=[f"ad={adapter}"], page_size=4, max_total_tokens=4096,
                show_progress=False) as engine:
        outs = engine.generate(input_ids=[prompt] * 4, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW},
                               audio_data=[*clips, *clips], lora_path=["ad", "ad", None, None])
    got = [prompt + [t for t in o["output_ids"] if t != tokens.eot] for o in outs]
    assert got == [*want, *base_want]
