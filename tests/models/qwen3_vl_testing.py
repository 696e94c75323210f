"""Test helpers for Qwen3-VL: tiny random checkpoints that can fail, prompts with per-frame video spans, HF
references.

Two entry points build checkpoints:
- `build_tiny_qwen3_vl(path, spec)`: weights + config only, token ids 120..123 in a 128-token vocab (the
  model parity tests, which feed pixel rows directly);
- `make_tiny_qwen3_vl_checkpoint(path, ...)`: a complete checkpoint directory (weights, config with
  architectures=["Qwen3VLForConditionalGeneration"], the demo-vl tokenizer, a chat template and a
  Qwen3VLProcessor that `AutoProcessor.from_pretrained` loads), for processor, engine and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): norm weights (RMSNorm, qk-norm, the vision
LayerNorms) and biases are random; the main merger and every DeepStack merger are rescaled so their outputs
are text-sized (a dropped DeepStack level then moves the logits by far more than the tolerance).

The prompt, HF's positions and the parity suite's case it shares with Qwen2-VL and Qwen2.5-VL are in
mrope_vlm_testing.py; its FIXTURE is the parity suite's row.
Other test directories import it as `tests.models.qwen3_vl_testing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tests.models.family_parity import Chunked, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.mrope_vlm_testing import PREFIX, PREFIX_CUTS, MRopeCase, MRopePrompt, mm_types

VOCAB, IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 128, 120, 121, 122, 123
PATCH, MERGE, TEMPORAL_PATCH = 16, 2, 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # Qwen3 sets it apart from hidden // heads
    tie: bool
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    deepstack: tuple[int, ...]  # deepstack_visual_indexes
    num_position_embeddings: int  # a square: the learned grid interpolated to each image
    seed: int
    # Qwen3-VL-MoE's text_config fields (num_experts, moe_intermediate_size, ...; qwen3_vl_moe_testing.py); a
    # spec with them builds Qwen3VLMoeForConditionalGeneration.
    moe: tuple[tuple[str, Any], ...] = ()


SPECS = {
    "gqa": TinySpec("gqa", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, tie=False, mrope_section=(2, 3, 3),
                    vision_hidden=32, vision_depth=3, vision_heads=2, deepstack=(0, 2), num_position_embeddings=36,
                    seed=0),
    "mha_tied": TinySpec("mha_tied", hidden=48, layers=2, heads=4, kv_heads=4, head_dim=20, tie=True,
                         mrope_section=(4, 3, 3), vision_hidden=24, vision_depth=2, vision_heads=2, deepstack=(1,),
                         num_position_embeddings=16, seed=1),
}


def _text_config(spec: TinySpec, vocab_size: int, **extra) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, rms_norm_eps=1e-6, max_position_embeddings=1024,
        # Much wider than HF's 0.02: top logits stay apart and greedy continuations vary.
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section),
                         "mrope_interleaved": True},
        **extra,
    )


def _vision_config(spec: TinySpec) -> dict:
    return dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads, out_hidden_size=spec.hidden, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH, in_channels=3, num_position_embeddings=spec.num_position_embeddings,
        deepstack_visual_indexes=list(spec.deepstack), initializer_range=0.1,
    )


def hf_class(spec: TinySpec) -> type:
    """transformers' Qwen3VLForConditionalGeneration, or its MoE sibling for a spec with MoE fields."""
    import transformers

    return getattr(transformers, "Qwen3VLMoeForConditionalGeneration" if spec.moe else "Qwen3VLForConditionalGeneration")


def tiny_qwen3_vl_config(spec: TinySpec, vocab_size: int = VOCAB, token_ids: dict[str, int] | None = None,
                         architecture: str | None = None, **text_extra):
    """Qwen3-VL's config (its MoE sibling's for a spec with MoE fields), or the config class of another architecture
    that is Qwen3-VL (Cosmos3-Nano's)."""
    import transformers

    architecture = architecture or hf_class(spec).__name__
    ids = token_ids or {"image": IMAGE_ID, "video": VIDEO_ID, "start": VSTART_ID, "end": VEND_ID}
    text_extra = {**(text_extra or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)), **dict(spec.moe)}
    config_cls = getattr(transformers, architecture.replace("ForConditionalGeneration", "Config"))
    return config_cls(text_config=_text_config(spec, vocab_size, **text_extra), vision_config=_vision_config(spec),
                      image_token_id=ids["image"], video_token_id=ids["video"],
                      vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
                      tie_word_embeddings=spec.tie, architectures=[architecture])


