"""Test helpers for Pixtral (LLaVA with a Pixtral vision tower): tiny random checkpoints that can fail,
prompts of native-resolution images, HF references.

- `build_tiny_pixtral(path, spec)`: weights + config only ([IMG] 120, [IMG_BREAK] 121, [IMG_END] 122 in a
  128-token vocab), for the model parity tests, which feed pixels directly;
- `make_tiny_pixtral_checkpoint(path, ...)`: a complete checkpoint directory (config with
  architectures=["LlavaForConditionalGeneration"] and a pixtral vision_config, the demo-vl tokenizer plus
  [IMG], [IMG_BREAK], [IMG_END], [INST], [/INST], a Mistral-style chat template, and a PixtralProcessor with a
  PixtralImageProcessor that `AutoProcessor.from_pretrained` loads), for processor, engine and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): every RMSNorm weight (tower and text) and bias is
random, and the projector's last layer is rescaled so image embeddings are text-sized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import Chunked, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.rope_vlm_testing import RopeVLCase, VLPrompt

VOCAB, IMG_ID, BREAK_ID, END_ID = 128, 120, 121, 122

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}[IMG]{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{{ content['text'] }}{% endfor %}{% endif %}<|im_end|>{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    text_type: str  # mistral | llama | qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    patch: int
    max_image: int  # vision image_size: the longest edge, in pixels
    feature_layer: int | tuple[int, ...]
    projector_bias: bool
    projector_act: str
    seed: int
    sliding_window: int | None = None  # Mistral: every layer slides when set


SPECS = {
    # Mistral text, GQA, head_dim != hidden / heads, untied, a 24-token sliding window (prompts are longer);
    # last layer, biased GELU projector.
    "mistral_gqa": TinySpec("mistral_gqa", "mistral", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=24,
                            tie=False, vision_hidden=32, vision_layers=2, vision_heads=2, patch=8, max_image=96,
                            feature_layer=-1, projector_bias=True, projector_act="gelu", seed=0, sliding_window=24),
    # Llama text, MHA, tied; two vision layers concatenated, unbiased SiLU projector.
    "llama_tied_layers": TinySpec("llama_tied_layers", "llama", hidden=48, layers=3, heads=4, kv_heads=4,
                                  head_dim=12, tie=True, vision_hidden=24, vision_layers=3, vision_heads=3, patch=6,
                                  max_image=72, feature_layer=(-1, -3), projector_bias=False, projector_act="silu",
                                  seed=1),
}


def tiny_pixtral_config(spec: TinySpec, vocab_size: int = VOCAB, image_token_id: int = IMG_ID, **text_extra):
    from transformers import LlavaConfig

    text = dict(model_type=spec.text_type, vocab_size=vocab_size, hidden_size=spec.hidden,
                intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, max_position_embeddings=1024,
                rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=spec.tie, **text_extra)
    if spec.text_type == "mistral":
        text["sliding_window"] = spec.sliding_window
    vision = dict(model_type="pixtral", hidden_size=spec.vision_hidden, num_hidden_layers=spec.vision_layers,
                  num_attention_heads=spec.vision_heads, intermediate_size=2 * spec.vision_hidden,
                  image_size=spec.max_image, patch_size=spec.patch, initializer_range=0.1)
    layer = spec.feature_layer if isinstance(spec.feature_layer, int) else list(spec.feature_layer)
    return LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token_id,
                       vision_feature_select_strategy="full", vision_feature_layer=layer,
                       multimodal_projector_bias=spec.projector_bias, projector_hidden_act=spec.projector_act,
                       tie_word_embeddings=spec.tie, architectures=["LlavaForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases; the projector's last layer rescaled so image
    embeddings have the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ("norm" in name or "ln_pre" in name) and leaf == "weight":
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif leaf == "bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        patch = hf.config.vision_config.patch_size
        probe = torch.randn(1, 3, 4 * patch, 6 * patch, generator=g)
        image = torch.cat(hf.model.get_image_features(probe, image_sizes=torch.tensor([[4 * patch, 6 * patch]]))
                          .pooler_output)
        text = hf.get_input_embeddings().weight
        scale = float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt())
        last = hf.model.multi_modal_projector.linear_2
        last.weight.mul_(scale)
        if last.bias is not None:
            last.bias.mul_(scale)


def build_tiny_pixtral(path: str | Path, spec: TinySpec):
    """The HF reference model (eval mode, eager attention), also saved to `path` (config + safetensors)."""
    from transformers import LlavaForConditionalGeneration

    return save_random_model(path, LlavaForConditionalGeneration, tiny_pixtral_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed))


def image_ids(rows: int, cols: int) -> list[int]:
    """[IMG] x cols [IMG_BREAK] per row, the last row closed by [IMG_END]."""
    out: list[int] = []
    for r in range(rows):
        out += [IMG_ID] * cols + [END_ID if r == rows - 1 else BREAK_ID]
    return out


def build_prompt(spec: TinySpec, parts: list, seed: int = 0) -> VLPrompt:
    """parts: int n = n random text tokens (ids < 100); ("image", (rows, cols)) = an image of rows x cols
    patches with random pixels. HF gets the images padded into one batch with their image_sizes."""
    ids: list[int] = []
    items = []
    for (_, (rows, cols)), g in media_parts(parts, seed, ids):
        start = len(ids)
        ids += image_ids(rows, cols)
        offsets = [(start + r * (cols + 1), start + r * (cols + 1) + cols) for r in range(rows)]
        h, w = rows * spec.patch, cols * spec.patch
        items.append(MultimodalDataItem(modality=Modality.IMAGE, hash=len(items), offsets=offsets,
                                        feature=torch.randn(3, h, w, generator=g),
                                        model_specific_data={"image_sizes": torch.tensor([[h, w]])}))
    return VLPrompt(torch.tensor(ids), items)


def hf_image_inputs(items: list[MultimodalDataItem]) -> dict[str, Any]:
    if not items:
        return {}
    sizes = [tuple(it.feature.shape[1:]) for it in items]
    batch = torch.zeros(len(items), 3, max(h for h, _ in sizes), max(w for _, w in sizes))
    for b, (it, (h, w)) in enumerate(zip(items, sizes)):
        batch[b, :, :h, :w] = it.feature
    return {"pixel_values": batch, "image_sizes": torch.tensor(sizes)}


# ---------------------------------------------------------------- the parity suite's row

class PixtralCase(RopeVLCase):
    def prompt(self, parts: list, seed: int = 0) -> VLPrompt:
        return build_prompt(self.spec, parts, seed)

    def hf_pixels(self, items: list[MultimodalDataItem]) -> dict[str, Any]:
        return hf_image_inputs(items)

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Each image encoded alone (ours packs them in one sequence whose block mask keeps them apart)."""
        return [self.hf.model.get_image_features(it.feature[None], image_sizes=torch.tensor(
            [list(it.feature.shape[1:])])).pooler_output[0] for it in items]


