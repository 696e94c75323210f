"""Test helpers for Kimi-K2.5: tiny random checkpoints that can fail, prompts of native-resolution images, HF
references.

- `build_tiny_kimi(path, spec)`: weights + config only (<|media_pad|> 120 in a 128-token vocab), for the model
  parity tests, which feed patches directly;
- `make_tiny_kimi_checkpoint(path, ...)`: a complete checkpoint directory (the demo-vl tokenizer with Kimi's
  media tokens, a Kimi-style chat template, a Kimi_K25Processor over a Kimi_K25ImageProcessor) for processor,
  engine and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): every norm weight (text RMSNorms, the latent norms,
the tower's and projector's LayerNorms) and bias is random, the projector's out_proj is rescaled so image
embeddings are text-sized, and the router is made to matter: its weights are wide and e_score_correction_bias is
random (so the biased choice differs from the unbiased scores), with more groups than topk_group (group-limited
routing masks experts) and norm_topk_prob / routed_scaling_factor set. The specs use YaRN RoPE (its mscale
changes the softmax scale) with interleaved and plain rope layouts, v_head_dim narrower and wider than K's
head, a dense first layer and MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import ATOL, Chunked, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.rope_vlm_testing import RopeVLCase, VLPrompt

VOCAB, IMAGE_ID, VIDEO_ID, START_ID, END_ID = 128, 120, 121, 122, 123
PATCH = 14
GRID_KEY = "image_grid_thw"


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    layers: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    experts: int
    groups: int
    topk_group: int
    top_k: int
    shared: int
    first_dense: int
    rope_interleave: bool
    yarn: bool
    tie: bool
    vision_hidden: int
    vision_layers: int
    seed: int


SPECS = {
    # q through a LoRA rank, YaRN with mscale, interleaved rope pairs, 8 experts in 4 groups (2 chosen), top 3.
    "yarn_qlora": TinySpec("yarn_qlora", hidden=48, layers=3, heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope=16,
                           qk_rope=8, v_head=10, experts=8, groups=4, topk_group=2, top_k=3, shared=1,
                           first_dense=1, rope_interleave=True, yarn=True, tie=False, vision_hidden=32,
                           vision_layers=2, seed=0),
    # Default RoPE in the plain layout, tied embeddings, one group, two shared experts, V wider than K. (No spec
    # without q_lora_rank: transformers 5.24's save_pretrained writes such a q_proj as `self_wqkv`, permuted, and
    # cannot load it back itself.)
    "plain_tied": TinySpec("plain_tied", hidden=40, layers=2, heads=2, q_lora_rank=20, kv_lora_rank=12, qk_nope=10,
                           qk_rope=6, v_head=18, experts=6, groups=1, topk_group=1, top_k=2, shared=2,
                           first_dense=0, rope_interleave=False, yarn=False, tie=True, vision_hidden=24,
                           vision_layers=1, seed=1),
}


def tiny_kimi_config(spec: TinySpec, vocab_size: int = VOCAB, token_ids: dict[str, int] | None = None,
                     **text_extra: Any):
    from transformers import Kimi_K25Config

    ids = token_ids or {"image": IMAGE_ID, "video": VIDEO_ID, "start": START_ID, "end": END_ID}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000.0}
    if spec.yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    text = dict(
        model_type="deepseek_v3", vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        moe_intermediate_size=spec.hidden // 2, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads, n_shared_experts=spec.shared, n_routed_experts=spec.experts,
        routed_scaling_factor=2.5, kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank,
        qk_rope_head_dim=spec.qk_rope, v_head_dim=spec.v_head, qk_nope_head_dim=spec.qk_nope, n_group=spec.groups,
        topk_group=spec.topk_group, num_experts_per_tok=spec.top_k, first_k_dense_replace=spec.first_dense,
        norm_topk_prob=True, rope_interleave=spec.rope_interleave, max_position_embeddings=512, rms_norm_eps=1e-5,
        initializer_range=0.2, rope_parameters=rope, tie_word_embeddings=spec.tie,
        **(text_extra or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    )
    vision = dict(patch_size=PATCH, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=2,
                  num_hidden_layers=spec.vision_layers, hidden_size=spec.vision_hidden,
                  intermediate_size=2 * spec.vision_hidden, merge_kernel_size=[2, 2], initializer_range=0.1,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10_000.0})
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=spec.vision_hidden,
                          image_token_id=ids["image"], video_token_id=ids["video"],
                          vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
                          tie_word_embeddings=spec.tie, architectures=["Kimi_K25ForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: random norm weights (0.5..1.5) and biases (N(0, 0.1)), a wide router with a random score bias, the
    projector's out_proj rescaled so image embeddings have the text embeddings' RMS."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
            if name == "DeepseekV3TopkRouter":
                module.weight.normal_(0.0, 0.5, generator=g)
                module.e_score_correction_bias.copy_(0.3 * torch.randn(module.num_experts, generator=g))
        vision = hf.model.vision_tower
        vision.patch_embed.pos_emb.position_embeddings.normal_(0.0, 0.5, generator=g)
        grid = torch.tensor([[1, 4, 6]])
        image = hf.model.get_image_features(torch.randn(24, 3, PATCH, PATCH, generator=g), grid).pooler_output[0]
        text = hf.get_input_embeddings().weight
        scale = float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt())
        out = hf.model.mm_projector.out_proj
        out.weight.mul_(scale)
        out.bias.mul_(scale)


def build_tiny_kimi(path: str | Path, spec: TinySpec, **config_kw: Any):
    """The HF reference model (eval mode, eager attention), also saved to `path` (config + safetensors)."""
    from transformers import Kimi_K25ForConditionalGeneration

    return save_random_model(path, Kimi_K25ForConditionalGeneration, tiny_kimi_config(spec, **config_kw), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed))


def build_prompt(parts: list, seed: int = 0) -> VLPrompt:
    """parts: int n = n random text tokens (ids < 100); ("image", (h, w)) = an image of h x w patches (even sizes)
    between <|media_begin|>-like and <|media_end|>-like tokens, with random pixels."""
    ids: list[int] = []
    items = []
    for (_, (h, w)), g in media_parts(parts, seed, ids):
        ids.append(START_ID)
        n = h * w // 4
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE, hash=len(items), offsets=[(len(ids), len(ids) + n)],
            feature=torch.randn(h * w, 3, PATCH, PATCH, generator=g),
            model_specific_data={GRID_KEY: torch.tensor([[1, h, w]])}))
        ids += [IMAGE_ID] * n + [END_ID]
    return VLPrompt(torch.tensor(ids), items)


# ---------------------------------------------------------------- the parity suite's row

class KimiCase(RopeVLCase):
    def prompt(self, parts: list, seed: int = 0) -> VLPrompt:
        return build_prompt(parts, seed)

    def hf_pixels(self, items: list[MultimodalDataItem]) -> dict[str, Any]:
        if not items:
            return {}
        return {"pixel_values": torch.cat([it.feature for it in items]),
                "image_grid_thw": torch.cat([it.model_specific_data[GRID_KEY] for it in items])}

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        pixels = self.hf_pixels(items)
        return list(self.hf.model.get_image_features(pixels["pixel_values"], pixels[GRID_KEY]).pooler_output)

    def text_rms(self, prompt: VLPrompt) -> torch.Tensor:
        return self.ours.model.embed_tokens(torch.arange(100)).pow(2).mean().sqrt()  # the text ids only


PROMPTS = {  # ("image", (h, w)) in patches
    "text": [13],
    "square": [5, ("image", (4, 4)), 4],
    "wide": [3, ("image", (2, 8)), 2],
    "tall": [2, ("image", (6, 2)), 3],
    "two_sizes": [3, ("image", (4, 6)), 2, ("image", (2, 2)), 3],
}
DECODE_PROMPT = [3, ("image", (4, 6)), 2, ("image", (2, 4)), 4]


def routes(case: KimiCase, prompt: VLPrompt) -> list[torch.Tensor]:
    """Every MoE layer's chosen experts per token of `prompt` (sorted per token), from our router on HF's hidden
    states entering each layer's MLP."""
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[1].sort(-1).values))
             for layer in case.ours.model.layers if hasattr(layer.mlp, "gate")]
    try:
        from tests.models.family_parity import our_logits
        our_logits(case, prompt)
    finally:
        for h in hooks:
            h.remove()
    return chosen


