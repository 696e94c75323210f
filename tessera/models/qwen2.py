"""Qwen2 (`Qwen2ForCausalLM`): the shared decoder with biased q/k/v projections; also the language model
of Qwen2-VL, Qwen2.5-VL and Qwen2-Audio."""

from __future__ import annotations

from tessera.layers.decoder import DecoderOptions
from tessera.models.causal_lm import CausalLM

QWEN2_OPTIONS = DecoderOptions(qkv_bias=True)


class Qwen2ForCausalLM(CausalLM):
    decoder_options = QWEN2_OPTIONS
