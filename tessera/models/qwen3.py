"""Qwen3 (`Qwen3ForCausalLM`): the shared decoder with RMSNorm over each head's q and k (qk-norm) and no
q/k/v bias unless the config's `attention_bias` asks for it (then on o_proj too, as transformers does);
also the language model of Qwen3-VL."""

from __future__ import annotations

from dataclasses import replace

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderOptions
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig

QWEN3_OPTIONS = DecoderOptions(qk_norm=True)


def qwen3_decoder_options(config: ModelConfig) -> DecoderOptions:
    bias = bool(getattr(config.hf_config.get_text_config(), "attention_bias", False))
    return replace(QWEN3_OPTIONS, qkv_bias=bias, o_bias=bias)


class Qwen3ForCausalLM(CausalLM):
    decoder_options = QWEN3_OPTIONS

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        self.decoder_options = qwen3_decoder_options(config)  # read by CausalLM.__init__ (a plain attribute)
        super().__init__(config, attn_backend, language_model_only)
