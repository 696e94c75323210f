"""Test helpers for LLaVA-1.5 and LLaVA-NeXT: tiny random checkpoints that can fail, prompts, HF references.

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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.fixture_checks import (  # noqa: F401  (MIN_MARGIN, top2_margin: re-exported to the tests)
    MIN_MARGIN,
    check_greedy_depends_on_inputs,
    hf_stepped_greedy,
    prompt_variants,
    top2_margin,
)

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
    torch.manual_seed(spec.seed)
    hf = hf_model_class(spec)._from_config(tiny_llava_config(spec), attn_implementation=attn_implementation).eval()
    make_fixture_can_fail_(hf, spec, spec.seed)
    hf.save_pretrained(path)
    return hf


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
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    items = []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, 100, (part,), generator=g).tolist()
            continue
        size = tuple(part[1])
        num = geometry.num_image_tokens(size)
        start = len(ids)
        ids += [IMAGE_ID] * num
        tiles = geometry.num_tiles(size)
        pixels = torch.randn(tiles, 3, spec.image_size, spec.image_size, generator=g)
        msd = {"image_sizes": torch.tensor([size])} if spec.is_next else {}
        items.append(MultimodalDataItem(modality=Modality.IMAGE, hash=len(items), offsets=[(start, start + num)],
                                        feature=pixels if spec.is_next else pixels[0], model_specific_data=msd))
    return Prompt(torch.tensor(ids), items, spec.is_next)


def prompt_mm_embeds(model, prompt: Prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embeddings [n, H]) for the whole prompt; all images in one encoder call."""
    if not prompt.items:
        return None, None
    embeds = model.get_image_feature(prompt.items)
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat(embeds)


# ---------------------------------------------------------------- references

def hf_greedy(hf, inputs: dict, num_new: int) -> tuple[list[int], float]:
    """Greedy tokens of HF's model stepped with its own KV cache, and the smallest top-2 logit margin."""
    return hf_stepped_greedy(hf, inputs, num_new)


