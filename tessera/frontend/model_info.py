"""ModelInfo: the checkpoint's HF config, tokenizer and processor, normalised once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.config import ServerArgs

VISION_ARCHS = {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
AUDIO_ARCHS = {"Qwen2AudioForConditionalGeneration"}


@dataclass
class ModelInfo:
    args: ServerArgs
    hf_config: Any
    tokenizer: Any
    hf_processor: Any | None
    architecture: str
    context_length: int
    vocab_size: int

    @classmethod
    def load(cls, args: ServerArgs) -> ModelInfo:
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(args.model_path)
        arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
        text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        processor = None
        if arch in VISION_ARCHS | AUDIO_ARCHS:
            processor = AutoProcessor.from_pretrained(args.tokenizer_path or args.model_path)
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        if args.chat_template:
            tokenizer.chat_template = _read_template(args.chat_template)
            if processor is not None:
                processor.chat_template = tokenizer.chat_template
        ctx = args.context_length or int(getattr(text_cfg, "max_position_embeddings", 4096))
        return cls(args, hf_config, tokenizer, processor, arch, ctx, int(text_cfg.vocab_size))

    @property
    def has_image_understanding(self) -> bool:
        return self.architecture in VISION_ARCHS and not self.args.language_model_only

    @property
    def has_video_understanding(self) -> bool:
        return self.has_image_understanding

    @property
    def has_audio_understanding(self) -> bool:
        return self.architecture in AUDIO_ARCHS and not self.args.language_model_only

    def no_media_reason(self) -> str:
        if self.args.language_model_only:
            return "media: the server runs with --language-model-only and accepts text only"
        return f"media: model {self.architecture} takes text only"

    def make_mm_processor(self):
        """The multimodal processor for this architecture, or None for text-only serving."""
        if self.hf_processor is None:
            return None
        from tessera.multimodal.media import MediaLimits
        from tessera.multimodal.processors.registry import get_processor_class

        limits = MediaLimits.from_server_args(self.args)
        cls = get_processor_class(self.architecture)
        return cls(self.hf_processor, self.hf_config, self.args.mm_process_config, limits,
                   self.args.limit_mm_data_per_request, language_model_only=self.args.language_model_only,
                   cache_size_bytes=self.args.mm_cache_size_mb * 1024 * 1024)

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