def randomize_norms_and_biases_(hf: torch.nn.Module, g: torch.Generator) -> None:
    """In place: random norm weights (0.5..1.5: RMSNorm, qk-norm, LayerNorm) and biases (N(0, 0.1)) everywhere."""
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights and biases everywhere; the main merger's and each DeepStack merger's last
    projection rescaled to the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    randomize_norms_and_biases_(hf, g)
    with torch.no_grad():
        visual = hf.model.visual
        out = visual(torch.randn(8 * 8, PATCH_DIM, generator=g), grid_thw=torch.tensor([[1, 8, 8]]))
        text_rms = hf.get_input_embeddings().weight.pow(2).mean().sqrt()
        # Qwen3.5's tower has no DeepStack mergers.
        mergers = [visual.merger, *getattr(visual, "deepstack_merger_list", ())]
        levels = getattr(out, "deepstack_features", None) or ()
        for merger, feature in zip(mergers, [out.pooler_output, *levels], strict=True):
            scale = float(text_rms / feature.pow(2).mean().sqrt())
            merger.linear_fc2.weight.mul_(scale)
            merger.linear_fc2.bias.mul_(scale)


def build_tiny_qwen3_vl(path: str | Path, spec: TinySpec, attn_implementation: str = "eager",
                        architecture: str | None = None):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    import transformers

    hf_cls = getattr(transformers, architecture) if architecture else hf_class(spec)
    return save_random_model(path, hf_cls, tiny_qwen3_vl_config(spec, architecture=hf_cls.__name__), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

Prompt = MRopePrompt  # HF takes nothing besides the ids, types and grids


def build_prompt(spec: list, seed: int = 0, patch_dim: int = PATCH_DIM) -> Prompt:
    """spec parts: int n = n random text tokens (ids < 100); ("image", (1, h, w)) = <vision_start> pads
    <vision_end>; ("video", (t, h, w)) = Qwen3-VL's layout: <vision_start>, then per frame group a
    3-token stand-in for its timestamp text, <vision_start> pads <vision_end>, then <vision_end>.
    Same spec and seed -> same prompt."""
    ids: list[int] = []
    items = []

    def span(token: int, n: int) -> tuple[int, int]:
        ids.append(VSTART_ID)
        start = len(ids)
        ids.extend([token] * n + [VEND_ID])
        return start, start + n

    for (kind, (t, h, w)), g in media_parts(spec, seed, ids):
        per_frame = h * w // MERGE**2
        if kind == "image":
            offsets = [span(IMAGE_ID, t * per_frame)]
            msd = {"image_grid_thw": torch.tensor([[t, h, w]])}
        else:
            ids.append(VSTART_ID)
            offsets = []
            for _ in range(t):
                ids.extend(torch.randint(0, 100, (3,), generator=g).tolist())
                offsets.append(span(VIDEO_ID, per_frame))
            ids.append(VEND_ID)
            msd = {"video_grid_thw": torch.tensor([[t, h, w]])}
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE if kind == "image" else Modality.VIDEO, hash=len(items), offsets=offsets,
            feature=torch.randn(t * h * w, patch_dim, generator=g), model_specific_data=msd,
        ))
    return Prompt(torch.tensor(ids), mm_types(ids, IMAGE_ID, VIDEO_ID), items)


def our_positions(prompt: Prompt) -> tuple[torch.Tensor, int]:
    """Our M-RoPE positions ([3, L], delta), from the Qwen3-VL processor's own finalize."""
    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor

    mm = MultimodalInputs(items=list(prompt.items))
    Qwen3VLProcessor.compute_positions(prompt.input_ids.tolist(), mm, MERGE)
    return mm.mrope_positions, mm.mrope_position_delta


# ---------------------------------------------------------------- the parity suite's row

