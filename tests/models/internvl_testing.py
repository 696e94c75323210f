"""Test helpers for InternVL: tiny random checkpoints that can fail, prompts of tiles, HF references.

- `build_tiny_internvl(path, spec)`: weights + config only (token ids 120..122 in a 128-token vocab), for the
  model parity tests, which feed tiles directly;
- `make_tiny_internvl_checkpoint(path, ...)`: a complete checkpoint directory (config with
  architectures=["InternVLForConditionalGeneration"], the demo-vl tokenizer plus <img>, </img>, <IMG_CONTEXT>
  and <video> as named extra special tokens, a chat template, and an InternVLProcessor with a GotOcr2 image
  processor that `AutoProcessor.from_pretrained` loads), for processor, engine and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): every norm weight/bias, the layer scales
(lambda_1/2), the CLS token and the position embeddings (HF starts them at 0) are random, and the projector's
last layer is rescaled so image embeddings are text-sized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import Chunked, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.rope_vlm_testing import RopeVLCase, VLPrompt

VOCAB, IMAGE_ID, START_ID, END_ID = 128, 120, 121, 122

# InternVL's own chat template (InternVL3-hf), system prompt dropped: an image part is "<IMG_CONTEXT>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    text_type: str  # qwen2 | llama | qwen3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    image_size: int
    patch: int
    feature_layer: int
    vision_norm: str  # layer_norm | rms_norm
    vision_qk_norm: bool
    use_mean_pooling: bool
    seed: int

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch // 2) ** 2


SPECS = {
    # 6x6 patches per tile -> 3x3 tokens; Qwen2 text (q/k/v bias), GQA, untied, last layer.
    "qwen2_gqa": TinySpec("qwen2_gqa", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2, tie=False,
                          vision_hidden=32, vision_layers=2, vision_heads=2, image_size=48, patch=8, feature_layer=-1,
                          vision_norm="layer_norm", vision_qk_norm=False, use_mean_pooling=True, seed=0),
    # 4x4 patches -> 2x2 tokens; Qwen3 text (qk-norm), tied; a middle layer; RMSNorm + qk-norm ViT, final LayerNorm.
    "qwen3_tied": TinySpec("qwen3_tied", "qwen3", hidden=48, layers=3, heads=4, kv_heads=4, tie=True,
                           vision_hidden=24, vision_layers=3, vision_heads=2, image_size=56, patch=14,
                           feature_layer=-2, vision_norm="rms_norm", vision_qk_norm=True, use_mean_pooling=False,
                           seed=1),
    # Llama text with attention_bias; 8x8 patches -> 4x4 tokens.
    "llama_bias": TinySpec("llama_bias", "llama", hidden=32, layers=2, heads=2, kv_heads=1, tie=False,
                           vision_hidden=16, vision_layers=1, vision_heads=2, image_size=32, patch=4, feature_layer=-1,
                           vision_norm="layer_norm", vision_qk_norm=False, use_mean_pooling=True, seed=2),
}


def tiny_internvl_config(spec: TinySpec, vocab_size: int = VOCAB, image_token_id: int = IMAGE_ID, **text_extra):
    from transformers import InternVLConfig

    text = dict(model_type=spec.text_type, vocab_size=vocab_size, hidden_size=spec.hidden,
                intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.2, tie_word_embeddings=spec.tie, **text_extra)
    if spec.text_type == "qwen3":
        text["head_dim"] = 2 * spec.hidden // spec.heads  # not hidden / heads
    if spec.text_type == "llama":
        text["attention_bias"] = True
    vision = dict(hidden_size=spec.vision_hidden, num_hidden_layers=spec.vision_layers,
                  num_attention_heads=spec.vision_heads, intermediate_size=2 * spec.vision_hidden,
                  image_size=spec.image_size, patch_size=spec.patch, norm_type=spec.vision_norm,
                  use_qk_norm=spec.vision_qk_norm, use_mean_pooling=spec.use_mean_pooling,
                  attention_bias=spec.vision_qk_norm, initializer_range=0.1)
    return InternVLConfig(text_config=text, vision_config=vision, image_token_id=image_token_id,
                          image_seq_length=spec.tokens_per_tile, downsample_ratio=0.5,
                          vision_feature_layer=spec.feature_layer, tie_word_embeddings=spec.tie,
                          architectures=["InternVLForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases, layer scales, CLS token and position embeddings;
    the projector's last layer rescaled so image embeddings have the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif leaf == "bias" or leaf in ("lambda_1", "lambda_2"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("cls_token", "position_embeddings"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        vision = hf.config.vision_config
        probe = torch.randn(2, 3, *vision.image_size, generator=g)
        image = hf.model.get_image_features(probe).pooler_output
        text = hf.get_input_embeddings().weight
        scale = float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt())
        last = hf.model.multi_modal_projector.linear_2
        last.weight.mul_(scale)
        last.bias.mul_(scale)


def build_tiny_internvl(path: str | Path, spec: TinySpec):
    """The HF reference model (eval mode, eager attention), also saved to `path` (config + safetensors)."""
    from transformers import InternVLForConditionalGeneration

    return save_random_model(path, InternVLForConditionalGeneration, tiny_internvl_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed))


def build_prompt(spec: TinySpec, parts: list, seed: int = 0) -> VLPrompt:
    """parts: int n = n random text tokens (ids < 100); ("image", num_tiles) = <img>, the tiles' context tokens,
    </img>, with random tiles. Same parts and seed -> same prompt."""
    ids: list[int] = []
    items = []
    for (_, num_tiles), g in media_parts(parts, seed, ids):
        n = num_tiles * spec.tokens_per_tile
        ids.append(START_ID)
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE, hash=len(items), offsets=[(len(ids), len(ids) + n)],
            feature=torch.randn(num_tiles, 3, spec.image_size, spec.image_size, generator=g)))
        ids += [IMAGE_ID] * n + [END_ID]
    return VLPrompt(torch.tensor(ids), items)


# ---------------------------------------------------------------- the parity suite's row

class InternVLCase(RopeVLCase):
    def prompt(self, parts: list, seed: int = 0) -> VLPrompt:
        return build_prompt(self.spec, parts, seed)

    def hf_pixels(self, items: list[MultimodalDataItem]) -> dict[str, Any]:
        return {"pixel_values": torch.cat([it.feature for it in items])} if items else {}

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        ref = self.hf.model.get_image_features(self.hf_pixels(items)["pixel_values"]).pooler_output
        return [ref.reshape(-1, ref.shape[-1])]


PROMPTS = {
    "text": [12],
    "one_tile": [5, ("image", 1), 4],
    "tiles_and_thumbnail": [3, ("image", 5), 2],  # a 2x2 grid + thumbnail
    "two_images": [3, ("image", 3), 2, ("image", 1), 3],
}
DECODE_PROMPT = [3, ("image", 3), 2, ("image", 1), 4]


def load_case(name: str, path: Path) -> InternVLCase:
    from tessera.models.internvl import InternVLForConditionalGeneration

    case, config = InternVLCase.load(SPECS[name], path, build_tiny_internvl, InternVLForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.tie_word_embeddings == spec.tie
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, case.hf_inputs(p), 8))
    return case


def _prefix_shared(page_size: int) -> Callable[[InternVLCase, VLPrompt], int]:
    """Page size 1: just after </img>; 4: a page-aligned cut inside the image."""
    def shared(case: InternVLCase, a: VLPrompt) -> int:
        image_end = 5 + 2 * case.spec.tokens_per_tile  # </img>
        cut = image_end + 1 if page_size == 1 else (image_end - 2) // page_size * page_size
        assert cut > 5
        return cut
    return shared


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_internvl(path, SPECS[name]),
    bytes_spec="llama_bias", prompts=PROMPTS, text=Seeded(PROMPTS["text"], 8), decode=Seeded(DECODE_PROMPT, 3),
    batch=(Seeded(PROMPTS["text"], 4), Seeded(PROMPTS["two_images"], 5), Seeded(PROMPTS["one_tile"], 6)),
    # Chunks smaller than one tile's tokens, so every image is split across several chunks.
    chunked=tuple(Chunked([5, ("image", 3), 1, ("image", 1), 4], 6, lambda spec: spec.tokens_per_tile - 1, page)
                  for page in (1, 4)),
    prefix=Seeded([4, ("image", 2), 6], 7), prefix_cuts={f"page{p}": (p, _prefix_shared(p)) for p in (1, 4)},
    tower=(Seeded([2, ("image", 5), 1, ("image", 2), 1], 2),),
)


# ---------------------------------------------------------------- full checkpoint directory

def internvl_tokenizer():
    """The demo-vl tokenizer with InternVL's tokens as named extra special tokens."""
    from transformers import AutoTokenizer

    from tessera.config import ASSETS_DIR

    extra = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens=extra)


def make_tiny_internvl_checkpoint(path: str | Path, spec: TinySpec = SPECS["qwen2_gqa"], *, min_patches: int = 1,
                                  max_patches: int = 6, seed: int = 0) -> Path:
    """Writes a complete random InternVL checkpoint to `path` and returns it: the model of `spec` (its text
    widths and tower; the vocabulary is the tokenizer's), a GotOcr2ImageProcessor tiling images into
    spec.image_size tiles (min_patches..max_patches, thumbnail), an InternVLProcessor with
    image_seq_length = spec.tokens_per_tile, the chat template, and generation_config (eos <|im_end|>)."""
    from transformers import (GotOcr2ImageProcessor, InternVLForConditionalGeneration,
                              InternVLProcessor, InternVLVideoProcessor)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = internvl_tokenizer()
    image_processor = GotOcr2ImageProcessor(size={"height": spec.image_size, "width": spec.image_size},
                                            crop_to_patches=True, min_patches=min_patches, max_patches=max_patches)
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tok,
                                  video_processor=InternVLVideoProcessor(),
                                  image_seq_length=spec.tokens_per_tile, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = tiny_internvl_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, image_token_id=tok.context_image_token_id,
                               bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    save_random_model(path, InternVLForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      None, eos, pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
