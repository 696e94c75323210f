"""The decoder options of the text models that multimodal families wrap (InternVL, Pixtral/LLaVA).

A wrapper's language model is whatever its `text_config.model_type` says; these are the differences the
shared decoder blocks need to know. Anything else is refused by name rather than run wrongly.
"""

from __future__ import annotations

from typing import Any

from tessera.layers.decoder import DecoderOptions


def decoder_options_for(text_config: Any) -> DecoderOptions:
    """DecoderOptions for a Qwen2, Qwen3, Llama or Mistral text config.

    Qwen2 always has biased q/k/v and an unbiased o_proj; Llama's and Qwen3's `attention_bias` biases all four
    projections; Qwen3 adds an RMSNorm over each head's q and k; Mistral has no biases.
    """
    model_type = str(getattr(text_config, "model_type", ""))
    if getattr(text_config, "mlp_bias", False):
        raise NotImplementedError(f"text_config.mlp_bias=True ({model_type}): biased MLPs are not supported")
    if model_type == "qwen2":
        return DecoderOptions(qkv_bias=True)
    if model_type in ("llama", "qwen3"):
        bias = bool(getattr(text_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=model_type == "qwen3")
    if model_type == "mistral":
        return DecoderOptions()
    raise NotImplementedError(
        f"text_config.model_type={model_type!r}: the language model must be qwen2, qwen3, llama or mistral")
