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

The prompt, HF references and parity checks it shares with Qwen2-VL and Qwen2.5-VL are in mrope_vlm_testing.py.
Other test directories import it as `tests.models.qwen3_vl_testing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tests.models.mrope_vlm_testing import MRopePrompt

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


def tiny_qwen3_vl_config(spec: TinySpec, vocab_size: int = VOCAB, token_ids: dict[str, int] | None = None,
                         **text_extra):
    from transformers import Qwen3VLConfig

    ids = token_ids or {"image": IMAGE_ID, "video": VIDEO_ID, "start": VSTART_ID, "end": VEND_ID}
    text_extra = text_extra or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3VLConfig(text_config=_text_config(spec, vocab_size, **text_extra), vision_config=_vision_config(spec),
                         image_token_id=ids["image"], video_token_id=ids["video"],
                         vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
                         tie_word_embeddings=spec.tie, architectures=["Qwen3VLForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)) everywhere; the main merger's and each
    DeepStack merger's last projection rescaled to the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        visual = hf.model.visual
        out = visual(torch.randn(8 * 8, PATCH_DIM, generator=g), grid_thw=torch.tensor([[1, 8, 8]]))
        text_rms = hf.get_input_embeddings().weight.pow(2).mean().sqrt()
        mergers = [visual.merger, *visual.deepstack_merger_list]
        for merger, feature in zip(mergers, [out.pooler_output, *out.deepstack_features], strict=True):
            scale = float(text_rms / feature.pow(2).mean().sqrt())
            merger.linear_fc2.weight.mul_(scale)
            merger.linear_fc2.bias.mul_(scale)


def build_tiny_qwen3_vl(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(spec.seed)
    hf = Qwen3VLForConditionalGeneration._from_config(tiny_qwen3_vl_config(spec),
                                                       attn_implementation=attn_implementation).eval()
    make_fixture_can_fail_(hf, spec.seed)
    hf.save_pretrained(path)
    return hf


# ---------------------------------------------------------------- prompts

Prompt = MRopePrompt  # HF takes nothing besides the ids, types and grids


def build_prompt(spec: list, seed: int = 0) -> Prompt:
    """spec parts: int n = n random text tokens (ids < 100); ("image", (1, h, w)) = <vision_start> pads
    <vision_end>; ("video", (t, h, w)) = Qwen3-VL's layout: <vision_start>, then per frame group a
    3-token stand-in for its timestamp text, <vision_start> pads <vision_end>, then <vision_end>.
    Same spec and seed -> same prompt."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    types: list[int] = []
    items = []

    def text(n: int) -> None:
        ids.extend(torch.randint(0, 100, (n,), generator=g).tolist())
        types.extend([0] * n)

    def span(token: int, kind: int, n: int) -> tuple[int, int]:
        ids.append(VSTART_ID)
        start = len(ids)
        ids.extend([token] * n)
        ids.append(VEND_ID)
        types.extend([0] + [kind] * n + [0])
        return start, start + n

    for part in spec:
        if isinstance(part, int):
            text(part)
            continue
        kind, (t, h, w) = part
        per_frame = h * w // MERGE**2
        if kind == "image":
            offsets = [span(IMAGE_ID, 1, t * per_frame)]
            msd = {"image_grid_thw": torch.tensor([[t, h, w]])}
        else:
            ids.append(VSTART_ID)
            types.append(0)
            offsets = []
            for _ in range(t):
                text(3)
                offsets.append(span(VIDEO_ID, 2, per_frame))
            ids.append(VEND_ID)
            types.append(0)
            msd = {"video_grid_thw": torch.tensor([[t, h, w]])}
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE if kind == "image" else Modality.VIDEO, hash=len(items), offsets=offsets,
            feature=torch.randn(t * h * w, PATCH_DIM, generator=g), model_specific_data=msd,
        ))
    return Prompt(torch.tensor(ids), torch.tensor(types), items)


def our_positions(prompt: Prompt) -> tuple[torch.Tensor, int]:
    """Our M-RoPE positions ([3, L], delta), from the Qwen3-VL processor's own finalize."""
    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor

    mm = MultimodalInputs(items=list(prompt.items))
    Qwen3VLProcessor.compute_positions(prompt.input_ids.tolist(), mm, MERGE)
    return mm.mrope_positions, mm.mrope_position_delta


# ---------------------------------------------------------------- references

def hf_generate(hf, inputs: dict, num_new: int) -> list[int]:
    """transformers' own greedy generate. The explicit attention mask matters: without it generate masks every
    prompt token equal to pad_token_id (random prompts hold id 0) and gives it position 0."""
    mask = torch.ones_like(inputs["input_ids"])
    with torch.inference_mode():
        out = hf.generate(**inputs, attention_mask=mask, max_new_tokens=num_new, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


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
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processor, cfg = tiny_qwen3_vl_processor_and_config(spec, image_min_pixels=image_min_pixels,
                                                        image_max_pixels=image_max_pixels,
                                                        video_min_pixels=video_min_pixels,
                                                        video_max_pixels=video_max_pixels)
    processor.save_pretrained(path)
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    torch.manual_seed(spec.seed)
    model = Qwen3VLForConditionalGeneration._from_config(cfg).eval()
    make_fixture_can_fail_(model, spec.seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(path)
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Qwen3VLForConditionalGeneration from `path`, float32, eager attention, eval mode."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
