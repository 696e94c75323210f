"""The family table: every architecture Tessera serves, and everything the rest of the engine derives from it.

One row per HF architecture name (config.architectures[0]): our model class, the multimodal processor,
the modalities it takes, its position scheme, and what it needs from the attention backend and the
scheduler. The model registry (load_model), the processor registry, /model_info's capabilities,
`--language-model-only` and the frontend's startup check all read this table and nothing else, so they
cannot disagree. Classes are named "module:Class" and imported only when a model of that family loads.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from tessera.messages.items import Modality

IMAGE, VIDEO, AUDIO = Modality.IMAGE, Modality.VIDEO, Modality.AUDIO


@dataclass(frozen=True)
class Family:
    architecture: str  # HF config.architectures[0]
    model: str  # "module:Class" of our model (a tessera.models.base.TesseraModel)
    processor: str | None  # "module:Class" of the BaseMultimodalProcessor; None for text-only models
    modalities: frozenset[Modality]
    positions: str  # "rope" (1-D) | "mrope" (Qwen2-VL's 3-row multimodal RoPE) | "learned" (absolute table)
    model_types: tuple[str, ...] = ()  # config.model_type values, for configs saved without `architectures`
    # Attention inside each media item's token span is bidirectional (Gemma-3 images): the backend gets
    # custom masks and the scheduler never splits such a span across prefill chunks.
    bidirectional_mm_spans: bool = False
    # Attention-backend features the model needs beyond causal paged attention ("custom_mask",
    # "sliding_window"; see BaseAttentionBackend.features), checked when the model loads.
    backend_needs: frozenset[str] = frozenset()
    # One architecture name can front several families (LLaVA with a CLIP or a Pixtral tower): a row with
    # vision_model_type serves only configs whose vision_config.model_type equals it.
    vision_model_type: str | None = None
    # The decoder cross-attends to each request's encoder output (Whisper): the request takes one media item
    # and no placeholder tokens, its model class declares the cross-attention K/V as its request_state
    # (models/request_state.py), and the prefix cache is off (the decoder's K/V depend on the audio, which
    # the token ids do not show).
    encoder_decoder: bool = False
    notes: str = ""  # what the README's support table says is not supported
    # Pre-quantized checkpoints (models/quant_config.py) the README's table lists: the loader is the same for
    # every family; "tested" where a parity test against HF on the dequantized checkpoint runs.
    quantization: str = "AWQ, GPTQ, CT, FP8 (untested)"
    # A dual encoder served for embeddings only (CLIP): no generation, each request computed whole in one step
    # (the scheduler keeps its tokens together), no prefix cache (its towers do not use the paged KV).
    embedding_only: bool = False
    # A text family's base model without its LM head (`Qwen2Model`, `Qwen3ForEmbedding`, `Gemma3TextModel`: e5 / gte
    # style embedding checkpoints), derived from the family's *ForCausalLM row (headless_family): served for
    # embeddings (the server is an embedding server by itself), the decoder's weights found without `model.`.
    headless: bool = False
    # Hybrid linear attention (Qwen3-Next, Qwen3.5): each request also holds a conv and recurrent state per
    # linear-attention layer (cache/state_pool.py). The prefix cache keeps snapshots of that state at some of its
    # nodes and matches a prefix only up to one (scheduler/state_snapshots.py); speculative decoding rolls the state
    # back to the last accepted token (the state after each draft row is saved). Overlap scheduling works: a step's
    # state updates happen in its forward, in step order, and a row is given back only after the step in flight
    # that holds it.
    linear_attention: bool = False
    # A prefix-LM (PaliGemma): each request's whole prompt attends bidirectionally and is computed in one step.
    prefix_lm: bool = False
    # "native" (our model file) or "transformers" (the model's own transformers code under our attention:
    # models/transformers_backend.py; such rows are made by models/transformers_family.py, not listed here).
    impl: str = "native"

    @property
    def name(self) -> str:
        return self.architecture + (f" ({self.vision_model_type} vision)" if self.vision_model_type else "")

    @property
    def prefix_cache(self) -> bool:
        """Whether requests with the same leading tokens may share their K/V (the radix cache)."""
        return not self.encoder_decoder and not self.embedding_only

    def model_class(self) -> type:
        return _import(self.model)

    def processor_class(self) -> type | None:
        return _import(self.processor) if self.processor else None

    def served_modalities(self, language_model_only: bool) -> frozenset[Modality]:
        return frozenset() if language_model_only else self.modalities


def refuse_media(model_name: str, served: frozenset[Modality], given: list[Modality],
                 language_model_only: bool = False) -> None:
    """A ValueError in the user's words when a request brings media the served model does not take (checked
    before anything is loaded or decoded): "demo-asr takes audio (and text), not images"."""
    refused = [m for m in given if m not in served]
    if not refused:
        return
    names = ", ".join(sorted({f"{m.value}s" for m in refused}))
    if language_model_only:
        raise ValueError(f"media: {model_name} runs with --language-model-only and takes text only, not {names}")
    takes = " and ".join(sorted(m.value for m in served)) if served else "nothing"
    raise ValueError(f"media: {model_name} takes {takes} (and text), not {names}" if served else
                     f"media: {model_name} takes text only, not {names}")


_QWEN_VL_PROCESSOR = "tessera.multimodal.processors.qwen_vl:QwenVLProcessor"
_SPEECH_PROCESSORS = "tessera.multimodal.processors.speech_llm"
_QUANT_TESTED = "AWQ, GPTQ, CT, FP8 (tested)"
_QUANT_MOE = "dense layers (untested); not the MoE experts (stored fused)"
# Cosmos3's unified checkpoints: the understanding (Reasoner) tower is served, its tensors found in the
# checkpoint's own layout (tessera/models/cosmos3.py); the rest of the world model is not.
_COSMOS3_NOTES = "the world model's Generator (image/video generation), sound and action towers (skipped at load)"
_QUANT_HYBRID = "untested"
_HYBRID_NOTES = ("tensor parallelism; CUDA graphs; LoRA (untested); a hybrid draft model; fla-core kernels used "
                 "where installed (untested)")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("Qwen2ForCausalLM", "tessera.models.qwen2:Qwen2ForCausalLM", None, frozenset(), "rope",
           model_types=("qwen2",)),
    Family("Qwen2VLForConditionalGeneration", "tessera.models.qwen2_vl:Qwen2VLForConditionalGeneration",
           _QWEN_VL_PROCESSOR, frozenset({IMAGE, VIDEO}), "mrope", model_types=("qwen2_vl",),
           quantization=_QUANT_TESTED),
    Family("Qwen2_5_VLForConditionalGeneration", "tessera.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
           _QWEN_VL_PROCESSOR, frozenset({IMAGE, VIDEO}), "mrope", model_types=("qwen2_5_vl",)),
    Family("Qwen2AudioForConditionalGeneration",
           "tessera.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
           "tessera.multimodal.processors.qwen_audio:QwenAudioProcessor", frozenset({AUDIO}), "rope",
           model_types=("qwen2_audio",)),
    Family("Qwen3ASRForConditionalGeneration", "tessera.models.qwen3_asr:Qwen3ASRForConditionalGeneration",
           f"{_SPEECH_PROCESSORS}:Qwen3ASRProcessor", frozenset({AUDIO}), "rope", model_types=("qwen3_asr",),
           notes="forced alignment (Qwen3ASRForTokenClassification); word timestamps; the original "
                 "(non-transformers) checkpoint layout"),
    Family("GlmAsrForConditionalGeneration", "tessera.models.glm_asr:GlmAsrForConditionalGeneration",
           f"{_SPEECH_PROCESSORS}:GlmAsrProcessor", frozenset({AUDIO}), "rope", model_types=("glmasr",),
           notes="language detection (the request's language is reported); word timestamps"),
    Family("LlavaForConditionalGeneration", "tessera.models.llava:LlavaForConditionalGeneration",
           "tessera.multimodal.processors.llava:LlavaProcessor", frozenset({IMAGE}), "rope",
           model_types=("llava",),
           notes="vision towers other than CLIP and SigLIP (Pixtral has its own row); text models other than "
                 "Llama, Mistral, Qwen2"),
    Family("LlavaNextForConditionalGeneration", "tessera.models.llava_next:LlavaNextForConditionalGeneration",
           "tessera.multimodal.processors.llava:LlavaNextProcessor", frozenset({IMAGE}), "rope",
           model_types=("llava_next",),
           notes="vision_feature_select_strategy full with a CLIP tower (transformers fails too); text models "
                 "other than Llama, Mistral, Qwen2"),
    Family("Gemma3ForConditionalGeneration", "tessera.models.gemma3:Gemma3ForConditionalGeneration",
           "tessera.multimodal.processors.gemma3:Gemma3Processor", frozenset({IMAGE}), "rope",
           model_types=("gemma3",), bidirectional_mm_spans=True,
           backend_needs=frozenset({"custom_mask", "sliding_window"}),
           notes="attn_logit_softcapping; use_bidirectional_attention; RoPE scaling other than linear"),
    Family("Gemma4ForConditionalGeneration", "tessera.models.gemma4:Gemma4ForConditionalGeneration",
           "tessera.multimodal.processors.gemma4:Gemma4Processor", frozenset({IMAGE, VIDEO, AUDIO}), "rope",
           model_types=("gemma4",), bidirectional_mm_spans=True,
           backend_needs=frozenset({"custom_mask", "sliding_window"}),
           notes="use_bidirectional_attention all; tensor parallelism; audio is refused for checkpoints without an "
                 "audio tower", quantization=_QUANT_MOE),
    Family("Gemma4ForCausalLM", "tessera.models.gemma4:Gemma4ForCausalLM", None, frozenset(), "rope",
           model_types=("gemma4_text",), backend_needs=frozenset({"sliding_window"}),
           notes="tensor parallelism", quantization=_QUANT_MOE),
    Family("Gemma3ForCausalLM", "tessera.models.gemma3:Gemma3ForCausalLM", None, frozenset(), "rope",
           model_types=("gemma3_text",), backend_needs=frozenset({"sliding_window"}),
           notes="attn_logit_softcapping; use_bidirectional_attention; RoPE scaling other than linear"),
    Family("Qwen3ForCausalLM", "tessera.models.qwen3:Qwen3ForCausalLM", None, frozenset(), "rope",
           model_types=("qwen3",), quantization=_QUANT_TESTED),
    Family("Qwen3VLForConditionalGeneration", "tessera.models.qwen3_vl:Qwen3VLForConditionalGeneration",
           "tessera.multimodal.processors.qwen3_vl:Qwen3VLProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("qwen3_vl",),
           notes="precomputed embeddings without the DeepStack levels (they are hidden x (1 + levels) wide)"),
    Family("Cosmos3EdgeForConditionalGeneration", "tessera.models.cosmos3:Cosmos3EdgeForConditionalGeneration",
           "tessera.multimodal.processors.cosmos3:Cosmos3EdgeProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("cosmos3_edge",),
           notes=_COSMOS3_NOTES),
    Family("Cosmos3OmniForConditionalGeneration", "tessera.models.cosmos3:Cosmos3OmniForConditionalGeneration",
           "tessera.multimodal.processors.qwen3_vl:Qwen3VLProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("cosmos3_omni",),
           notes=_COSMOS3_NOTES + "; precomputed embeddings without the DeepStack levels"),
    Family("Glm4vForConditionalGeneration", "tessera.models.glm4v:Glm4vForConditionalGeneration",
           "tessera.multimodal.processors.glm4v:Glm4vProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("glm4v",),
           notes="an image and a video in one prompt are served but unchecked (transformers 5.24 refuses them)"),
    Family("Glm4vMoeForConditionalGeneration", "tessera.models.glm4v:Glm4vMoeForConditionalGeneration",
           "tessera.multimodal.processors.glm4v:Glm4vProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("glm4v_moe",), quantization=_QUANT_MOE,
           notes="tensor parallelism (MoE layers); LoRA on the experts and the router; an image and a video in one "
                 "prompt are served but unchecked (transformers 5.24 refuses them)"),
    Family("Qwen3VLMoeForConditionalGeneration", "tessera.models.qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
           "tessera.multimodal.processors.qwen3_vl:Qwen3VLProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("qwen3_vl_moe",),
           notes="precomputed embeddings without the DeepStack levels; LoRA on the experts and the router; expert "
                 "parallelism (tensor parallelism shards each expert's intermediate dim)", quantization=_QUANT_MOE),
    Family("Qwen3NextForCausalLM", "tessera.models.qwen3_next:Qwen3NextForCausalLM", None, frozenset(), "rope",
           model_types=("qwen3_next",), linear_attention=True, notes=_HYBRID_NOTES, quantization=_QUANT_HYBRID),
    Family("Qwen3_5ForConditionalGeneration", "tessera.models.qwen3_5:Qwen3_5ForConditionalGeneration",
           "tessera.multimodal.processors.qwen3_vl:Qwen3VLProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("qwen3_5",), linear_attention=True, notes=_HYBRID_NOTES, quantization=_QUANT_HYBRID),
    Family("Qwen3_5MoeForConditionalGeneration", "tessera.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
           "tessera.multimodal.processors.qwen3_vl:Qwen3VLProcessor", frozenset({IMAGE, VIDEO}), "mrope",
           model_types=("qwen3_5_moe",), linear_attention=True, notes=_HYBRID_NOTES, quantization=_QUANT_HYBRID),
    Family("Qwen3_5ForCausalLM", "tessera.models.qwen3_5:Qwen3_5ForCausalLM", None, frozenset(), "rope",
           model_types=("qwen3_5_text",), linear_attention=True, notes=_HYBRID_NOTES, quantization=_QUANT_HYBRID),
    Family("Qwen3_5MoeForCausalLM", "tessera.models.qwen3_5:Qwen3_5MoeForCausalLM", None, frozenset(), "rope",
           model_types=("qwen3_5_moe_text",), linear_attention=True, notes=_HYBRID_NOTES,
           quantization=_QUANT_HYBRID),
    Family("InternVLForConditionalGeneration", "tessera.models.internvl:InternVLForConditionalGeneration",
           "tessera.multimodal.processors.internvl:InternVLProcessor", frozenset({IMAGE}), "rope",
           model_types=("internvl",),
           notes="videos; vision_feature_layer lists; text models other than Qwen2, Qwen3, Llama, Mistral"),
    Family("LlavaForConditionalGeneration", "tessera.models.pixtral:PixtralLlavaForConditionalGeneration",
           "tessera.multimodal.processors.pixtral:PixtralProcessor", frozenset({IMAGE}), "rope",
           vision_model_type="pixtral",
           notes="Mistral-3's patch merger (spatial_merge_size > 1); vision_feature_select_strategy default "
                 "(no CLS token: transformers fails too); text models other than Mistral, Llama, Qwen2, Qwen3"),
    Family("Llama4ForConditionalGeneration", "tessera.models.llama4:Llama4ForConditionalGeneration",
           "tessera.multimodal.processors.llama4:Llama4Processor", frozenset({IMAGE}), "rope",
           model_types=("llama4",), backend_needs=frozenset({"custom_mask"}),
           notes="tensor parallelism (MoE layers); rope_type dynamic; chunked attention runs as per-request "
                 "masks (no decode K/V mirror)", quantization=_QUANT_MOE),
    Family("MllamaForConditionalGeneration", "tessera.models.mllama:MllamaForConditionalGeneration",
           "tessera.multimodal.processors.mllama:MllamaProcessor", frozenset({IMAGE}), "rope",
           model_types=("mllama",),
           notes="tensor parallelism; deferred image preprocessing; CUDA graphs (cross-attention K/V are "
                 "per-request pool slots: every tile of every image)"),
    Family("Kimi_K25ForConditionalGeneration", "tessera.models.kimi_k25:Kimi_K25ForConditionalGeneration",
           "tessera.multimodal.processors.kimi_k25:KimiK25Processor", frozenset({IMAGE}), "rope",
           model_types=("kimi_k25",),
           notes="videos; tensor parallelism (MLA and MoE layers); the latent KV cache (the pool holds decompressed "
                 "per-head K/V, V zero-padded); LoRA on the router and experts; multi-token prediction layers"),
    Family("WhisperForConditionalGeneration", "tessera.models.whisper:WhisperForConditionalGeneration",
           "tessera.multimodal.processors.whisper:WhisperAudioProcessor", frozenset({AUDIO}), "learned",
           model_types=("whisper",), encoder_decoder=True,
           notes="tensor parallelism; prefix caching (off: decoder K/V depend on the audio); word timestamps; "
                 "beam search and temperature fallback"),
    Family("Llama4ForCausalLM", "tessera.models.llama4:Llama4ForCausalLM", None, frozenset(), "rope",
           model_types=("llama4_text",), backend_needs=frozenset({"custom_mask"}),
           notes="tensor parallelism (MoE layers); rope_type dynamic", quantization=_QUANT_MOE),
    Family("CLIPModel", "tessera.models.clip:CLIPModel", "tessera.multimodal.processors.clip:CLIPProcessor",
           frozenset({IMAGE}), "learned", model_types=("clip",), embedding_only=True,
           notes="generation (embeddings only: a text or one image per input); tensor parallelism",
           quantization="none"),
    Family("SiglipModel", "tessera.models.siglip:SiglipModel", "tessera.multimodal.processors.clip:CLIPProcessor",
           frozenset({IMAGE}), "learned", model_types=("siglip",), embedding_only=True,
           notes="generation (embeddings only: a text or one image per input); tensor parallelism; SigLIP 2",
           quantization="none"),
)}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no row in the family table."""


