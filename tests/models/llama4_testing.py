"""Test helpers for Llama-4: tiny random checkpoints that can fail, prompts laid out as HF's processor lays them,
HF references.

`build_tiny_llama4(path, spec)` saves weights + config (vocabulary of 128, the image tokens at 120..125) for the
model parity tests, which feed pixel tiles directly; `make_tiny_llama4_checkpoint(path)` writes a complete
checkpoint directory (tokenizer with Llama-4's image tokens, Llama4ImageProcessor + Llama4Processor, a chat
template) for processor and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): RMSNorm and LayerNorm weights/biases are random, the
projector is rescaled so image embeddings are text-sized, and the specs use a tiny attention_chunk_size (prompts
cross several chunk boundaries), a small floor_scale (temperature tuning changes q within a prompt), MoE and dense
layers, RoPE and NoPE layers.

transformers 5.24 quirks met here: Llama4ForConditionalGeneration.forward raises AttributeError (it reads
`outputs.image_outputs`, which the language model's output lacks), so `patch_hf_forward()` gives that output
class an `image_outputs = None` default; the vision config needs intermediate_size = hidden_size /
pixel_shuffle_ratio^2 and projector_input_dim == projector_output_dim == vision_output_dim; the image processor
returns bfloat16 pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import ATOL, Chunked, FamilyCase, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import grown_mask, hf_generate, save_random_model

VOCAB = 128
IMAGE_START, IMAGE_END, IMAGE_MARK, PATCH_ID, TILE_X, TILE_Y = 120, 121, 122, 123, 124, 125


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    no_rope_layers: tuple[int, ...]  # 1 = RoPE layer, 0 = NoPE
    moe_layers: tuple[int, ...] | None  # None: from interleave_moe_layer_step
    interleave_moe_layer_step: int
    attention_chunk_size: int | None
    use_qk_norm: bool
    floor_scale: int
    attn_scale: float
    tie: bool
    vision_hidden: int
    vision_layers: int
    image_size: int
    patch: int
    seed: int

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch) ** 2 // 4  # pixel_shuffle_ratio 0.5


SPECS = {
    "gqa_chunked": TinySpec("gqa_chunked", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, num_experts=4,
                            top_k=2, no_rope_layers=(1, 1, 0, 1), moe_layers=None, interleave_moe_layer_step=2,
                            attention_chunk_size=8, use_qk_norm=True, floor_scale=4, attn_scale=0.5, tie=False,
                            vision_hidden=32, vision_layers=2, image_size=28, patch=7, seed=1),
    "mha_tied": TinySpec("mha_tied", hidden=48, layers=3, heads=4, kv_heads=4, head_dim=12, num_experts=3,
                         top_k=1, no_rope_layers=(0, 1, 1), moe_layers=(0, 2), interleave_moe_layer_step=1,
                         attention_chunk_size=7, use_qk_norm=False, floor_scale=3, attn_scale=0.3, tie=True,
                         vision_hidden=32, vision_layers=1, image_size=28, patch=7, seed=2),
}


def tiny_llama4_config(spec: TinySpec, vocab_size: int = VOCAB, image_token_id: int = PATCH_ID,
                       boi: int = IMAGE_START, eoi: int = IMAGE_END, **text_extra: Any):
    from transformers import Llama4Config

    text = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        intermediate_size_mlp=3 * spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, no_rope_layers=list(spec.no_rope_layers),
        moe_layers=None if spec.moe_layers is None else list(spec.moe_layers),
        interleave_moe_layer_step=spec.interleave_moe_layer_step, attention_chunk_size=spec.attention_chunk_size,
        use_qk_norm=spec.use_qk_norm, attn_temperature_tuning=True, floor_scale=spec.floor_scale,
        attn_scale=spec.attn_scale, rms_norm_eps=1e-5, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        initializer_range=0.2, tie_word_embeddings=spec.tie, **text_extra,
    )
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=2, image_size=spec.image_size,
                  patch_size=spec.patch, pixel_shuffle_ratio=0.5, projector_input_dim=spec.vision_hidden,
                  projector_output_dim=spec.vision_hidden, vision_output_dim=spec.vision_hidden,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    return Llama4Config(text_config=text, vision_config=vision, image_token_index=image_token_id,
                        boi_token_index=boi, eoi_token_index=eoi, tie_word_embeddings=spec.tie,
                        architectures=["Llama4ForConditionalGeneration"])


def patch_hf_forward() -> None:
    """transformers 5.24's Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` from the language
    model's MoeCausalLMOutputWithPast, which has no such field: give it a None default (idempotent)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    if not hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
        MoeCausalLMOutputWithPast.image_outputs = None  # type: ignore[attr-defined]


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: RMSNorm weights 0.5..1.5, LayerNorm weights 0.5..1.5 and biases N(0, 0.1), the untied head wider,
    the projector scaled so image embeddings have the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        if not hf.config.tie_word_embeddings:
            hf.get_output_embeddings().weight.normal_(0.0, 0.5, generator=g)
        size = hf.config.vision_config.image_size
        probe = torch.randn(2, 3, size, size, generator=g)
        proj = hf.multi_modal_projector.linear_1.weight
        image = hf.multi_modal_projector(hf.vision_model(probe).last_hidden_state)
        text = hf.get_input_embeddings()(torch.arange(min(120, hf.config.text_config.vocab_size)))
        proj.mul_(float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt()))


