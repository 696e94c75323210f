"""Test helpers for GLM-4.1V: tiny random checkpoints that can fail, prompts in GLM's layout, HF references.

Two entry points build checkpoints:
- `build_tiny_glm4v(path, spec)`: weights + config only, token ids 120..125 in a 128-token vocab (the model parity
  tests, which feed pixel rows directly);
- `make_tiny_glm4v_checkpoint(path)`: a complete checkpoint directory (weights, config with
  architectures=["Glm4vForConditionalGeneration"], the demo-vl tokenizer with GLM's media tokens added, a chat
  template in GLM's layout and a Glm4vProcessor that `AutoProcessor.from_pretrained` loads), for the processor
  and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): every RMSNorm / LayerNorm weight and every bias is
random; the merger's last projection is rescaled so image embeddings are text-sized. Sizes are odd on purpose:
partial rotary over 16 of 32 and 10 of 20 head dims, GQA and MHA, tied and untied embeddings.

transformers 5.24's Glm4vModel scatters image and video features at the same <|image|> token (a video's frames
are <|image|> runs too), so it refuses a prompt holding both: the prompts here hold one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tests.models.family_parity import Chunked, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import save_random_model
from tests.models.mrope_vlm_testing import PREFIX_CUTS, MRopeCase, MRopePrompt
from tests.models.qwen3_vl_testing import hf_generate_masked

VOCAB, IMAGE_ID, VIDEO_ID, BOI_ID, EOI_ID, BOV_ID, EOV_ID = 128, 120, 121, 122, 123, 124, 125
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]  # sums to hidden / heads * partial_rotary_factor / 2
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    image_size: int  # the learned position grid is (image_size / patch)^2, interpolated to each image
    seed: int
    # GLM-4.5V (glm4v_moe) when experts > 0: DeepSeek-style routing over `experts` in n_group groups, layers from
    # first_k_dense on sparse.
    experts: int = 0
    top_k: int = 2
    n_group: int = 2
    topk_group: int = 1
    first_k_dense: int = 1


SPECS = {
    "gqa": TinySpec("gqa", hidden=96, intermediate=136, layers=3, heads=3, kv_heads=1, tie=False,
                    partial_rotary_factor=0.5, mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=2,
                    vision_heads=2, image_size=84, seed=0),
    "mha_tied": TinySpec("mha_tied", hidden=80, intermediate=120, layers=2, heads=4, kv_heads=4, tie=True,
                         partial_rotary_factor=0.5, mrope_section=(1, 2, 2), vision_hidden=24, vision_depth=2,
                         vision_heads=2, image_size=56, seed=1),
}
MOE_SPECS = {
    "moe": TinySpec("moe", hidden=64, intermediate=88, layers=3, heads=2, kv_heads=1, tie=False,
                    partial_rotary_factor=0.5, mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=2,
                    vision_heads=2, image_size=84, seed=4, experts=8, top_k=3, n_group=2, topk_group=1,
                    first_k_dense=1),
}
ALL_SPECS = {**SPECS, **MOE_SPECS}


def tiny_glm4v_config(spec: TinySpec, vocab_size: int = VOCAB, token_ids: dict[str, int] | None = None,
                      **text_extra):
    from transformers import Glm4vConfig, Glm4vMoeConfig

    ids = token_ids or {"image": IMAGE_ID, "video": VIDEO_ID, "boi": BOI_ID, "eoi": EOI_ID, "bov": BOV_ID,
                        "eov": EOV_ID}
    text_extra = text_extra or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    text = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        rms_norm_eps=1e-5, max_position_embeddings=1024,
        # 7.5x HF's 0.02, so top logits stay apart and greedy continuations vary; not the 0.2 of other fixtures,
        # under which the tower's 1e-6 float noise grew past the 1e-4 tolerance (0.1: greedy repeats one token).
        initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section),
                         "partial_rotary_factor": spec.partial_rotary_factor},
        **text_extra)
    if spec.experts:
        text.update(n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k, n_group=spec.n_group,
                    topk_group=spec.topk_group, first_k_dense_replace=spec.first_k_dense, n_shared_experts=1,
                    moe_intermediate_size=spec.intermediate // 2 - 4, routed_scaling_factor=1.5, attention_bias=True)
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden + 6,
        num_heads=spec.vision_heads, out_hidden_size=spec.hidden, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH, image_size=spec.image_size, in_channels=3, initializer_range=0.1)
    config_cls, arch = ((Glm4vMoeConfig, "Glm4vMoeForConditionalGeneration") if spec.experts else
                        (Glm4vConfig, "Glm4vForConditionalGeneration"))
    return config_cls(text_config=text, vision_config=vision, image_token_id=ids["image"], video_token_id=ids["video"],
                      image_start_token_id=ids["boi"], image_end_token_id=ids["eoi"], video_start_token_id=ids["bov"],
                      video_end_token_id=ids["eov"], tie_word_embeddings=spec.tie, architectures=[arch])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)) everywhere, a random expert-choice bias
    (e_score_correction_bias, so it must be read); the merger's down projection rescaled to the text embeddings'
    RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv2d, torch.nn.Conv3d)) \
                    and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape,
                                                                       generator=g))
        visual = hf.model.visual
        out = visual(torch.randn(8 * 8, PATCH_DIM, generator=g), grid_thw=torch.tensor([[1, 8, 8]])).pooler_output
        text_rms = hf.get_input_embeddings().weight.pow(2).mean().sqrt()
        visual.merger.down_proj.weight.mul_(float(text_rms / out.pow(2).mean().sqrt()))


def hf_class(spec: TinySpec) -> type:
    import transformers

    return transformers.Glm4vMoeForConditionalGeneration if spec.experts else transformers.Glm4vForConditionalGeneration


def build_tiny_glm4v(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    return save_random_model(path, hf_class(spec), tiny_glm4v_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

def glm_mm_types(ids: list[int], image_id: int = IMAGE_ID, bov: int = BOV_ID, eov: int = EOV_ID) -> torch.Tensor:
    """mm_token_type_ids as Glm4vProcessor makes them: <|image|> tokens are 2 between <|begin_of_video|> and
    <|end_of_video|>, 1 elsewhere; everything else 0."""
    t = torch.tensor(ids)
    in_video = (t == bov).cumsum(0) > (t == eov).cumsum(0)
    return torch.where(t == image_id, torch.where(in_video, 2, 1), 0)


def build_prompt(parts: list, seed: int = 0) -> MRopePrompt:
    """parts: int n = n random text tokens (ids < 100); ("image", (1, h, w)) = <|begin_of_image|>, h*w/4
    <|image|>, <|end_of_image|>; ("video", (t, h, w)) = <|begin_of_video|>, then per frame <|begin_of_image|>,
    h*w/4 <|image|>, <|end_of_image|> and a random stand-in for its timestamp digits, then <|end_of_video|>.
    Same parts and seed -> same prompt."""
    ids: list[int] = []
    items = []

    def frame(n: int) -> tuple[int, int]:
        ids.append(BOI_ID)
        start = len(ids)
        ids.extend([IMAGE_ID] * n + [EOI_ID])
        return start, start + n

    for (kind, (t, h, w)), g in media_parts(parts, seed, ids):
        per_frame = h * w // MERGE**2
        if kind == "image":
            offsets = [frame(t * per_frame)]
            msd = {"image_grid_thw": torch.tensor([[t, h, w]])}
        else:
            ids.append(BOV_ID)
            offsets = []
            for _ in range(t):
                offsets.append(frame(per_frame))
                ids.append(int(torch.randint(0, 100, (1,), generator=g)))
            ids.append(EOV_ID)
            msd = {"video_grid_thw": torch.tensor([[t, h, w]])}
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE if kind == "image" else Modality.VIDEO, hash=len(items), offsets=offsets,
            feature=torch.randn(t * h * w, PATCH_DIM, generator=g), model_specific_data=msd))
    return MRopePrompt(torch.tensor(ids), glm_mm_types(ids), items)


class Glm4vCase(MRopeCase):
    def prompt(self, parts: list, seed: int = 0) -> MRopePrompt:
        return build_prompt(parts, seed)

    def our_positions(self, prompt: MRopePrompt) -> tuple[torch.Tensor, int]:
        """From the GLM-4V processor's own finalize."""
        from tessera.multimodal.processors.glm4v import Glm4vProcessor

        mm = MultimodalInputs(items=list(prompt.items))
        Glm4vProcessor.compute_positions(prompt.input_ids.tolist(), mm, MERGE)
        return mm.mrope_positions, mm.mrope_position_delta