def supported_architectures() -> list[str]:
    return sorted({f.architecture for f in FAMILIES.values()})


def architecture_of(hf_config: Any) -> str:
    """config.architectures[0], or the architecture its model_type implies."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    model_type = getattr(hf_config, "model_type", None)
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family.architecture
    raise UnsupportedArchitectureError(
        f"config.json has no `architectures` and model_type={model_type!r} is unknown; "
        f"supported architectures: {', '.join(supported_architectures())}")


def get_family(architecture: str, vision_model_type: str | None = None) -> Family:
    """The row for an architecture (and, where rows differ by vision tower, its vision model_type)."""
    rows = [f for f in FAMILIES.values() if f.architecture == architecture]
    if not rows:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}")
    for family in rows:
        if family.vision_model_type is not None and family.vision_model_type == vision_model_type:
            return family
    generic = [f for f in rows if f.vision_model_type is None]
    if not generic:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} with a {vision_model_type!r} vision tower is not supported; "
            f"supported towers: {', '.join(sorted(str(f.vision_model_type) for f in rows))}")
    return generic[0]


def family_for_config(hf_config: Any) -> Family:
    vision = getattr(hf_config, "vision_config", None)
    architecture = architecture_of(hf_config)
    headless = headless_family(architecture, getattr(hf_config, "model_type", None))
    return headless if headless is not None else get_family(architecture, getattr(vision, "model_type", None))


HEADLESS_SUFFIXES = ("ForEmbedding", "EmbeddingModel", "Model")


def headless_family(architecture: str, model_type: str | None) -> Family | None:
    """The row of a text family's base model served for embeddings (vLLM serves `*Model` architectures so; SGLang
    names its own `*EmbeddingModel`): an architecture without a row of its own, named as one of
    HEADLESS_SUFFIXES after a text family's stem ("Qwen2Model" -> Qwen2ForCausalLM; "Gemma3TextModel" ->
    Gemma3ForCausalLM), whose config's model_type is that row's. None otherwise."""
    if any(f.architecture == architecture for f in FAMILIES.values()):
        return None
    for suffix in HEADLESS_SUFFIXES:
        if not architecture.endswith(suffix):
            continue
        stem = architecture[:-len(suffix)]
        for name in (stem + "ForCausalLM", stem.removesuffix("Text") + "ForCausalLM"):
            row = FAMILIES.get(name)
            if row is not None and not row.modalities and model_type in row.model_types:
                return dataclasses.replace(row, architecture=architecture, model_types=(), headless=True,
                                           notes=row.notes)
    return None


# What the Transformers backend does not run (its rows' "not supported").
BACKEND_NOTES = ("CUDA graphs; LoRA; tensor parallelism; pre-quantized checkpoints (--torchao-config works); "
                 "embeddings; audio")
# Architectures without a native row that the Transformers backend is tested on (greedy tokens equal to HF
# generate: tests/models/test_transformers_backend.py); the README's table lists them.
BACKEND_TESTED = {"AyaVisionForConditionalGeneration": "image", "Idefics3ForConditionalGeneration": "image",
                  "LlavaOnevisionForConditionalGeneration": "image, video",
                  "Mistral3ForConditionalGeneration": "image", "PaliGemmaForConditionalGeneration": "image",
                  "SmolVLMForConditionalGeneration": "image"}


def support_table() -> str:
    """The README's table of supported architectures (a test keeps the README equal to it)."""
    lines = ["| architecture (`config.json`) | implementation | modalities | positions | pre-quantized checkpoints | "
             "not supported |", "|---|---|---|---|---|---|"]
    rows = [(f.name, f) for f in FAMILIES.values()] + [(a, None) for a in BACKEND_TESTED]
    for name, f in sorted(rows, key=lambda r: r[0]):
        if f is None:
            modalities = BACKEND_TESTED[name]
            lines.append(f"| `{name}` | Transformers backend | {modalities} | RoPE | none | {BACKEND_NOTES} |")
            continue
        arch = f"`{f.architecture}`" + (f" ({f.vision_model_type} vision)" if f.vision_model_type else "")
        modalities = ", ".join(sorted(m.value for m in f.modalities)) or "text"
        positions = {"rope": "RoPE", "mrope": "M-RoPE", "learned": "learned"}.get(f.positions, f.positions)
        lines.append(f"| {arch} | native | {modalities} | {positions} | {f.quantization} | {f.notes} |")
    return "\n".join(lines)


def _import(target: str) -> type:
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