PROMPTS = {  # ("image", (rows, cols)) in patches
    "text": [12],
    "square": [5, ("image", (3, 3)), 4],
    "wide": [3, ("image", (2, 7)), 2],
    "tall": [2, ("image", (6, 2)), 3],
    "one_patch": [4, ("image", (1, 1)), 2],
    "two_sizes": [3, ("image", (4, 3)), 2, ("image", (2, 5)), 3],
}
DECODE_PROMPT = [3, ("image", (3, 4)), 2, ("image", (2, 2)), 4]


def load_case(name: str, path: Path) -> PixtralCase:
    from tessera.models.pixtral import PixtralLlavaForConditionalGeneration

    case, config = PixtralCase.load(SPECS[name], path, build_tiny_pixtral, PixtralLlavaForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.family.vision_model_type == "pixtral" and config.tie_word_embeddings == spec.tie
    assert config.head_dim == spec.head_dim
    assert config.sliding_windows == (spec.sliding_window,) * spec.layers  # Mistral slides every layer
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, case.hf_inputs(p), 8))
    return case


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_pixtral(path, SPECS[name]),
    bytes_spec="llama_tied_layers", prompts=PROMPTS, text=Seeded(PROMPTS["text"], 8),
    decode=Seeded(DECODE_PROMPT, 3),
    batch=(Seeded(PROMPTS["text"], 4), Seeded(PROMPTS["two_sizes"], 5), Seeded(PROMPTS["tall"], 6)),
    # Chunks of 5 tokens: every image (12 and 10 [IMG] tokens with their breaks) spans several chunks, and chunk
    # boundaries fall inside rows and on [IMG_BREAK] tokens.
    chunked=tuple(Chunked([5, ("image", (3, 4)), 1, ("image", (2, 5)), 4], 6, lambda spec: 5, page)
                  for page in (1, 4)),
    # Page size 1: one past [IMG_END]; 4: a cut inside the image.
    prefix=Seeded([4, ("image", (3, 3)), 6], 7),
    prefix_cuts={"page1": (1, lambda case, a: 4 + 3 * 4), "page4": (4, lambda case, a: 8)},
    # Images of three sizes from two prompts.
    tower=(Seeded([2, ("image", (5, 3)), 1, ("image", (1, 6)), 1], 2), Seeded([1, ("image", (2, 2)), 1], 3)),
)


# ---------------------------------------------------------------- full checkpoint directory

def pixtral_tokenizer():
    """The demo-vl tokenizer with Pixtral's image tokens and Mistral's [INST] / [/INST] as special tokens."""
    from transformers import AutoTokenizer

    from tessera.config import ASSETS_DIR

    extra = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
             "inst_token": "[INST]", "end_inst_token": "[/INST]"}
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens=extra)


def make_tiny_pixtral_checkpoint(path: str | Path, spec: TinySpec = SPECS["mistral_gqa"], *, seed: int = 0) -> Path:
    """Writes a complete random Pixtral-LLaVA checkpoint to `path` and returns it: the model of `spec` (its
    vocabulary is the tokenizer's), a PixtralImageProcessor capping the longest edge at spec.max_image with
    spec.patch patches, a PixtralProcessor, the chat template, and generation_config (eos <|im_end|>)."""
    from transformers import LlavaForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = pixtral_tokenizer()
    image_processor = PixtralImageProcessor(size={"longest_edge": spec.max_image},
                                            patch_size={"height": spec.patch, "width": spec.patch})
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tok, patch_size=spec.patch,
                                 spatial_merge_size=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = tiny_pixtral_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, image_token_id=tok.image_token_id,
                              bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    save_random_model(path, LlavaForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      None, eos, pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
