"""Test helpers for LLaVA-1.5 and LLaVA-NeXT: tiny random checkpoints that can fail, prompts, the parity suite's
case, and LLaVA-1.5's row of it (LLaVA-NeXT's is in llava_next_testing.py).

Two entry points build checkpoints:
- `build_tiny_llava(path, spec)`: weights + config only, image token 120 in a 128-token vocab (the model parity
  tests, which feed pixel tiles directly);
- `make_tiny_llava_checkpoint(path, ...)`: a complete checkpoint directory (weights, config, the demo-vl tokenizer
  with an `<image>` token, a LLaVA chat template and a LlavaProcessor / LlavaNextProcessor that
  `AutoProcessor.from_pretrained` loads), for processor and server tests.

Both make fixtures that can fail (shared/design/FAMILY-FIXTURES.md): norm weights and biases are random (HF starts
them at 1 and 0), the projector's last layer is rescaled so image embeddings are text-sized, and LLaVA-NeXT's
image_newline is text-sized too. The language model is the one the spec names (Llama, Mistral, Qwen2).
Other test directories import it as `tests.models.llava_testing`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import Chunked, FamilyCase, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import hf_generate, save_random_model

VOCAB, IMAGE_ID = 128, 120

# LLaVA-1.5 style chat template: images first, then the text; "USER: ... ASSISTANT:".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>\n' }}"
    "{% endif %}{% endfor %}{% for content in message['content'] %}{% if content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """A tiny LLaVA (pinpoints None) or LLaVA-NeXT (pinpoints in tiles: (rows, cols) multiples of image_size)."""

    name: str
    text_type: str  # "llama" | "mistral" | "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool
    vision_hidden: int
    vision_layers: int
    image_size: int
    patch: int
    feature_layer: int | tuple[int, ...]
    strategy: str  # "default" | "full"
    seed: int
    pinpoints: tuple[tuple[int, int], ...] | None = None
    text_extra: tuple[tuple[str, Any], ...] = ()
    vision_type: str = "clip_vision_model"  # or "siglip_vision_model" (no CLS token)

    @property
    def is_next(self) -> bool:
        return self.pinpoints is not None

    @property
    def grid_pinpoints(self) -> list[list[int]] | None:
        if self.pinpoints is None:
            return None
        return [[r * self.image_size, c * self.image_size] for r, c in self.pinpoints]


NEXT_TILES = ((1, 2), (2, 1), (2, 2), (1, 3), (3, 1))
SPECS = {
    # LLaVA-1.5
    "llama": TinySpec("llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, tie=False, vision_hidden=32,
                      vision_layers=3, image_size=42, patch=14, feature_layer=-2, strategy="default", seed=1,
                      text_extra=(("attention_bias", True),)),
    "mistral": TinySpec("mistral", "mistral", hidden=48, layers=3, heads=4, kv_heads=4, tie=True, vision_hidden=24,
                        vision_layers=3, image_size=28, patch=7, feature_layer=(-3, -1), strategy="full", seed=1,
                        text_extra=(("sliding_window", 12),)),  # windows far shorter than the prompts
    "qwen2": TinySpec("qwen2", "qwen2", hidden=64, layers=2, heads=8, kv_heads=2, tie=False, vision_hidden=32,
                      vision_layers=2, image_size=42, patch=14, feature_layer=-1, strategy="default", seed=2),
    "siglip": TinySpec("siglip", "llama", hidden=48, layers=2, heads=4, kv_heads=1, tie=False, vision_hidden=32,
                       vision_layers=2, image_size=28, patch=7, feature_layer=-1, strategy="default", seed=6,
                       vision_type="siglip_vision_model"),
    # LLaVA-NeXT
    "next_llama": TinySpec("next_llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, tie=False,
                           vision_hidden=32, vision_layers=3, image_size=28, patch=7, feature_layer=-2,
                           strategy="default", seed=4, pinpoints=NEXT_TILES),
    "next_qwen2": TinySpec("next_qwen2", "qwen2", hidden=48, layers=2, heads=4, kv_heads=2, tie=True,
                           vision_hidden=24, vision_layers=2, image_size=42, patch=14, feature_layer=(-2, -1),
                           strategy="default", seed=4, pinpoints=((1, 2), (2, 1), (2, 2))),
}


def tiny_llava_config(spec: TinySpec, vocab_size: int = VOCAB, image_token_id: int = IMAGE_ID,
                      special_ids: dict[str, int | None] | None = None):
    from transformers import LlavaConfig, LlavaNextConfig

    ids = special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    text = dict(model_type=spec.text_type, vocab_size=vocab_size, hidden_size=spec.hidden,
                intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, rms_norm_eps=1e-6, max_position_embeddings=1024,
                tie_word_embeddings=spec.tie,
                # Much wider than HF's 0.02: top logits stay apart and greedy continuations vary.
                initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                **ids, **dict(spec.text_extra))
    vision = dict(model_type=spec.vision_type, hidden_size=spec.vision_hidden,
                  intermediate_size=2 * spec.vision_hidden, num_hidden_layers=spec.vision_layers,
                  num_attention_heads=2, image_size=spec.image_size, patch_size=spec.patch)
    if spec.vision_type == "clip_vision_model":
        vision["projection_dim"] = spec.vision_hidden
    layer = spec.feature_layer if isinstance(spec.feature_layer, int) else list(spec.feature_layer)
    common = dict(text_config=text, vision_config=vision, image_token_index=image_token_id,
                  vision_feature_layer=layer, vision_feature_select_strategy=spec.strategy,
                  tie_word_embeddings=spec.tie)
    if spec.is_next:
        return LlavaNextConfig(**common, image_grid_pinpoints=spec.grid_pinpoints,
                               architectures=["LlavaNextForConditionalGeneration"])
    return LlavaConfig(**common, architectures=["LlavaForConditionalGeneration"])


def hf_model_class(spec: TinySpec):
    from transformers import (
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
    )

    return LlavaNextForConditionalGeneration if spec.is_next else LlavaForConditionalGeneration


def make_fixture_can_fail_(hf: torch.nn.Module, spec: TinySpec, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)); the projector's linear_2 rescaled so image
    embeddings have the text embeddings' RMS; image_newline (NeXT) drawn at the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        text_rms = hf.get_input_embeddings().weight.pow(2).mean().sqrt()
        if spec.is_next:  # two square images of one tile's size: the base tile + their grid tiles each
            from tessera.models.llava import LlavaImageGeometry

            size = (spec.image_size, spec.image_size)
            tiles = LlavaImageGeometry.from_config(hf.config).num_tiles(size)
            probe = torch.randn(2, tiles, 3, spec.image_size, spec.image_size, generator=g)
            kwargs = {"image_sizes": torch.tensor([size, size])}
        else:
            probe = torch.randn(2, 3, spec.image_size, spec.image_size, generator=g)
            kwargs = {}
        feats = torch.cat(list(hf.model.get_image_features(probe, **kwargs).pooler_output))
        scale = float(text_rms / feats.pow(2).mean().sqrt())
        last = hf.model.multi_modal_projector.linear_2
        last.weight.mul_(scale)
        last.bias.mul_(scale)
        if spec.is_next:
            hf.model.image_newline.copy_(torch.randn(spec.hidden, generator=g) * text_rms)


def build_tiny_llava(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    return save_random_model(path, hf_model_class(spec), tiny_llava_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

@dataclass
class Prompt:
    input_ids: torch.Tensor  # [L]
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order
    is_next: bool = False

    def hf_inputs(self) -> dict:
        """HF forward/generate kwargs (no pixel keys for a text-only prompt)."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids[None]}
        if not self.items:
            return inputs
        if not self.is_next:
            inputs["pixel_values"] = torch.stack([it.feature for it in self.items])
            return inputs
        most = max(it.feature.shape[0] for it in self.items)  # HF pads every image to the most tiles
        inputs["pixel_values"] = torch.stack([torch.cat([it.feature, it.feature.new_zeros(
            most - it.feature.shape[0], *it.feature.shape[1:])]) for it in self.items])
        inputs["image_sizes"] = torch.cat([it.model_specific_data["image_sizes"] for it in self.items])
        return inputs

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def build_prompt(spec: TinySpec, parts: list, seed: int = 0) -> Prompt:
    """parts: int n = n random text tokens (ids < 100); ("image", (h, w)) = an image of that original size (its
    size matters to LLaVA-NeXT only) with random pixel tiles. Same parts and seed -> same prompt."""
    from tessera.models.llava import LlavaImageGeometry

    geometry = LlavaImageGeometry.from_config(tiny_llava_config(spec))
    ids: list[int] = []
    items = []
    for (_, size), g in media_parts(parts, seed, ids):
        size = tuple(size)
        num = geometry.num_image_tokens(size)
        start = len(ids)
        ids += [IMAGE_ID] * num
        tiles = geometry.num_tiles(size)
        pixels = torch.randn(tiles, 3, spec.image_size, spec.image_size, generator=g)
        msd = {"image_sizes": torch.tensor([size])} if spec.is_next else {}
        items.append(MultimodalDataItem(modality=Modality.IMAGE, hash=len(items), offsets=[(start, start + num)],
                                        feature=pixels if spec.is_next else pixels[0], model_specific_data=msd))
    return Prompt(torch.tensor(ids), items, spec.is_next)