PROMPTS = {
    "text": [12],
    "square_image": [5, ("image", (1, 8, 8)), 4],
    "wide_image": [3, ("image", (1, 4, 14)), 2],
    "tall_image": [2, ("image", (1, 12, 6)), 3],
    "two_images": [3, ("image", (1, 8, 12)), 2, ("image", (1, 4, 6)), 3],
    "video": [4, ("video", (3, 4, 6)), 3],
}
DECODE_PROMPT = [3, ("image", (1, 8, 12)), 2, ("image", (1, 6, 4)), 4]


def load_case(name: str, path: Path) -> Glm4vCase:
    from tessera.models import glm4v

    spec = ALL_SPECS[name]
    model_cls = glm4v.Glm4vMoeForConditionalGeneration if spec.experts else glm4v.Glm4vForConditionalGeneration
    case, config = Glm4vCase.load(spec, path, build_tiny_glm4v, model_cls)
    assert config.mrope_section == spec.mrope_section and config.head_dim == spec.hidden // spec.heads
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate_masked(case.hf, p.hf_inputs(), 8))
    return case


def check_video_depends_on_frame_order(case: Glm4vCase, monkeypatch) -> None:
    """A video's frames are encoded one (1, h, w) grid each, in order: swapping two frames' pixels moves the
    logits (HF's too, and ours stay equal to HF's)."""
    from tests.models.family_parity import ATOL, our_logits

    prompt = case.prompt(PROMPTS["video"], seed=1)
    swapped = case.prompt(PROMPTS["video"], seed=1)
    item = swapped.items[0]
    t, h, w = item.model_specific_data["video_grid_thw"].view(3).tolist()
    frames = item.feature.view(t, h * w, -1)
    item.feature = frames[[1, 0, *range(2, t)]].reshape(t * h * w, -1).clone()
    ref, ref_swapped = case.hf_logits(prompt), case.hf_logits(swapped)
    assert (ref - ref_swapped).abs().max() > 100 * ATOL
    torch.testing.assert_close(our_logits(case, swapped), ref_swapped, atol=ATOL, rtol=0)


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_glm4v(path, ALL_SPECS[name]),
    bytes_spec="mha_tied", prompts=PROMPTS, text=Seeded([12], 8), decode=Seeded(DECODE_PROMPT, 3),
    decode_page_sizes=(4,), batch=(Seeded(PROMPTS["two_images"], 4), Seeded(PROMPTS["video"], 5),
                                   Seeded([9], 6)),
    # Chunks of 7 tokens: boundaries fall inside the image (rows 6..30) and inside the video's frames.
    chunked=(Chunked([5, ("image", (1, 8, 12)), 1], 6, lambda spec: 7, 1),
             Chunked([2, ("video", (2, 4, 6)), 4], 6, lambda spec: 7, 4)),
    prefix=Seeded([4, ("image", (1, 8, 8)), 6], 7), prefix_cuts=PREFIX_CUTS,
    tower=(Seeded([2, ("image", (1, 8, 12)), 1, ("image", (1, 6, 14))], 2), Seeded([1, ("video", (2, 4, 6))], 3)),
    checks={"video_frame_order": check_video_depends_on_frame_order},
)
MOE_FIXTURE = replace(FIXTURE, specs=tuple(MOE_SPECS), bytes_spec="moe", checks={})


