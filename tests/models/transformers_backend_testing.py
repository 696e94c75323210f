"""Tiny random checkpoints of families served through the Transformers backend, one table row each: the config,
the HF processor (with the demo tokenizer and the family's special tokens), the projector whose output is
rescaled to text size, and what the family allows (two images).

A checkpoint is complete (config, weights, tokenizer, processor, chat template) and can fail
(shared/design/FAMILY-FIXTURES.md): norms random, the projector's output at the text embeddings' RMS, so a
dropped image, a wrong merge row or a mis-positioned token changes the greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.models.fixture_checks import save_random_model

HIDDEN = 64


def chat_template(image: str, video: str | None = None) -> str:
    """role: [media][text] lines, the family's placeholder text per image (and video)."""
    return ("{% for message in messages %}{{ message['role'] + ': ' }}{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
            "{{ '" + image + "' }}{% elif c['type'] == 'video' %}{{ '" + str(video) + "' }}{% endif %}{% endfor %}{% for c in message['content'] %}{% if c['type'] == 'text' %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def text_config(model_type: str, vocab: int, **extra) -> dict:
    return dict(model_type=model_type, vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, initializer_range=0.1, **extra)


def siglip(image_size: int, patch: int = 8, **extra) -> dict:
    return dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=image_size, patch_size=patch, **extra)


@dataclass(frozen=True)
class BackendFamily:
    architecture: str
    image_token: str  # the placeholder the chat template writes
    tokens: dict[str, str]  # extra special tokens the tokenizer needs (name -> token)
    config: Callable[[dict[str, int], int], Any]  # (token ids, vocab size) -> HF config
    processor: Callable[[Any, str], Any]  # (tokenizer, chat template) -> HF processor
    projector: str  # dotted path of the Linear whose output is the image embedding
    two_images: bool = True
    video_token: str | None = None  # the video placeholder, for a family whose videos are tested
    image_sizes: tuple[tuple[int, int], ...] = ((40, 56), (64, 48))


def _llava_onevision(ids: dict[str, int], vocab: int):
    from transformers import LlavaOnevisionConfig

    return LlavaOnevisionConfig(text_config=text_config("qwen2", vocab), vision_config=siglip(16),
                                image_token_index=ids["<image>"], video_token_index=ids["<video>"],
                                image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
                                vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9")


def _llava_onevision_processor(tok, template: str):
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    image = LlavaOnevisionImageProcessor(size={"height": 16, "width": 16},
                                         image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]])
    video = LlavaOnevisionVideoProcessor(size={"height": 16, "width": 16})
    return LlavaOnevisionProcessor(image_processor=image, video_processor=video, tokenizer=tok, num_image_tokens=4,
                                   vision_feature_select_strategy="full", chat_template=template)


def _idefics3(ids: dict[str, int], vocab: int, model_type: str = "idefics3"):
    from transformers import AutoConfig

    vision = dict(model_type=f"{model_type}_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    return AutoConfig.for_model(model_type, text_config=text_config("llama", vocab), vision_config=vision,
                                image_token_id=ids["<image>"], scale_factor=2)


_IDEFICS_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                   "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}


def _idefics3_processor(tok, template: str):
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return Idefics3Processor(image_processor=image, tokenizer=tok, image_seq_len=4, chat_template=template)


def _smolvlm_processor(tok, template: str):
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    image = SmolVLMImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    video = SmolVLMVideoProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
    return SmolVLMProcessor(image_processor=image, video_processor=video, tokenizer=tok, image_seq_len=4,
                            chat_template=template)


def _paligemma(ids: dict[str, int], vocab: int):
    from transformers import PaliGemmaConfig

    text = text_config("gemma", vocab, hidden_activation="gelu_pytorch_tanh")
    return PaliGemmaConfig(text_config=text, vision_config=siglip(32, projection_dim=HIDDEN),
                           image_token_index=ids["<image>"], projection_dim=HIDDEN, hidden_size=HIDDEN)


def _paligemma_processor(tok, template: str):
    from transformers import PaliGemmaProcessor, SiglipImageProcessor

    image = SiglipImageProcessor(size={"height": 32, "width": 32})
    image.image_seq_length = 16
    tok.bos_token = "<|endoftext|>"  # the processor writes BOS after the image tokens
    return PaliGemmaProcessor(image_processor=image, tokenizer=tok, chat_template=template)


_AYA_TOKENS = {"image_token": "<image>", "start_of_img": "<|START_OF_IMG|>", "end_of_img": "<|END_OF_IMG|>",
               "img_patch": "<|IMG_PATCH|>", "img_line_break": "<|IMG_LINE_BREAK|>"}


def _aya_vision(ids: dict[str, int], vocab: int):
    from transformers import AyaVisionConfig

    # Sliding layers with a window shorter than the prompts: the backend's sliding_window path runs.
    text = text_config("cohere2", vocab, layer_types=["sliding_attention", "full_attention"], sliding_window=24)
    return AyaVisionConfig(text_config=text, vision_config=siglip(32), downsample_factor=2,
                           image_token_index=ids["<|IMG_PATCH|>"], vision_feature_layer=-1)