def load_case(name: str, path: Path) -> KimiCase:
    from tessera.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    case, config = KimiCase.load(SPECS[name], path, build_tiny_kimi, Kimi_K25ForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.tie_word_embeddings == spec.tie
    assert config.head_dim == max(spec.qk_nope + spec.qk_rope, spec.v_head) and config.num_kv_heads == spec.heads
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, case.hf_inputs(p), 8))
    return case


def check_experts_routed_per_token(case: KimiCase, monkeypatch) -> None:
    """Tokens of one prompt go to different experts in every MoE layer; the score bias and the group limit change
    the choice (without them the logits move far past the tolerance)."""
    prompt = case.prompt(PROMPTS["two_sizes"], seed=1)
    for layer_routes in routes(case, prompt):
        assert len({tuple(r.tolist()) for r in layer_routes}) >= 4, "tokens share one expert set"
    ref = case.hf_logits(prompt)
    from tests.models.family_parity import our_logits
    routers = [layer.mlp.gate for layer in case.ours.model.layers if hasattr(layer.mlp, "gate")]
    saved = [r.e_score_correction_bias.clone() for r in routers]
    try:
        for r in routers:
            r.e_score_correction_bias.data.zero_()
        assert (our_logits(case, prompt) - ref).abs().max() > 100 * ATOL, "the score bias makes no difference"
    finally:
        for r, b in zip(routers, saved):
            r.e_score_correction_bias.data.copy_(b)
    if case.spec.topk_group < case.spec.groups:
        monkeypatch.setattr(routers[0], "topk_group", case.spec.groups)
        for r in routers:
            monkeypatch.setattr(r, "topk_group", case.spec.groups)
        assert (our_logits(case, prompt) - ref).abs().max() > 100 * ATOL, "group-limited routing makes no difference"
        monkeypatch.undo()
    torch.testing.assert_close(our_logits(case, prompt), ref, atol=ATOL, rtol=0)