class Qwen3VLCase(MRopeCase):
    """An item's embedding rows are its main features followed by its DeepStack levels, level by level."""

    patch_dim: ClassVar[int] = PATCH_DIM  # values per pixel row

    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(parts, seed, self.patch_dim)

    def our_positions(self, prompt: Prompt) -> tuple[torch.Tensor, int]:
        return our_positions(prompt)

    def hf_item_features(self, output: Any) -> list[torch.Tensor]:
        deepstack = getattr(output, "deepstack_features", None) or ()  # Qwen3.5: none
        return [torch.cat([main, *levels], dim=-1) for main, *levels in zip(output.pooler_output, *deepstack)]


def logits_with_embeds(case: Qwen3VLCase, prompt: Prompt, embeds: torch.Tensor) -> torch.Tensor:
    """Our logits for the whole prompt with `embeds` in place of our media embedding rows."""
    from tests.models.paged_driver import PagedKV, make_batch

    kv = PagedKV(case.ours.lm_config)
    step = case.extend_step(kv.new_request(), prompt, all_logits=True)
    step.mm_embeds = embeds
    with torch.inference_mode():
        return case.ours(make_batch(kv, [step]), kv.pool)


PROMPTS = {
    "text": [12],
    "square_image": [5, ("image", (1, 8, 8)), 4],
    "nonsquare_image": [3, ("image", (1, 6, 14)), 2],
    "two_images": [3, ("image", (1, 8, 12)), 2, ("image", (1, 4, 6)), 3],
    "video": [4, ("video", (3, 4, 6)), 3],
    "image_and_video": [2, ("image", (1, 2, 2)), 1, ("video", (4, 4, 4)), 3],
}
DECODE_PROMPT = [3, ("image", (1, 8, 12)), 2, ("video", (2, 4, 6)), 4]


def hf_generate_masked(hf, inputs: dict, num_new: int) -> list[int]:
    """transformers' own greedy generate. The explicit attention mask matters: without it generate masks every
    prompt token equal to pad_token_id (random prompts hold id 0) and gives it position 0."""
    return hf_generate(hf, inputs, num_new, attention_mask=torch.ones_like(inputs["input_ids"]))


def load_case(name: str, path: Path, specs: dict[str, TinySpec] | None = None,
              architecture: str | None = None) -> Qwen3VLCase:
    """Beyond FamilyCase.check_fixture_can_fail (which checks every DeepStack level is text-sized): a dropped
    DeepStack level moves the logits far beyond the tolerance. `architecture`: HF's model, one that is Qwen3-VL."""
    from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from tests.models.family_parity import ATOL

    def build(path: Path, spec: TinySpec):
        return build_tiny_qwen3_vl(path, spec, architecture=architecture)

    case, config = Qwen3VLCase.load((specs or SPECS)[name], path, build, Qwen3VLForConditionalGeneration)
    spec, hf, ours = case.spec, case.hf, case.ours
    assert config.mrope_section == spec.mrope_section and config.head_dim == spec.head_dim
    assert ours.num_deepstack_levels == len(spec.deepstack)
    base = case.prompt(DECODE_PROMPT, seed=0)
    _, embeds = case.mm_embeds(base)
    no_deepstack = embeds.clone()
    no_deepstack[:, spec.hidden:] = 0
    assert (logits_with_embeds(case, base, no_deepstack) - logits_with_embeds(case, base, embeds)).abs().max() \
        > 100 * ATOL
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate_masked(hf, p.hf_inputs(), 8))
    return case