def _aya_vision_processor(tok, template: str):
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessor

    image = GotOcr2ImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1,
                                  max_patches=4)
    # patch_size is the tower's: the processor multiplies it by downsample_factor.
    return AyaVisionProcessor(image_processor=image, tokenizer=tok, patch_size=8, img_size=32, downsample_factor=2,
                              chat_template=template)


def _mistral3(ids: dict[str, int], vocab: int):
    from transformers import Mistral3Config

    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, image_size=64, patch_size=8)
    config = Mistral3Config(text_config=text_config("mistral", vocab, sliding_window=None), vision_config=vision,
                            spatial_merge_size=2, image_token_index=ids["[IMG]"], vision_feature_layer=-1,
                            tie_word_embeddings=False)
    config.initializer_range = 0.02  # the projector's (0.1 there makes every image answer alike)
    return config


def _mistral3_processor(tok, template: str):
    from transformers import PixtralImageProcessor, PixtralProcessor

    image = PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8)
    return PixtralProcessor(image_processor=image, tokenizer=tok, patch_size=8, spatial_merge_size=2,
                            chat_template=template)


FAMILIES: dict[str, BackendFamily] = {f.architecture: f for f in (
    BackendFamily("LlavaOnevisionForConditionalGeneration", "<image>", {"image_token": "<image>",
                                                                        "video_token": "<video>"},
                  _llava_onevision, _llava_onevision_processor, "model.multi_modal_projector.linear_2",
                  video_token="<video>"),
    BackendFamily("Idefics3ForConditionalGeneration", "<image>", _IDEFICS_TOKENS, _idefics3, _idefics3_processor,
                  "model.connector.modality_projection.proj"),
    BackendFamily("SmolVLMForConditionalGeneration", "<image>", _IDEFICS_TOKENS,
                  lambda ids, vocab: _idefics3(ids, vocab, "smolvlm"), _smolvlm_processor,
                  "model.connector.modality_projection.proj"),
    BackendFamily("PaliGemmaForConditionalGeneration", "<image>", {"image_token": "<image>"}, _paligemma,
                  _paligemma_processor, "model.multi_modal_projector.linear"),
    BackendFamily("AyaVisionForConditionalGeneration", "<image>", _AYA_TOKENS, _aya_vision, _aya_vision_processor,
                  "model.multi_modal_projector.linear_2"),
    BackendFamily("Mistral3ForConditionalGeneration", "[IMG]", {"image_token": "[IMG]",
                                                                "image_break_token": "[IMG_BREAK]",
                                                                "image_end_token": "[IMG_END]"},
                  _mistral3, _mistral3_processor, "model.multi_modal_projector.linear_2"),
)}


def make_fixture_can_fail_(hf: torch.nn.Module, projector: str, probe: dict, seed: int) -> None:
    """In place: random norm weights and biases; the projector rescaled so image rows have the text RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm) or name.endswith("LayerNorm"):
                if getattr(module, "weight", None) is not None:
                    module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        text_rms = hf.get_input_embeddings().weight.pow(2).mean().sqrt()
        feats = hf.model.get_image_features(**probe)
        feats = getattr(feats, "pooler_output", feats)
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats]) if isinstance(feats, (list, tuple)) else feats
        scale = float(text_rms / feats.pow(2).mean().sqrt())
        last = hf.get_submodule(projector)
        last.weight.mul_(scale)
        if last.bias is not None:
            last.bias.mul_(scale)


def random_image(seed: int, size: tuple[int, int]):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (*size, 3), generator=g, dtype=torch.uint8).numpy())


def random_clip(seed: int, size: tuple[int, int], num_frames: int = 4) -> list:
    """A video as frames (PIL images) of random pixels."""
    return [random_image(seed * 100 + i, size) for i in range(num_frames)]


def make_checkpoint(path: Path, family: BackendFamily, seed: int = 0) -> Path:
    """A complete random checkpoint of `family` at `path`; returns it."""
    import transformers
    from transformers import AutoTokenizer

    from tessera.config import ASSETS_DIR

    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens=family.tokens)
    template = chat_template(family.image_token, family.video_token)
    processor = family.processor(tok, template)
    processor.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", *family.tokens.values())}
    vocab = (len(tok) + 63) // 64 * 64
    config = family.config(ids, vocab)
    config.architectures = [family.architecture]
    for cfg in (config, config.get_text_config()):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids["<|endoftext|>"], ids["<|im_end|>"], \
            ids["<|endoftext|>"]
    probe_text = family.image_token + "hi"
    probe = processor(text=[probe_text], images=[random_image(seed + 99, family.image_sizes[0])], return_tensors="pt")
    probe = {k: v for k, v in probe.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    save_random_model(path, getattr(transformers, family.architecture), config, seed,
                      lambda m: make_fixture_can_fail_(m, family.projector, probe, seed), None, ids["<|im_end|>"],
                      ids["<|endoftext|>"])
    return path