def build_tiny_llama4(path: str | Path, spec: TinySpec):
    """The HF reference model (eval mode, eager attention), also saved to `path` (config + safetensors)."""
    from transformers import Llama4ForConditionalGeneration

    patch_hf_forward()
    return save_random_model(path, Llama4ForConditionalGeneration, tiny_llama4_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed))


# ---------------------------------------------------------------- prompts

@dataclass
class Prompt:
    input_ids: torch.Tensor  # [L]
    items: list[MultimodalDataItem] = field(default_factory=list)

    def pixels(self) -> torch.Tensor | None:
        p = [it.feature for it in self.items]
        return torch.cat(p) if p else None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def image_token_layout(grid: tuple[int, int], tokens_per_tile: int) -> tuple[list[int], list[tuple[int, int]]]:
    """HF Llama4Processor._prompt_split_image for a (rows, cols) tile grid, as ids, and the patch runs' offsets
    relative to its start: tiles row by row (x separators between columns, a y separator after each row) when
    there is more than one tile, then <|image|> and the global image's patches."""
    ids = [IMAGE_START]
    runs = []
    rows, cols = grid
    if rows * cols > 1:
        for _ in range(rows):
            for x in range(cols):
                runs.append((len(ids), len(ids) + tokens_per_tile))
                ids += [PATCH_ID] * tokens_per_tile
                if x < cols - 1:
                    ids.append(TILE_X)
            ids.append(TILE_Y)
    ids.append(IMAGE_MARK)
    runs.append((len(ids), len(ids) + tokens_per_tile))
    ids += [PATCH_ID] * tokens_per_tile + [IMAGE_END]
    return ids, runs


def build_prompt(parts: list, spec: TinySpec, seed: int = 0) -> Prompt:
    """parts: int n = n random text tokens (ids < 120); ("image", rows, cols) = an image of that tile grid (plus
    the global image when rows * cols > 1) with random pixels. Same parts and seed -> same prompt."""
    ids: list[int] = []
    items = []
    for (_, rows, cols), g in media_parts(parts, seed, ids, text_below=120):
        layout, runs = image_token_layout((rows, cols), spec.tokens_per_tile)
        base = len(ids)
        ids += layout
        num_tiles = rows * cols + (1 if rows * cols > 1 else 0)
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE, hash=len(items), offsets=[(base + s, base + e) for s, e in runs],
            feature=torch.randn(num_tiles, 3, spec.image_size, spec.image_size, generator=g),
            model_specific_data={"aspect_ratio": torch.tensor([rows, cols])},
        ))
    return Prompt(torch.tensor(ids), items)


# ---------------------------------------------------------------- the parity suite's row

