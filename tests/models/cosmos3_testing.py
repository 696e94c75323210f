"""Test helpers for Cosmos3's understanding towers: tiny random checkpoints that can fail, HF references.

Cosmos3-Nano (`Cosmos3OmniForConditionalGeneration`) is Qwen3-VL: its parity row is Qwen3-VL's with HF's
Cosmos3 class building the checkpoint, which transformers saves in the unified checkpoint's own layout
(top-level `layers.*` with `self_attn.to_q/to_k/to_v/to_out` and `norm_q/norm_k`, the vision tower as flat
`blocks.*`/`merger.*`): the row proves that layout loads.

Cosmos3-Edge (`Cosmos3EdgeForConditionalGeneration`): prompts laid out as Qwen3-VL's (qwen3_vl_testing.build_prompt,
pixel rows of 3 x 16 x 16 values: its SigLIP2 tower patches frame by frame); its checkpoint is saved with the text
MLP as `mlp.up_proj/down_proj` and every `self_attn.q_proj` as `to_q` (the tower's too).

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): random norm weights and biases everywhere; Edge's
projector output rescaled to the text embeddings' RMS.
Other test directories import it as `tests.models.cosmos3_testing`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from tests.models import qwen3_vl_testing as qwen3_vl
from tests.models.fixture_checks import save_random_model
from tests.models.mrope_vlm_testing import MRopeCase

OMNI = "Cosmos3OmniForConditionalGeneration"
EDGE = "Cosmos3EdgeForConditionalGeneration"
PATCH, MERGE = 16, 2
EDGE_PATCH_DIM = 3 * PATCH * PATCH


@dataclass(frozen=True)
class EdgeSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    num_patches: int  # a square: the learned position grid, resized to each image
    projector: int  # projector_hidden_size
    seed: int


EDGE_SPECS = {
    "gqa": EdgeSpec("gqa", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=14, tie=False, mrope_section=(3, 2, 2),
                    vision_hidden=32, vision_depth=2, vision_heads=2, num_patches=16, projector=72, seed=1),
    "mha_tied": EdgeSpec("mha_tied", hidden=48, layers=2, heads=4, kv_heads=4, head_dim=20, tie=True,
                         mrope_section=(4, 3, 3), vision_hidden=24, vision_depth=2, vision_heads=2, num_patches=9,
                         projector=40, seed=0),
}


def tiny_cosmos3_edge_config(spec: EdgeSpec, vocab_size: int = qwen3_vl.VOCAB, token_ids: dict[str, int] | None = None,
                             **text_extra):
    from transformers import Cosmos3EdgeConfig

    ids = token_ids or {"image": qwen3_vl.IMAGE_ID, "video": qwen3_vl.VIDEO_ID, "start": qwen3_vl.VSTART_ID,
                        "end": qwen3_vl.VEND_ID}
    text_extra = text_extra or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    text = dict(vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=3 * spec.hidden - 8,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                head_dim=spec.head_dim, rms_norm_eps=1e-5, max_position_embeddings=1024, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e8, "mrope_section": list(spec.mrope_section)},
                **text_extra)
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden + 6,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads, patch_size=PATCH,
                  num_patches=spec.num_patches, spatial_merge_size=MERGE, initializer_range=0.1)
    return Cosmos3EdgeConfig(text_config=text, vision_config=vision, projector_hidden_size=spec.projector,
                             image_token_id=ids["image"], video_token_id=ids["video"],
                             vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
                             tie_word_embeddings=spec.tie, architectures=[EDGE])


def make_edge_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)); the projector's output rescaled to the
    text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    qwen3_vl.randomize_norms_and_biases_(hf, g)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.randn(8 * 8, EDGE_PATCH_DIM, generator=g), torch.tensor([[1, 8, 8]]))
        feature = torch.cat(out.pooler_output)
        scale = float(hf.get_input_embeddings().weight.pow(2).mean().sqrt() / feature.pow(2).mean().sqrt())
        hf.model.projector.linear_fc2.weight.mul_(scale)
        hf.model.projector.linear_fc2.bias.mul_(scale)


def build_tiny_cosmos3_edge(path: str | Path, spec: EdgeSpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    from transformers import Cosmos3EdgeForConditionalGeneration

    return save_random_model(path, Cosmos3EdgeForConditionalGeneration, tiny_cosmos3_edge_config(spec), spec.seed,
                             lambda m: make_edge_fixture_can_fail_(m, spec.seed), attn_implementation)


class Cosmos3EdgeCase(qwen3_vl.Qwen3VLCase):
    """Qwen3-VL's prompts over rows of Edge's patch size; an item's rows are the projector's, nothing more."""

    patch_dim: ClassVar[int] = EDGE_PATCH_DIM
    hf_item_features = MRopeCase.hf_item_features


def load_edge_case(name: str, path: Path) -> Cosmos3EdgeCase:
    from tessera.models.cosmos3 import Cosmos3EdgeForConditionalGeneration

    case, config = Cosmos3EdgeCase.load(EDGE_SPECS[name], path, build_tiny_cosmos3_edge,
                                        Cosmos3EdgeForConditionalGeneration)
    assert config.mrope_section == case.spec.mrope_section and config.hidden_act == "relu2"
    case.check_fixture_can_fail(qwen3_vl.DECODE_PROMPT,
                                lambda p: qwen3_vl.hf_generate_masked(case.hf, p.hf_inputs(), 8))
    return case


EDGE_FIXTURE = dataclasses.replace(
    qwen3_vl.FIXTURE, specs=tuple(EDGE_SPECS), load_case=load_edge_case, bytes_spec="mha_tied", checks={},
    build=lambda path, name: build_tiny_cosmos3_edge(path, EDGE_SPECS[name]))
# Nano's model is Qwen3-VL's, run in full by its row: here the checkpoint's layout under a few of its prompts.
OMNI_FIXTURE = dataclasses.replace(
    qwen3_vl.FIXTURE, specs=("gqa",), load_case=partial(qwen3_vl.load_case, architecture=OMNI), bytes_spec="gqa",
    build=lambda path, name: qwen3_vl.build_tiny_qwen3_vl(path, qwen3_vl.SPECS[name], architecture=OMNI),
    prompts={k: qwen3_vl.PROMPTS[k] for k in ("text", "two_images", "image_and_video")},
    chunked=qwen3_vl.FIXTURE.chunked[1:], prefix_cuts={"page4": qwen3_vl.PREFIX_CUTS["page4"]})


# ---------------------------------------------------------------- full checkpoint directory

CHECKPOINT_SPEC = EdgeSpec("ckpt", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, tie=False,
                           mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=2, vision_heads=2, num_patches=16,
                           projector=48, seed=3)


def tiny_cosmos3_edge_processor_and_config(spec: EdgeSpec = CHECKPOINT_SPEC, *, image_min_pixels: int = 64 * 64,
                                           image_max_pixels: int = 128 * 128, video_min_pixels: int = 32 * 32,
                                           video_max_pixels: int = 64 * 64 * 4) -> tuple[Any, Any]:
    """(transformers Cosmos3EdgeProcessor over the demo-vl tokenizer, Cosmos3EdgeConfig with its token ids): see
    make_tiny_cosmos3_edge_checkpoint."""
    from transformers import AutoProcessor, Cosmos3EdgeImageProcessor, Cosmos3EdgeProcessor, Cosmos3EdgeVideoProcessor

    from tessera.config import ASSETS_DIR
    from tessera.demo.build_vl import CHAT_TEMPLATE

    tok = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl").tokenizer
    common = dict(patch_size=PATCH, merge_size=MERGE, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Cosmos3EdgeProcessor(
        image_processor=Cosmos3EdgeImageProcessor(
            size={"shortest_edge": image_min_pixels, "longest_edge": image_max_pixels}, **common),
        video_processor=Cosmos3EdgeVideoProcessor(
            size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels}, do_sample_frames=False,
            **common),
        tokenizer=tok, chat_template=CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg = tiny_cosmos3_edge_config(
        spec, vocab_size=(len(tok) + 63) // 64 * 64,
        token_ids={"image": ids["<|image_pad|>"], "video": ids["<|video_pad|>"], "start": ids["<|vision_start|>"],
                   "end": ids["<|vision_end|>"]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return processor, cfg


def make_tiny_cosmos3_edge_checkpoint(path: str | Path, spec: EdgeSpec = CHECKPOINT_SPEC, **sizes: int) -> Path:
    """Writes a complete random Cosmos3-Edge checkpoint to `path` (created if missing) and returns it: config.json
    over the demo-vl tokenizer's vocabulary and its <|image_pad|>, <|video_pad|>, <|vision_start|>,
    <|vision_end|> ids (eos <|im_end|>), the weights in the checkpoint's own layout, the tokenizer, the demo-vl chat
    template and a Cosmos3EdgeProcessor (patch 16, merge 2, mean/std 0.5, do_sample_frames=False; `sizes` as
    tiny_cosmos3_edge_processor_and_config's) that `AutoProcessor.from_pretrained` loads."""
    from transformers import Cosmos3EdgeForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processor, cfg = tiny_cosmos3_edge_processor_and_config(spec, **sizes)
    processor.save_pretrained(path)
    text = cfg.get_text_config()
    save_random_model(path, Cosmos3EdgeForConditionalGeneration, cfg, spec.seed,
                      lambda m: make_edge_fixture_can_fail_(m, spec.seed), None, text.eos_token_id, text.pad_token_id)
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Cosmos3EdgeForConditionalGeneration from `path`, float32, eager attention, eval mode."""
    from transformers import Cosmos3EdgeForConditionalGeneration

    return Cosmos3EdgeForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()


def as_diffusers_layout(path: Path, extra_tensors: bool = True) -> Path:
    """Rearranges a complete checkpoint as Cosmos3's Diffusers pipelines are laid out: model_index.json at the
    root, the weights in the `transformer` component, with (extra_tensors) some of the Generator's tensors beside
    the understanding tower's (ones the mappings drop)."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    if extra_tensors:
        width = tensors["embed_tokens.weight"].shape[1]
        for name in ("layers.0.self_attn.add_q_proj.weight", "layers.0.mlp_moe_gen.fc1.weight",
                     "time_embedder.linear_1.weight", "proj_out.weight"):
            tensors[name] = torch.zeros(4, width)
    (path / "transformer").mkdir()
    save_file(tensors, path / "transformer" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    (path / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos3Pipeline",
                                                       "transformer": ["diffusers", "Cosmos3OmniTransformer"]}))
    return path