# ---------------------------------------------------------------- full checkpoint directory

CHECKPOINT_SPEC = TinySpec("ckpt", hidden=64, intermediate=104, layers=2, heads=2, kv_heads=1, tie=False,
                           partial_rotary_factor=0.5, mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=2,
                           vision_heads=2, image_size=84, seed=3)
MEDIA_TOKENS = ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                "<|end_of_video|>")
CHAT_TEMPLATE_MEDIA = (
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "<|begin_of_video|><|video|><|end_of_video|>{% endif %}")


def tiny_glm4v_processor_and_config(spec: TinySpec = CHECKPOINT_SPEC, *, image_min_pixels: int = 56 * 56,
                                    image_max_pixels: int = 112 * 112, video_min_pixels: int = 28 * 28 * 2,
                                    video_max_pixels: int = 56 * 56 * 4) -> tuple[Any, Any]:
    """(transformers' Glm4vProcessor over the demo-vl tokenizer with GLM's six media tokens added, the demo-vl
    chat template with GLM's media layout; Glm4vConfig with those tokens' ids)."""
    from transformers import AutoProcessor, Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    from tessera.config import ASSETS_DIR
    from tessera.demo.build_vl import media_first_chat_template

    tok = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl").tokenizer
    tok.add_special_tokens({"additional_special_tokens": list(MEDIA_TOKENS)})
    tok.image_token, tok.video_token = "<|image|>", "<|video|>"  # Glm4vProcessor takes the tokenizer's names
    common = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE)
    image_processor = Glm4vImageProcessor(size={"shortest_edge": image_min_pixels, "longest_edge": image_max_pixels},
                                          **common)
    video_processor = Glm4vVideoProcessor(size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels},
                                          do_sample_frames=False, **common)
    processor = Glm4vProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                               chat_template=media_first_chat_template(CHAT_TEMPLATE_MEDIA))
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", *MEDIA_TOKENS)}
    cfg = tiny_glm4v_config(
        spec, vocab_size=(len(tok) + 63) // 64 * 64,
        token_ids={"image": ids["<|image|>"], "video": ids["<|video|>"], "boi": ids["<|begin_of_image|>"],
                   "eoi": ids["<|end_of_image|>"], "bov": ids["<|begin_of_video|>"], "eov": ids["<|end_of_video|>"]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return processor, cfg


def make_tiny_glm4v_checkpoint(path: str | Path, spec: TinySpec = CHECKPOINT_SPEC, **sizes: int) -> Path:
    """Writes a complete random GLM-4.1V checkpoint to `path` (created if missing) and returns it: config.json,
    model.safetensors (deterministic), the tokenizer, chat template and processor of
    `tiny_glm4v_processor_and_config(**sizes)`, which `AutoProcessor.from_pretrained` loads."""
    from transformers import Glm4vForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processor, cfg = tiny_glm4v_processor_and_config(spec, **sizes)
    processor.save_pretrained(path)
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    save_random_model(path, Glm4vForConditionalGeneration, cfg, spec.seed,
                      lambda m: make_fixture_can_fail_(m, spec.seed), None, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Glm4vForConditionalGeneration from `path`, float32, eager attention, eval mode."""
    from transformers import Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
