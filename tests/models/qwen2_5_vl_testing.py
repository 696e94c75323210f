"""Test helpers for Qwen2.5-VL: tiny random checkpoints that can fail, prompts, positions, HF references.

Two entry points build checkpoints:
- `build_tiny_qwen2_5_vl(path, spec)`: weights + config only, token ids 120..123 in a 128-token vocab (the
  model parity tests, which feed pixel rows directly);
- `make_tiny_qwen2_5_vl_checkpoint(path, ...)`: a complete checkpoint directory (weights, config with
  architectures=["Qwen2_5_VLForConditionalGeneration"], the demo-vl tokenizer, a chat template and a
  Qwen2_5_VLProcessor that `AutoProcessor.from_pretrained` loads), for processor, engine and server tests.

Both make fixtures that can fail (see shared/design/FAMILY-FIXTURES.md): norm weights and biases are random
(HF starts them at 1 and 0), and the vision merger's output is rescaled so image embeddings are text-sized.

The prompt, HF's positions and the parity suite's case it shares with Qwen2-VL and Qwen3-VL are in
mrope_vlm_testing.py; its FIXTURE is the parity suite's row.
Other test directories import it as `tests.models.qwen2_5_vl_testing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalInputs
from tests.models.family_parity import Chunked, FamilyFixture, Seeded
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.mrope_vlm_testing import PREFIX, PREFIX_CUTS, MRopeCase, MRopePrompt, build_span_prompt

VOCAB, IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 128, 120, 121, 122, 123
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH
TOKENS_PER_SECOND = 2


@dataclass(frozen=True)
class TinySpec:
    """A tiny Qwen2.5-VL. `window` is the attention window in merged tokens per side
    (vision window_size = window * patch_size * spatial_merge_size pixels)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    fullatt_block_indexes: tuple[int, ...]  # some, not all, vision blocks attend globally
    window: int
    seed: int


SPECS = {
    "gqa": TinySpec("gqa", hidden=64, layers=2, heads=4, kv_heads=2, tie=False, mrope_section=(2, 3, 3),
                    vision_hidden=32, vision_depth=4, vision_heads=2, fullatt_block_indexes=(1, 3), window=2, seed=0),
    "mha_tied": TinySpec("mha_tied", hidden=48, layers=3, heads=4, kv_heads=4, tie=True, mrope_section=(2, 2, 2),
                         vision_hidden=24, vision_depth=3, vision_heads=2, fullatt_block_indexes=(2,), window=3,
                         seed=1),
}


def _text_config(hidden: int, layers: int, heads: int, kv_heads: int, mrope_section, vocab_size: int, **extra) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6, max_position_embeddings=1024,
        # Much wider than HF's 0.02: top logits stay apart (greedy decode is not decided by float noise) and
        # greedy continuations vary instead of repeating one token.
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)},
        **extra,
    )


def _vision_config(hidden: int, out_hidden: int, depth: int, heads: int, fullatt, window: int,
                   tokens_per_second: int) -> dict:
    return dict(
        depth=depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=heads, out_hidden_size=out_hidden,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, in_channels=3,
        window_size=window * PATCH * MERGE, fullatt_block_indexes=list(fullatt),
        tokens_per_second=tokens_per_second, initializer_range=0.1,
    )


def tiny_qwen2_5_vl_config(spec: TinySpec):
    from transformers import Qwen2_5_VLConfig

    text = _text_config(spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.mrope_section, VOCAB,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = _vision_config(spec.vision_hidden, spec.hidden, spec.vision_depth, spec.vision_heads,
                            spec.fullatt_block_indexes, spec.window, TOKENS_PER_SECOND)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                            vision_start_token_id=VSTART_ID, vision_end_token_id=VEND_ID, tie_word_embeddings=spec.tie,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)); the merger's last projection rescaled
    so image embeddings have the text embeddings' RMS (HF's init makes them several times larger)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        vcfg = hf.config.vision_config
        probe = torch.randn(1 * 8 * 8, PATCH_DIM, generator=g)
        image = hf.model.visual(probe, grid_thw=torch.tensor([[1, 8, 8]])).pooler_output
        text = hf.get_input_embeddings().weight
        scale = float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt())
        last = hf.model.visual.merger.mlp[2]
        last.weight.mul_(scale)
        last.bias.mul_(scale)
        assert vcfg.out_hidden_size == text.shape[1]