def hf_inputs(prompt: Prompt) -> dict:
    inputs = dict(input_ids=prompt.input_ids[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                  pixel_values=prompt.pixels())
    return {k: v for k, v in inputs.items() if v is not None}


def hf_greedy_no_cache(hf, prompt: Prompt, num_new: int) -> list[int]:
    """Greedy tokens recomputing the whole sequence each step (no KV cache): checks HF's chunked cache."""
    ids = prompt.input_ids[None]
    pixels = prompt.pixels()
    tokens = []
    with torch.inference_mode():
        for _ in range(num_new):
            kw = {} if pixels is None else {"pixel_values": pixels}
            tok = int(hf(input_ids=ids, use_cache=False, **kw).logits[0, -1].argmax())
            tokens.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens


class Llama4Case(FamilyCase):
    """Plain 1-D positions and causal chunks: the chunked attention and NoPE live in the model, not the steps."""

    tower_attr = "vision_model"

    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(parts, self.spec, seed=seed)

    def hf_inputs(self, prompt: Prompt) -> dict:
        return hf_inputs(prompt)

    def hf_step_kwargs(self, prompt: Prompt, inputs: dict, step: int) -> dict:
        return grown_mask(inputs, step)

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        hf = self.hf
        ref = hf.multi_modal_projector(hf.vision_model(torch.cat([it.feature for it in items])).last_hidden_state)
        return [ref.reshape(-1, ref.shape[-1])]

    def text_rms(self, prompt: Prompt) -> torch.Tensor:
        return self.ours.model.embed_tokens(torch.arange(120)).pow(2).mean().sqrt()  # the text ids only


PROMPTS = {
    "text": [19],
    "one_tile": [9, ("image", 1, 1), 8],
    "wide": [3, ("image", 1, 3), 2],
    "tall_grid": [2, ("image", 2, 2), 3],
    "two_images": [3, ("image", 2, 1), 2, ("image", 1, 1), 3],
}
DECODE_PROMPT = [3, ("image", 1, 2), 4]


def load_case(name: str, path: Path) -> Llama4Case:
    """The fixture must be able to fail (FamilyCase.check_fixture_can_fail), and HF's chunked KV cache agrees
    with recomputing everything."""
    from tessera.models.llama4 import Llama4ForConditionalGeneration

    case, _ = Llama4Case.load(SPECS[name], path, build_tiny_llama4, Llama4ForConditionalGeneration)
    spec, hf, ours = case.spec, case.hf, case.ours
    settings = ours.model.settings
    assert settings.use_rope == tuple(bool(x) for x in spec.no_rope_layers)
    assert settings.is_moe == tuple(i in hf.config.text_config.moe_layers for i in range(spec.layers))
    assert any(settings.is_moe) and not all(settings.is_moe) and not all(settings.use_rope)
    tokens = case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, hf_inputs(p), 8))
    assert tokens == hf_greedy_no_cache(hf, case.prompt(DECODE_PROMPT, seed=0), 8)
    return case


def check_prompts_cross_chunk_boundaries(case: Llama4Case, monkeypatch) -> None:
    """Every prefill prompt spans more than two attention chunks, and the decode steps start a new one."""
    chunk = case.spec.attention_chunk_size
    assert all(len(case.prompt(parts, seed=1)) > 2 * chunk for parts in PROMPTS.values())
    n, num_new = len(case.build(case.row.decode)), case.row.decode_new
    # The decode steps feed positions n .. n + num_new - 2: one of them must start a new chunk.
    assert any(p % chunk == 0 for p in range(n, n + num_new - 1)), "no chunk boundary crossed"


def check_chunked_attention_and_nope_matter(case: Llama4Case, monkeypatch) -> None:
    """The fixture exercises what it claims: without the chunk masks, or with RoPE on the NoPE layers, or without
    temperature tuning, the logits move well past the tolerance."""
    import tessera.layers.llama4_decoder as dec
    from tests.models.family_parity import our_logits

    prompt = case.prompt(PROMPTS["one_tile"], seed=1)
    ref = case.hf_logits(prompt)
    monkeypatch.setattr(dec, "chunk_masks", lambda fb, chunk: None)
    assert (our_logits(case, prompt) - ref).abs().max() > 100 * ATOL, "chunked attention makes no difference"
    monkeypatch.undo()
    nope = [layer.self_attn for layer in case.ours.model.layers if not layer.self_attn.use_rope]
    saved = [a.temperature for a in nope]
    try:
        for a in nope:
            a.temperature = None
        assert (our_logits(case, prompt) - ref).abs().max() > 100 * ATOL, "temperature tuning makes no difference"
        for a, t in zip(nope, saved):
            a.temperature, a.use_rope = t, True
        assert (our_logits(case, prompt) - ref).abs().max() > 100 * ATOL, "NoPE makes no difference"
    finally:
        for a, t in zip(nope, saved):
            a.temperature, a.use_rope = t, False
    torch.testing.assert_close(our_logits(case, prompt), ref, atol=ATOL, rtol=0)


