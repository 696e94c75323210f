"""`--model-impl`: which implementation serves a checkpoint, and the family row of the Transformers backend.

`auto` serves an architecture with a row in the family table natively and any other transformers model through
the Transformers backend (models/transformers_backend.py); `native` refuses what has no row; `transformers` runs
even a native family's transformers code. Whether the backend can run a model is decided here, from the config
and transformers' classes, before any weight loads: the architecture must be a transformers class whose text
model sends its attention through the attention interface (`_supports_attention_backend`), decoder-only, without
attention soft-capping (our backends have none). The backend's row takes the generic processor (the HF
processor's own placeholder expansion, tessera/multimodal/processors/transformers_generic.py), except where the
positions are M-RoPE: those come from the native family's processor, which computes them.
"""

from __future__ import annotations

from typing import Any

from tessera.config import MODEL_IMPLS
from tessera.messages.items import Modality
from tessera.models.families import (
    BACKEND_NOTES,
    Family,
    UnsupportedArchitectureError,
    architecture_of,
    family_for_config,
    supported_architectures,
)

# The name our paged attention is registered under in transformers.AttentionInterface.
TESSERA_ATTENTION = "tessera_paged"
BACKEND_MODEL = "tessera.models.transformers_backend:TransformersModel"
GENERIC_PROCESSOR = "tessera.multimodal.processors.transformers_generic:TransformersProcessor"
# Families whose transformers code counts positions from 1 (PaliGemma: `position_ids + 1` when it makes them).
POSITION_OFFSETS = {"paligemma": 1}


def hf_model_class(architecture: str) -> type:
    """transformers' class of that name, or UnsupportedArchitectureError naming it."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is neither a native Tessera family nor a transformers model class "
            f"(transformers {transformers.__version__}), so no --model-impl serves it; native families: "
            f"{', '.join(supported_architectures())}")
    return cls


def text_config_key(hf_config: Any) -> str | None:
    """The sub-config name of the text model (`text_config`), None for a text-only config."""
    text = hf_config.get_text_config()
    if text is hf_config:
        return None
    for key in getattr(hf_config, "sub_configs", {}):
        if getattr(hf_config, key, None) is text:
            return key
    raise UnsupportedArchitectureError(f"{type(hf_config).__name__}: no sub-config holds the text model")


def resolve_family(hf_config: Any, model_impl: str = "auto") -> Family:
    """The family row that serves `hf_config` under `model_impl` (auto | native | transformers)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl: {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    native: Family | None = None
    try:
        native = family_for_config(hf_config)
    except UnsupportedArchitectureError as e:
        if model_impl == "native":
            raise UnsupportedArchitectureError(f"{e}. `--model-impl transformers` (or auto) serves other transformers "
                                               "models with their own modeling code") from None
    if native is not None and model_impl != "transformers":
        return native
    return backend_family(hf_config, native)


def backend_family(hf_config: Any, native: Family | None = None) -> Family:
    """The Transformers backend's row for `hf_config`; UnsupportedArchitectureError (before any weight loads) for
    what it cannot run, naming the architecture and the reason."""
    architecture = architecture_of(hf_config)
    cls = hf_model_class(architecture)
    reason = _unsupported_reason(hf_config, cls)
    if reason:
        raise UnsupportedArchitectureError(f"architecture {architecture!r}: {reason}, so the Transformers backend "
                                           "(--model-impl transformers) cannot serve it")
    text = hf_config.get_text_config()
    mrope = (native is not None and native.positions == "mrope") or \
        "mrope_section" in (getattr(text, "rope_parameters", None) or {})
    if mrope and (native is None or native.positions != "mrope"):
        raise UnsupportedArchitectureError(f"architecture {architecture!r}: M-RoPE positions are computed by a native "
                                           "processor, and this family has none")
    modalities: frozenset[Modality] = frozenset()
    processor = None
    if getattr(hf_config, "vision_config", None) is not None:
        # Videos where the config has a video token and the model a feature function for them (the processor
        # also needs a video processor: multimodal/processors/transformers_generic.py).
        video = hasattr(cls, "get_video_features") and any(
            isinstance(getattr(hf_config, n, None), int) for n in ("video_token_id", "video_token_index"))
        modalities = frozenset({Modality.IMAGE, Modality.VIDEO} if video else {Modality.IMAGE})
        processor = GENERIC_PROCESSOR
    if mrope and native is not None:
        modalities, processor = native.modalities, native.processor
    model_type = str(getattr(hf_config, "model_type", ""))
    # A text model whose attention modules are not causal (use_bidirectional_attention: PaliGemma's config sets
    # it) attends both ways over the whole prompt on its first forward (transformers' default sdpa, with no mask
    # or with PaliGemma's token_type_ids block over image and prompt), and each generated token sees all before
    # it: a prefix LM.
    prefix_lm = getattr(text, "use_bidirectional_attention", None) is True
    # A native row's bidirectional media spans (Gemma-3's images) are its transformers code's too.
    spans = native is not None and native.bidirectional_mm_spans
    return Family(architecture, BACKEND_MODEL, processor, modalities, "mrope" if mrope else "rope",
                  model_types=(model_type,), prefix_lm=prefix_lm, impl="transformers", bidirectional_mm_spans=spans,
                  backend_needs=native.backend_needs if native is not None else frozenset(),
                  vision_model_type=native.vision_model_type if native is not None else None, notes=BACKEND_NOTES,
                  quantization="none")


def _unsupported_reason(hf_config: Any, cls: type) -> str | None:
    if getattr(hf_config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (the backend runs decoder-only language models)"
    if not getattr(cls, "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface (AttentionInterface)"
    text = hf_config.get_text_config()
    if text is not hf_config:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        import transformers

        text_cls = getattr(transformers, MODEL_MAPPING_NAMES.get(str(text.model_type), ""), None)
        if text_cls is not None and not getattr(text_cls, "_supports_attention_backend", False):
            return (f"its text model ({text_cls.__name__}) does not send its attention through transformers' "
                    "attention interface")
    if getattr(getattr(hf_config, "vision_config", None), "deepstack_visual_indexes", None):
        return ("its vision features also enter decoder layers (DeepStack), which the backend's embedding merge does "
                "not feed")
    if getattr(text, "attn_logit_softcapping", None):
        return "its attention soft-caps the logits (attn_logit_softcapping), which Tessera's attention does not"
    return None


def refuse_backend_options(family: Family, enable_lora: bool, tp_size: int) -> None:
    """A ValueError naming the flag, before weights load, for what the Transformers backend cannot run."""
    if family.impl != "transformers":
        return
    if enable_lora:
        raise ValueError(f"enable_lora: {family.architecture} runs on the Transformers backend, whose nn.Linear layers "
                         "Tessera's per-request LoRA slots do not wrap; serve merged weights instead")
    if tp_size > 1:
        raise ValueError(f"tp_size: {family.architecture} runs on the Transformers backend, which does not shard "
                         "transformers' layers")