def build_tiny_qwen2_5_vl(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return save_random_model(path, Qwen2_5_VLForConditionalGeneration, tiny_qwen2_5_vl_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

@dataclass
class Prompt(MRopePrompt):
    def second_per_grid_ts(self) -> torch.Tensor | None:
        s = [it.model_specific_data["second_per_grid_ts"] for it in self._of(Modality.VIDEO)]
        return torch.cat(s) if s else None

    def hf_extra(self) -> dict:
        """Videos' seconds per temporal grid step, which HF's forward and rope index take besides the grids."""
        return {"second_per_grid_ts": self.second_per_grid_ts()}


def build_prompt(parts: list, seed: int = 0) -> Prompt:
    """mrope_vlm_testing.build_span_prompt's layout; a video part carries its seconds per temporal grid step:
    ("video", (t, h, w), second_per_grid)."""
    return build_span_prompt(parts, seed, Prompt, PATCH_DIM, (IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID), MERGE)


def our_positions(prompt: Prompt, tokens_per_second: float = TOKENS_PER_SECOND) -> tuple[torch.Tensor, int]:
    """Our M-RoPE positions ([3, L], delta), computed by the processor's own finalize (which turns
    tokens_per_second x second_per_grid_ts into VisionSpan.time_interval)."""
    from tessera.multimodal.processors.qwen_vl import QwenVLProcessor

    mm = MultimodalInputs(items=list(prompt.items))
    # finalize reads only these two attributes of the processor.
    QwenVLProcessor.finalize(SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second),
                             prompt.input_ids.tolist(), mm)
    return mm.mrope_positions, mm.mrope_position_delta


# ---------------------------------------------------------------- the parity suite's row

class Qwen2_5VLCase(MRopeCase):
    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(parts, seed)

    def our_positions(self, prompt: Prompt) -> tuple[torch.Tensor, int]:
        return our_positions(prompt)


PROMPTS = {
    "text": [12],
    "square_image": [5, ("image", (1, 8, 8)), 4],  # 4x4 merged: 4 windows (gqa), 1 padded window (mha)
    "nonsquare_image": [3, ("image", (1, 6, 14)), 2],  # 3x7 merged: windows padded on both axes
    "two_images": [3, ("image", (1, 8, 12)), 2, ("image", (1, 4, 6)), 3],
    "video": [4, ("video", (4, 4, 6), 0.75), 3],  # temporal step 2 x 0.75 = 1.5 positions per grid
    "image_and_long_video": [2, ("image", (1, 2, 2)), 1, ("video", (6, 4, 4), 1.25), 3],  # step 2.5, t > h, w
}
DECODE_PROMPT = [3, ("image", (1, 8, 12)), 2, ("video", (4, 4, 6), 0.75), 4]


def load_case(name: str, path: Path) -> Qwen2_5VLCase:
    from tessera.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    case, config = Qwen2_5VLCase.load(SPECS[name], path, build_tiny_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.mrope_section == spec.mrope_section and config.tie_word_embeddings == spec.tie
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, p.hf_inputs(), 8))
    return case


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_qwen2_5_vl(path, SPECS[name]),
    bytes_spec="gqa", prompts=PROMPTS, text=Seeded([12], 8), decode=Seeded(DECODE_PROMPT, 3),
    batch=(Seeded(PROMPTS["two_images"], 4), Seeded(PROMPTS["image_and_long_video"], 5)),
    # Chunks of 7 tokens; the image spans rows 6..29 and the video 33..44, so chunk boundaries 7, 14, 21, 28 and
    # 35, 42 fall inside media spans.
    chunked=tuple(Chunked([5, ("image", (1, 8, 12)), 1, ("video", (2, 4, 6), 0.75), 4], 6, lambda spec: 7, page)
                  for page in (1, 4)),
    prefix=PREFIX, prefix_cuts=PREFIX_CUTS,
    tower=(Seeded([2, ("image", (1, 8, 12)), 1, ("image", (1, 6, 14)), 1, ("video", (2, 4, 6), 1.0)], 2),),
)