def hf_generate(hf, inputs: dict, num_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_logits(hf, prompt: Prompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**prompt.hf_inputs()).logits[0]


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
        GenerationConfig,
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
    torch.manual_seed(spec.seed)
    model = hf_model_class(spec)._from_config(cfg).eval()
    make_fixture_can_fail_(model, spec, spec.seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(path)
    return path


def load_hf_reference(path: str | Path, spec: TinySpec | str) -> Any:
    """transformers' LLaVA model from `path`, float32, eager attention, eval mode."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    return hf_model_class(spec).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ---------------------------------------------------------------- parity checks over the paged test driver
# Shared by test_llava.py and test_llava_next.py: each builds prompts for its family and calls these.

ATOL = 1e-4


@dataclass
class Case:
    spec: TinySpec
    hf: Any
    ours: Any
    path: Path


def load_case(spec: TinySpec, path: Path, decode_parts: list) -> Case:
    """Builds the HF reference, loads ours from its checkpoint, and checks the fixture can fail: image embeddings
    are text-sized, greedy output depends on the image and on the text, is not one repeated token, its choices are
    not float noise, and the reference is deterministic and equal to HF generate."""
    from tessera.models.llava import LlavaForConditionalGeneration
    from tessera.models.registry import load_model

    hf = build_tiny_llava(path, spec)
    ours, config = load_model(path, torch.float32)
    assert type(ours).__name__ == type(hf).__name__ and isinstance(ours, LlavaForConditionalGeneration)
    assert config.tie_word_embeddings == spec.tie
    case = Case(spec, hf, ours, path)
    base = build_prompt(spec, decode_parts, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    ratio = float(embeds.pow(2).mean().sqrt() / ours.model.embed_tokens.weight.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    _, other_image, other_text = prompt_variants(lambda: build_prompt(spec, decode_parts, seed=0), num_text=3)
    tokens = check_greedy_depends_on_inputs(lambda p: hf_greedy(hf, p.hf_inputs(), 8), base, other_image, other_text)
    assert hf_greedy(hf, base.hf_inputs(), 8)[0] == tokens == hf_generate(hf, base.hf_inputs(), 8)
    return case


def _step(row: int, prompt: Prompt, rows, embeds, lo: int = 0, hi: int | None = None, **kw):
    """Tokens [lo, hi) of `prompt` as one extend step, with the media embedding rows inside that range."""
    from tests.models.paged_driver import Step

    hi = len(prompt) if hi is None else hi
    if rows is None:
        return Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), **kw)
    sel = (rows >= lo) & (rows < hi)
    return Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), rows[sel] - lo if sel.any() else None,
                embeds[sel] if sel.any() else None, **kw)


def check_prefill(case: Case, prompt: Prompt, page_size: int = 1) -> None:
    from tests.models.paged_driver import PagedKV, make_batch

    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    with torch.inference_mode():
        ours = case.ours(make_batch(kv, [_step(kv.new_request(), prompt, rows, embeds, all_logits=True)]), kv.pool)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def check_decode(case: Case, prompt: Prompt, page_size: int, num_new: int = 8) -> None:
    from tests.models.paged_driver import PagedKV, decode_greedy, make_batch

    ref_tokens, margin = hf_greedy(case.hf, prompt.hf_inputs(), num_new)
    assert margin > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    with torch.inference_mode():
        logits = case.ours(make_batch(kv, [_step(row, prompt, rows, embeds)]), kv.pool)[-1:]
    assert decode_greedy(case.ours, kv, [row], logits, num_new) == [ref_tokens]


def check_batch(case: Case, prompts: list[Prompt], num_new: int = 6) -> None:
    """Prompts of different lengths prefilled in one forward, then decoded together."""
    from tests.models.paged_driver import PagedKV, decode_greedy, make_batch

    refs = [hf_greedy(case.hf, p.hf_inputs(), num_new) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=4)
    req_rows = [kv.new_request() for _ in prompts]
    with torch.inference_mode():
        steps = [_step(r, p, *prompt_mm_embeds(case.ours, p)) for r, p in zip(req_rows, prompts)]
        logits = case.ours(make_batch(kv, steps), kv.pool)
        for p, lo in zip(prompts, logits):
            torch.testing.assert_close(lo, hf_logits(case.hf, p)[-1], atol=ATOL, rtol=0)
    assert decode_greedy(case.ours, kv, req_rows, logits, num_new) == [t for t, _ in refs]


def check_chunked_prefill(case: Case, prompt: Prompt, chunk: int, page_size: int) -> None:
    """The prompt in chunks of `chunk` tokens (smaller than an image: boundaries fall inside image spans)."""
    from tests.models.paged_driver import PagedKV, make_batch

    assert any(e - s > chunk for it in prompt.items for s, e in it.offsets), "the chunk must be smaller than an image"
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    out = []
    with torch.inference_mode():
        for c in range(0, len(prompt), chunk):
            step = _step(row, prompt, rows, embeds, c, min(c + chunk, len(prompt)), all_logits=True)
            out.append(case.ours(make_batch(kv, [step]), kv.pool))
    torch.testing.assert_close(torch.cat(out), hf_logits(case.hf, prompt), atol=ATOL, rtol=0)


def check_prefix_cache_hit(case: Case, a: Prompt, b: Prompt, shared: int, page_size: int, num_new: int = 4) -> None:
    """B shares A's first `shared` tokens (the repeated image, or a page-aligned cut inside it): B reuses A's KV
    slots for them, extends only the rest, and both then decode in one batch."""
    from tests.models.paged_driver import (
        PagedKV,
        decode_greedy,
        make_batch,
        share_prefix,
    )

    assert torch.equal(a.input_ids[:shared], b.input_ids[:shared]) and not torch.equal(a.input_ids, b.input_ids)
    refs = [hf_greedy(case.hf, p.hf_inputs(), num_new) for p in (a, b)]
    assert min(m for _, m in refs) > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        la = case.ours(make_batch(kv, [_step(ra, a, *prompt_mm_embeds(case.ours, a))]), kv.pool)[-1]
        share_prefix(kv, ra, rb, shared)
        lb_all = case.ours(make_batch(kv, [_step(rb, b, *prompt_mm_embeds(case.ours, b), shared, all_logits=True)]),
                           kv.pool)
        torch.testing.assert_close(lb_all, hf_logits(case.hf, b)[shared:], atol=ATOL, rtol=0)
    assert decode_greedy(case.ours, kv, [ra, rb], [la, lb_all[-1]], num_new) == [t for t, _ in refs]


def check_image_features(case: Case, prompt: Prompt) -> None:
    """Our per-image embeddings equal HF's get_image_features, all images in one tower call."""
    calls = []
    tower = case.ours.vision_tower
    original = tower.forward
    tower.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.inference_mode():
            ours = case.ours.get_image_feature(prompt.items)
            inputs = prompt.hf_inputs()
            extra = {"image_sizes": inputs["image_sizes"]} if prompt.is_next else {}
            ref = case.hf.model.get_image_features(inputs["pixel_values"], **extra).pooler_output
    finally:
        del tower.forward
    assert len(calls) == 1, "all images of a step go through the vision tower in one call"
    assert [o.shape[0] for o in ours] == [it.num_tokens for it in prompt.items]
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)
