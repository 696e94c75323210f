"""The LLaVA-style wrappers (LLaVA, InternVL, Pixtral): a vision tower and a projector over a text model.

A wrapper's language model is whatever its `text_config.model_type` says; the decoder options are the differences
the shared decoder blocks need to know. Anything else is refused by name rather than run wrongly. The
wrappers also share their checkpoint names and their one encoder.
"""

from __future__ import annotations

from typing import Any

from tessera.layers.decoder import STACKED_PARAMS, DecoderOptions
from tessera.messages.items import Modality
from tessera.models.base import Encoder
from tessera.models.config import ModelConfig
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
    """Mixin for a LLaVA-style family (a CausalLM subclass): `vision_tower` and `multi_modal_projector` (None
    with language_model_only) over a language model that is whatever its text_config names. The decoder
    options come from the text config (CausalLM reads them after setting self.config); images are encoded by
    the subclass's `get_image_feature`."""

    config: Any
    vision_tower: Any
    get_image_feature: Encoder

    @property
    def decoder_options(self) -> DecoderOptions:
        return decoder_options_for(self.config.hf_config.get_text_config())

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        return wrapper_weight_mapping(config.tie_word_embeddings, language_model_only,
                                      ("vision_tower.", "multi_modal_projector."),
                                      cls.extra_prefix_rules(language_model_only))

    @classmethod
    def extra_prefix_rules(cls, language_model_only: bool) -> tuple[tuple[str, str | None], ...]:
        """Checkpoint-name rules of a subclass's own modules, after the wrapper's."""
        return ()

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_tower is None else {Modality.IMAGE: self.get_image_feature}


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