def _prefix_shared(page_size: int):
    """Page size 1: just after the image's end token; 4: a page-aligned cut inside the image."""
    def shared(case: KimiCase, a: VLPrompt) -> int:
        end = a.items[0].offsets[0][1]  # the end token's index
        cut = end + 1 if page_size == 1 else (end - 2) // page_size * page_size
        assert cut > a.items[0].offsets[0][0]
        return cut
    return shared


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_kimi(path, SPECS[name]),
    bytes_spec="plain_tied", prompts=PROMPTS, text=Seeded(PROMPTS["text"], 8), decode=Seeded(DECODE_PROMPT, 3),
    batch=(Seeded(PROMPTS["text"], 4), Seeded(PROMPTS["two_sizes"], 5), Seeded(PROMPTS["tall"], 6)),
    # Chunks of 5 tokens: both images (6 and 4 tokens) are split across chunks.
    chunked=tuple(Chunked([5, ("image", (4, 6)), 1, ("image", (4, 4)), 4], 6, lambda spec: 5, page)
                  for page in (1, 4)),
    prefix=Seeded([4, ("image", (4, 6)), 6], 7), prefix_cuts={f"page{p}": (p, _prefix_shared(p)) for p in (1, 4)},
    tower=(Seeded([2, ("image", (6, 4)), 1, ("image", (2, 8)), 1], 2), Seeded([1, ("image", (2, 2)), 1], 3)),
    checks={"experts_routed_per_token": check_experts_routed_per_token},
)


# ---------------------------------------------------------------- full checkpoint directory

MEDIA_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>",
                "media_begin_token": "<|media_begin|>", "media_content_token": "<|media_content|>",
                "media_end_token": "<|media_end|>"}
# Kimi-K2.5's layout of an image part, in a short ChatML-style template over the demo-vl tokenizer's turn tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def kimi_tokenizer():
    """The demo-vl tokenizer with Kimi-K2.5's media tokens as named extra special tokens."""
    from transformers import AutoTokenizer

    from tessera.config import ASSETS_DIR

    return AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens=MEDIA_TOKENS)


def make_tiny_kimi_checkpoint(path: str | Path, spec: TinySpec = SPECS["yarn_qlora"], *, max_side: int = 8 * PATCH,
                              max_patches: int = 48, seed: int = 0) -> Path:
    """Writes a complete random Kimi-K2.5 checkpoint to `path` and returns it: the model of `spec` (its vocabulary
    is the tokenizer's), a Kimi_K25ImageProcessor (at most `max_side` pixels a side and `max_patches` patches), a
    Kimi_K25Processor, the chat template, and generation_config (eos <|im_end|>)."""
    from transformers import Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor, Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = kimi_tokenizer()
    image_processor = Kimi_K25ImageProcessor(size={"max_height": max_side, "max_width": max_side},
                                             max_patches=max_patches, patch_size=PATCH, merge_size=2)
    processor = Kimi_K25Processor(image_processor=image_processor, tokenizer=tok,
                                  video_processor=Kimi_K25VideoProcessor(), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    ids = {"image": tok.image_token_id, "video": tok.video_token_id,
           "start": tok.convert_tokens_to_ids("<|media_begin|>"), "end": tok.convert_tokens_to_ids("<|media_end|>")}
    cfg = tiny_kimi_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, token_ids=ids, bos_token_id=pad,
                           eos_token_id=eos, pad_token_id=pad)
    save_random_model(path, Kimi_K25ForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed), "eager", eos, pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