# ---------------------------------------------------------------- full checkpoint directory

def make_tiny_llava_checkpoint(path: str | Path, spec: TinySpec | str = "llama", weights: bool = True) -> Path:
    """Writes a complete random LLaVA / LLaVA-NeXT checkpoint to `path` (created if missing) and returns it.

    - config.json: LlavaConfig / LlavaNextConfig (architectures set) from `spec` (a TinySpec or a SPECS name), with
      the demo-vl tokenizer's vocabulary (+ `<image>`) and special-token ids (eos `<|im_end|>`);
    - model.safetensors: random weights that can fail (deterministic: same spec -> same bytes);
    - generation_config.json;
    - tokenizer (+ `<image>` as the image_token) + CHAT_TEMPLATE + processor_config.json: AutoProcessor gives a
      LlavaProcessor (CLIPImageProcessor, crops of image_size) or a LlavaNextProcessor (LlavaNextImageProcessor
      with the spec's grid pinpoints), patch_size, select strategy and num_additional_image_tokens=1 (CLIP's CLS).
    With weights=False only config.json and the processor files are written (a processor-test skeleton).
    """
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    from tessera.config import ASSETS_DIR

    spec = SPECS[spec] if isinstance(spec, str) else spec
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens={"image_token": "<image>"})
    sizes = dict(size={"shortest_edge": spec.image_size},
                 crop_size={"height": spec.image_size, "width": spec.image_size})
    common = dict(tokenizer=tok, patch_size=spec.patch, vision_feature_select_strategy=spec.strategy,
                  num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    if spec.is_next:
        image_processor = LlavaNextImageProcessor(**sizes, image_grid_pinpoints=spec.grid_pinpoints)
        processor = LlavaNextProcessor(image_processor=image_processor, **common)
    else:
        image_processor = CLIPImageProcessor(**sizes)
        processor = LlavaProcessor(image_processor=image_processor, **common)
    processor.save_pretrained(path)

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<image>")}
    vocab_size = (len(tok) + 63) // 64 * 64
    cfg = tiny_llava_config(spec, vocab_size, ids["<image>"], {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]})
    if not weights:
        cfg.save_pretrained(path)
        return path
    save_random_model(path, hf_model_class(spec), cfg, spec.seed, lambda m: make_fixture_can_fail_(m, spec, spec.seed),
                      None, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def load_hf_reference(path: str | Path, spec: TinySpec | str) -> Any:
    """transformers' LLaVA model from `path`, float32, eager attention, eval mode."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    return hf_model_class(spec).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ---------------------------------------------------------------- the parity suite's rows

class LlavaCase(FamilyCase):
    """Plain 1-D positions; an image's rows are one run (LLaVA-NeXT's tiles and newlines included)."""

    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(self.spec, parts, seed)

    def hf_inputs(self, prompt: Prompt) -> dict:
        return prompt.hf_inputs()

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        inputs = Prompt(torch.zeros(0, dtype=torch.long), items, self.spec.is_next).hf_inputs()
        extra = {"image_sizes": inputs["image_sizes"]} if self.spec.is_next else {}
        return list(self.hf.model.get_image_features(inputs["pixel_values"], **extra).pooler_output)


def load_case(name: str, path: Path, decode_parts: list) -> LlavaCase:
    from tessera.models.llava import LlavaForConditionalGeneration

    case, config = LlavaCase.load(SPECS[name], path, build_tiny_llava, LlavaForConditionalGeneration)
    spec, hf, ours = case.spec, case.hf, case.ours
    assert type(ours).__name__ == type(hf).__name__
    assert config.tie_word_embeddings == spec.tie
    case.check_fixture_can_fail(decode_parts, lambda p: hf_generate(hf, p.hf_inputs(), 8), num_text=3)
    return case


def prefix_shared(page_size: int) -> Callable[[LlavaCase, Prompt], int]:
    """Page size 1: the whole repeated image; 4: a page-aligned cut inside it."""
    def shared(case: LlavaCase, a: Prompt) -> int:
        start, end = a.items[0].offsets[0]
        n = end if page_size == 1 else end - end % page_size - page_size
        assert n > start
        return n
    return shared


IMAGE = ("image", (0, 0))  # LLaVA-1.5: every image is one crop, its original size does not matter
PROMPTS = {
    "text": [14],
    "one_image": [5, IMAGE, 4],
    "two_images": [3, IMAGE, 2, IMAGE, 3],
}
DECODE_PROMPT = [3, IMAGE, 5]


def check_geometry_and_options(case: LlavaCase, monkeypatch) -> None:
    """Tokens per image (a CLIP tower's CLS kept by "full"; a SigLIP tower has none, and "default" drops its
    first patch, as transformers does), the feature layers, the attention biases and sliding windows follow the
    config."""
    from tessera.models.llava import LlavaImageGeometry

    spec = case.spec
    g = LlavaImageGeometry.from_config(case.hf.config)
    side = spec.image_size // spec.patch
    siglip = spec.vision_type == "siglip_vision_model"
    assert g.tokens_per_tile == side * side + (spec.strategy == "full") - siglip
    assert case.ours.vision_feature_layer == (spec.feature_layer if isinstance(spec.feature_layer, int)
                                              else list(spec.feature_layer))
    attn = case.ours.model.layers[0].self_attn
    llama_bias = dict(spec.text_extra).get("attention_bias", False)
    has_bias = {"llama": (llama_bias,) * 2, "mistral": (False, False), "qwen2": (True, False)}[spec.text_type]
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == has_bias
    windows = case.ours.config.sliding_windows
    assert windows == ((12,) * spec.layers if spec.text_type == "mistral" else (None,) * spec.layers)


FIXTURE = FamilyFixture(
    specs=("llama", "mistral", "qwen2", "siglip"), load_case=lambda name, path: load_case(name, path, DECODE_PROMPT),
    build=lambda path, name: build_tiny_llava(path, SPECS[name]), prompts=PROMPTS, text=Seeded(PROMPTS["text"], 8),
    decode=Seeded(DECODE_PROMPT, 3), decode_new=8,
    batch=(Seeded(PROMPTS["two_images"], 4), Seeded([2, IMAGE, 9], 5)),
    chunked=(Chunked([3, IMAGE, 2, IMAGE, 3], 6, lambda spec: 4, 2),),
    prefix=Seeded([4, IMAGE, 6], 7), prefix_cuts={f"page{p}": (p, prefix_shared(p)) for p in (1, 4)},
    tower=(Seeded([1, IMAGE, 1, IMAGE, 1, IMAGE], 2),), checks={"geometry_and_options": check_geometry_and_options},
)
