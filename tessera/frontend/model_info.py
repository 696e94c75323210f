"""ModelInfo: the checkpoint's HF config, tokenizer and processor, normalised once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.config import ServerArgs
from tessera.models.config import ModelConfig
from tessera.messages.items import Modality


@dataclass
class ModelInfo:
    args: ServerArgs
    config: ModelConfig
    tokenizer: Any
    hf_processor: Any | None
    architecture: str
    context_length: int
    vocab_size: int

    @classmethod
    def load(cls, args: ServerArgs, config: ModelConfig | None = None) -> ModelInfo:
        """The tokenizer and processor of the checkpoint whose config is `config` (read here when the
        process has not read it yet); an architecture outside the family table fails at that read, at
        startup, with the supported ones listed (UnsupportedArchitectureError, a ValueError)."""
        from transformers import AutoProcessor, AutoTokenizer

        config = config or ModelConfig.load(args.model_path, args.model_impl)
        processor = None
        if config.family.processor is not None:
            processor = AutoProcessor.from_pretrained(args.tokenizer_path or args.model_path)
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        # transformers warns "sequence length is longer than the specified maximum" for over-long prompts,
        # which the frontend refuses with a 400 of its own: mark the warning as given (in every process that
        # tokenizes, the preprocessing workers too).
        warned = getattr(tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
        if args.chat_template:
            tokenizer.chat_template = _read_template(args.chat_template)
            if processor is not None:
                processor.chat_template = tokenizer.chat_template
        ctx = args.context_length or config.max_position_embeddings
        return cls(args, config, tokenizer, processor, config.architecture, ctx, config.vocab_size)

    @property
    def hf_config(self) -> Any:
        return self.config.hf_config

    @property
    def modalities(self) -> frozenset[Modality]:
        """What this server accepts besides text (none with --language-model-only)."""
        return self.config.family.served_modalities(self.args.language_model_only)

    @property
    def has_image_understanding(self) -> bool:
        return Modality.IMAGE in self.modalities

    @property
    def has_video_understanding(self) -> bool:
        return Modality.VIDEO in self.modalities

    @property
    def has_audio_understanding(self) -> bool:
        return Modality.AUDIO in self.modalities

    @property
    def is_embedding(self) -> bool:
        """Served for embeddings only: --is-embedding, or an embedding architecture (CLIP, SigLIP, a headless base
        model such as Qwen2Model)."""
        return self.args.is_embedding or self.config.family.embedding_only or self.config.family.headless

    def no_media_reason(self) -> str:
        if self.args.language_model_only:
            return "media: the server runs with --language-model-only and accepts text only"
        return f"media: model {self.architecture} takes text only"

    def make_mm_processor(self):
        """The multimodal processor for this architecture, or None for text-only serving."""
        if self.hf_processor is None:
            return None
        from tessera.multimodal.media import MediaLimits

        limits = MediaLimits.from_server_args(self.args)
        cls = self.config.family.processor_class()
        assert cls is not None  # hf_processor is only loaded for families with a processor
        return cls(self.hf_processor, self.hf_config, self.args.mm_process_config, limits,
                   self.args.mm_items_per_request, language_model_only=self.args.language_model_only,
                   cache_size_bytes=self.args.mm_cache_size_mb * 1024 * 1024,
                   defer_images=not self.args.disable_deferred_mm_preprocessing,
                   defer_min_feature_bytes=self.defer_min_feature_bytes())

    def defer_min_feature_bytes(self) -> int:
        """The deferral floor (multimodal/deferred.py) when the model runs on a CPU, where the worker's
        preprocessing would lengthen its steps; none on a GPU, where the worker preprocesses on the device."""
        from tessera.multimodal.deferred import DEFER_MIN_FEATURE_BYTES
        from tessera.platform.device import platform_of, resolve_device

        return DEFER_MIN_FEATURE_BYTES if platform_of(resolve_device(self.args.device)).runs_on_host_cores else 0

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        target = self.hf_processor if self.hf_processor is not None else self.tokenizer
        return target.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=False, **kwargs)


def _read_template(value: str) -> str:
    """--chat-template takes a file path or an inline Jinja template."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    return value