def check_embedding_width(case: Qwen3VLCase, monkeypatch) -> None:
    """Our encoders give rows of the declared width (main + DeepStack levels), and rows without the DeepStack
    levels are refused by name."""
    import pytest

    from tessera.models.mm_embed import EmbeddingCountError

    prompt = case.prompt(PROMPTS["square_image"], seed=1)
    _, embeds = case.mm_embeds(prompt)
    assert embeds.shape == (16, case.ours.mm_embed_width) and embeds.shape[1] > case.ours.config.hidden_size
    with pytest.raises(EmbeddingCountError, match="DeepStack"):
        logits_with_embeds(case, prompt, embeds[:, : case.ours.config.hidden_size])


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_qwen3_vl(path, SPECS[name]),
    bytes_spec="mha_tied", prompts=PROMPTS, text=Seeded([12], 8), decode=Seeded(DECODE_PROMPT, 3),
    decode_page_sizes=(4,), batch=(Seeded(PROMPTS["two_images"], 4), Seeded(PROMPTS["image_and_video"], 5)),
    # Chunks of 7 tokens; the image spans rows 6..29 and the video's frame groups 35..40 and 45..50, so chunk
    # boundaries fall inside the image and inside a frame group (DeepStack rows split across chunks).
    chunked=tuple(Chunked([5, ("image", (1, 8, 12)), 1, ("video", (2, 4, 6)), 4], 6, lambda spec: 7, page)
                  for page in (1, 4)),
    prefix=PREFIX, prefix_cuts=PREFIX_CUTS,
    tower=(Seeded([2, ("image", (1, 8, 12)), 1, ("image", (1, 6, 14)), 1, ("video", (2, 4, 6))], 2),),
    checks={"embedding_width": check_embedding_width},
)


# ---------------------------------------------------------------- full checkpoint directory

CHECKPOINT_SPEC = TinySpec("ckpt", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, tie=False,
                           mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=3, vision_heads=2,
                           deepstack=(0, 1), num_position_embeddings=36, seed=3)


def tiny_qwen3_vl_processor_and_config(spec: TinySpec = CHECKPOINT_SPEC, *, image_min_pixels: int = 64 * 64,
                                      image_max_pixels: int = 128 * 128, video_min_pixels: int = 32 * 32 * 2,
                                      video_max_pixels: int = 64 * 64 * 4) -> tuple[Any, Any]:
    """(transformers Qwen3VLProcessor over the demo-vl tokenizer, Qwen3VLConfig with its token ids): see
    make_tiny_qwen3_vl_checkpoint."""
    from transformers import AutoProcessor, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from tessera.config import ASSETS_DIR
    from tessera.demo.build_vl import CHAT_TEMPLATE

    tok = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl").tokenizer
    common = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE, image_mean=[0.5] * 3,
                  image_std=[0.5] * 3)
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": image_min_pixels, "longest_edge": image_max_pixels},
                                            **common)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels},
                                            do_sample_frames=False, **common)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                 chat_template=CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg = tiny_qwen3_vl_config(
        spec, vocab_size=(len(tok) + 63) // 64 * 64,
        token_ids={"image": ids["<|image_pad|>"], "video": ids["<|video_pad|>"], "start": ids["<|vision_start|>"],
                   "end": ids["<|vision_end|>"]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return processor, cfg


def make_tiny_qwen3_vl_checkpoint(
    path: str | Path, spec: TinySpec = CHECKPOINT_SPEC, *, image_min_pixels: int = 64 * 64,
    image_max_pixels: int = 128 * 128, video_min_pixels: int = 32 * 32 * 2, video_max_pixels: int = 64 * 64 * 4,
) -> Path:
    """Writes a complete random Qwen3-VL checkpoint to `path` (created if missing) and returns it.

    config.json (Qwen3VLConfig over the demo-vl tokenizer's vocabulary and its <|image_pad|>, <|video_pad|>,
    <|vision_start|>, <|vision_end|> ids; eos <|im_end|>), model.safetensors (deterministic), the tokenizer,
    the demo-vl chat template and a Qwen3VLProcessor (Qwen2VLImageProcessor and Qwen3VLVideoProcessor with
    patch 16, merge 2, mean/std 0.5, do_sample_frames=False) that `AutoProcessor.from_pretrained` loads.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processor, cfg = tiny_qwen3_vl_processor_and_config(spec, image_min_pixels=image_min_pixels,
                                                        image_max_pixels=image_max_pixels,
                                                        video_min_pixels=video_min_pixels,
                                                        video_max_pixels=video_max_pixels)
    processor.save_pretrained(path)
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    save_random_model(path, hf_class(spec), cfg, spec.seed,
                      lambda m: make_fixture_can_fail_(m, spec.seed), None, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Qwen3VLForConditionalGeneration (or Qwen3VLMoe..., as config.json says) from `path`, float32,
    eager attention, eval mode."""
    import json

    import transformers

    cls = getattr(transformers, json.loads((Path(path) / "config.json").read_text())["architectures"][0])
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