# ---------------------------------------------------------------- full checkpoint directory

def make_tiny_qwen2_5_vl_checkpoint(
    path: str | Path, *, num_kv_heads: int = 2, hidden: int = 64, layers: int = 2, heads: int = 4,
    tie: bool = False, vision_hidden: int = 32, vision_depth: int = 4, vision_heads: int = 2,
    fullatt_block_indexes: tuple[int, ...] = (1, 3), window: int = 2, tokens_per_second: int = TOKENS_PER_SECOND,
    image_min_pixels: int = 56 * 56, image_max_pixels: int = 112 * 112, video_min_pixels: int = 28 * 28,
    video_max_pixels: int = 56 * 56, seed: int = 0,
) -> Path:
    """Writes a complete random Qwen2.5-VL checkpoint to `path` (created if missing) and returns it.

    - config.json: Qwen2_5_VLConfig, architectures=["Qwen2_5_VLForConditionalGeneration"], the demo-vl
      tokenizer's vocabulary and special-token ids (<|image_pad|>, <|video_pad|>, <|vision_start|>,
      <|vision_end|>; eos <|im_end|>), head_dim = hidden // heads (at least 8: M-RoPE splits its half in three);
      vision tower of `vision_depth` blocks, full attention in `fullatt_block_indexes`, windows of `window`
      merged tokens per side (window_size = window * 14 * 2 pixels); patch 14, merge 2, temporal patch 2;
    - model.safetensors: random weights with random norm weights/biases and text-sized image embeddings
      (deterministic: same arguments -> same bytes);
    - generation_config.json;
    - tokenizer + chat template + processor_config.json: `AutoProcessor.from_pretrained(path)` gives a
      Qwen2_5_VLProcessor (image processor Qwen2VLImageProcessor, video processor Qwen2VLVideoProcessor with
      do_sample_frames=False) whose images are resized to [image_min_pixels, image_max_pixels] and video
      frames to [video_min_pixels, video_max_pixels]; a video given with its fps gets second_per_grid_ts.
    """
    from transformers import (AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor)

    from tessera.config import ASSETS_DIR
    from tessera.demo.build_vl import CHAT_TEMPLATE

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    demo = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")  # tokenizer + Qwen2-VL image/video processors
    tok = demo.tokenizer
    image_processor, video_processor = demo.image_processor, demo.video_processor
    image_processor.size = {"shortest_edge": image_min_pixels, "longest_edge": image_max_pixels}
    video_processor.size = {"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels}
    video_processor.do_sample_frames = False
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                    chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)

    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    vocab_size = (len(tok) + 63) // 64 * 64
    head_dim = hidden // heads
    section = [head_dim // 8, head_dim // 8, 0]
    section[2] = head_dim // 2 - section[0] - section[1]
    text = _text_config(hidden, layers, heads, num_kv_heads, section, vocab_size, bos_token_id=ids["<|endoftext|>"],
                        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = _vision_config(vision_hidden, hidden, vision_depth, vision_heads, fullatt_block_indexes, window,
                            tokens_per_second)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           architectures=["Qwen2_5_VLForConditionalGeneration"])
    save_random_model(path, Qwen2_5_VLForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      None, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Qwen2_5_VLForConditionalGeneration from `path`, float32, eager attention, eval mode."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