def _prefix_shared(case: Llama4Case, a: Prompt, page_size: int = 4) -> int:
    """B reuses A's KV up to its last page before the difference, the image included."""
    shared = (len(a) - 6) // page_size * page_size
    assert shared >= a.items[0].offsets[-1][1]
    return shared


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_llama4(path, SPECS[name]),
    prompts=PROMPTS, text=Seeded([21], 9), decode=Seeded(DECODE_PROMPT, 0), decode_new=8, decode_page_sizes=(4,),
    # A prompt with two images and a short text-only one inside the first attention chunk (no chunk mask),
    # decoded together until the short one crosses its first chunk boundary too.
    batch=(Seeded(PROMPTS["two_images"], 11), Seeded(lambda spec: [spec.attention_chunk_size - 3], 5)),
    # Prefill chunks smaller than one image (a tile's patch run is split), unaligned with the attention chunks.
    chunked=tuple(Chunked([4, ("image", 2, 1), 3, ("image", 1, 1), 4], 6, lambda spec, s=step: s, page)
                  for page, step in ((1, 3), (4, 5))),
    prefix=Seeded([3, ("image", 1, 2), 8], 8), prefix_cuts={"page4": (4, _prefix_shared)},
    tower=(Seeded([2, ("image", 2, 2), 1, ("image", 1, 1)], 2),),
    checks={"prompts_cross_chunk_boundaries": check_prompts_cross_chunk_boundaries,
            "chunked_attention_and_nope_matter": check_chunked_attention_and_nope_matter},
)


# ---------------------------------------------------------------- full checkpoint directory

IMAGE_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>")
# A short Llama-4-style template: `<|image|>` for each image part, in place.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tiny_llama4_checkpoint(path: str | Path, spec: TinySpec | None = None, *, seed: int = 0,
                                max_patches: int = 4) -> Path:
    """Writes a complete random Llama-4 checkpoint to `path` and returns it: demo-vl's tokenizer with Llama-4's
    image tokens, a Llama4Processor (patch_size and pixel_shuffle_ratio of the vision config) over a
    Llama4ImageProcessor with tiles of the tower's image_size and at most `max_patches` tiles, a chat template,
    and config + model.safetensors from `spec` (default SPECS["gqa_chunked"]) made to be able to fail."""
    from transformers import (
        AutoTokenizer,
        Llama4ForConditionalGeneration,
        Llama4ImageProcessor,
        Llama4Processor,
    )

    from tessera.config import ASSETS_DIR

    spec = spec or SPECS["gqa_chunked"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl")
    tok.add_special_tokens({"extra_special_tokens": list(IMAGE_TOKENS)})
    image_processor = Llama4ImageProcessor(size={"height": spec.image_size, "width": spec.image_size},
                                           max_patches=max_patches)
    processor = Llama4Processor(image_processor=image_processor, tokenizer=tok, patch_size=spec.patch,
                                pixel_shuffle_ratio=0.5, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = tiny_llama4_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, image_token_id=ids["<|patch|>"],
                             boi=ids["<|image_start|>"], eoi=ids["<|image_end|>"], eos_token_id=eos,
                             pad_token_id=pad, bos_token_id=None)
    patch_hf_forward()
    save_random_model(path, Llama4ForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      eos=eos, pad=pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Llama4ForConditionalGeneration from `path`, float32, eager attention, eval mode (with the
    5.24 forward patched)."""
    from transformers import Llama4ForConditionalGeneration

    patch_hf_forward()
    return Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
