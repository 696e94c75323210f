"""The decoder options of the text models that multimodal families wrap (InternVL, Pixtral/LLaVA).

A wrapper's language model is whatever its `text_config.model_type` says; these are the differences the
shared decoder blocks need to know. Anything else is refused by name rather than run wrongly.
"""

from __future__ import annotations

from typing import Any

from tessera.layers.decoder import STACKED_PARAMS, DecoderOptions
from tessera.models.weights import WeightMapping


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


class WrappedTextModel:
    """Mixin for a multimodal family (a CausalLM subclass) whose language model is whatever its text_config
    names: the decoder options come from the text config (CausalLM reads them after setting self.config)."""

    config: Any

    @property
    def decoder_options(self) -> DecoderOptions:
        return decoder_options_for(self.config.hf_config.get_text_config())


def wrapper_weight_mapping(tied: bool, language_model_only: bool, modules: tuple[str, ...],
                           extra: tuple[tuple[str, str | None], ...] = ()) -> WeightMapping:
    """The checkpoint names of a LLaVA-style wrapper: transformers saves `language_model.model.*`,
    `language_model.lm_head.*` and each of `modules` (e.g. "vision_tower.", "multi_modal_projector.") at
    the top level; its in-memory 5.x names are `model.language_model.*`, `model.<module>*` and `lm_head.*`.
    `modules` are dropped with language_model_only; `extra` rules come last. More specific prefixes first."""
    lm_head = None if tied else "lm_head."
    rules: list[tuple[str, str | None]] = [("language_model.lm_head.", lm_head), ("language_model.model.", "model."),
                                           ("model.language_model.", "model.")]
    for module in modules:
        target = None if language_model_only else module
        rules += [("model." + module, target), (module, target)]
    rules += [("lm_head.", lm_head), *extra]
    # Encoders keep transformers' own module layouts (separate q/k/v, gate/up): stack only our decoder.
    return WeightMapping(prefix_rules=tuple(rules), stacked=STACKED_PARAMS, stacked_prefix="model.")
