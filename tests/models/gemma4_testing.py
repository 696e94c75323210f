"""Test helpers for Gemma 4: tiny random checkpoints that can fail, prompts, HF references.

`build_tiny_gemma4(path, spec)` writes weights + config (ids BOI/EOI/IMAGE/VIDEO in a 256-token vocab) for the
model parity tests, which feed patch rows directly; `make_tiny_gemma4_checkpoint(path)` a complete checkpoint
(tokenizer, Gemma4Processor, chat template) for processor, engine and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): HF initialises Gemma 4's RMSNorm weights at 1 and the
embedders as it likes; here every norm weight and layer_scalar is random in [0.5, 1.5), and the vision embedder
is rescaled so media embeddings have the RMS of the (sqrt(hidden)-scaled) text embeddings. The two specs cover
the layouts Gemma 4 configs have: "shared_kv" (per-layer embeddings, the last two layers reusing earlier K/V,
full layers with a wider head and one KV head that is also V (attention_k_eq_v), proportional RoPE,
bidirectional image spans cut by a short window) and "plain" (a wider global head, causal
media, an untied head, default RoPE everywhere). Sizes are odd where the config allows.

Other test directories import it as `tests.models.gemma4_testing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.gemma4 import POSITION_IDS
from tests.models.family_parity import ATOL, Chunked, FamilyCase, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import grown_mask, hf_generate, save_random_model
from tests.models.gemma3_testing import atomic_chunks, spans_of

VOCAB, BOI_ID, EOI_ID, IMAGE_ID, VIDEO_ID, AUDIO_ID, BOA_ID, EOA_ID = 256, 250, 251, 252, 253, 254, 248, 249
PATCH, POOL = 3, 2  # 3-pixel patches; 2 x 2 patches pool into one soft token
MEL_BINS = 128  # the feature extractor's; the tower's first subsampling conv has as many channels


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    text_extra: dict
    tie: bool
    seed: int
    vision_hidden: int = 24
    vision_layers: int = 2
    audio: bool = False  # an audio tower (E2B / E4B have one)


SPECS = {
    "shared_kv": TinySpec(
        "shared_kv", hidden=40, layers=5, heads=4, kv_heads=2, head_dim=10, global_head_dim=14, audio=True,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"),
        sliding_window=5, tie=True, seed=6,
        text_extra=dict(hidden_size_per_layer_input=6, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
                        attention_k_eq_v=True, num_global_key_value_heads=1, use_double_wide_mlp=True,
                        use_bidirectional_attention="vision",
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                            "partial_rotary_factor": 0.5}})),
    "plain": TinySpec(
        "plain", hidden=36, layers=3, heads=3, kv_heads=3, head_dim=12, global_head_dim=18,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"), sliding_window=4, tie=False,
        seed=5,
        text_extra=dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 100_000.0}})),
}


# 26B-A4B's sparse block beside each dense MLP (tiny); HF's grouped_mm wants 16-byte expert rows.
MOE = {"enable_moe_block": True, "num_experts": 5, "top_k_experts": 2, "moe_intermediate_size": 12}


def tiny_gemma4_config(spec: TinySpec, vocab_size: int = VOCAB, ids: tuple[int, ...] | None = None,
                       **text_extra: Any):
    from transformers import Gemma4Config

    boi, eoi, image, video, audio, boa, eoa = ids or (BOI_ID, EOI_ID, IMAGE_ID, VIDEO_ID, AUDIO_ID, BOA_ID, EOA_ID)
    text = dict(vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden + 2,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                head_dim=spec.head_dim, global_head_dim=spec.global_head_dim, layer_types=list(spec.layer_types),
                sliding_window=spec.sliding_window, max_position_embeddings=1024, initializer_range=0.2,
                tie_word_embeddings=spec.tie, **{**spec.text_extra, **text_extra})
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=spec.vision_hidden // 2, patch_size=PATCH, pooling_kernel_size=POOL,
                  position_embedding_size=64)
    audio_config = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[
        MEL_BINS, 4], conv_kernel_size=3, attention_chunk_size=4, attention_context_left=5, output_proj_dims=20,
                        use_clipped_linears=False) if spec.audio else None
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio_config, boi_token_id=boi,
                        eoi_token_id=eoi, image_token_id=image, video_token_id=video, audio_token_id=audio,
                        boa_token_id=boa, eoa_token_index=eoa, tie_word_embeddings=spec.tie,
                        architectures=["Gemma4ForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: norm weights and layer scalars uniform in [0.5, 1.5); the vision embedder's projection random,
    scaled so image embeddings have the RMS of the scaled text embeddings."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        hf.get_input_embeddings().weight.mul_(0.25)  # as for Gemma-3: the scaled embedding would drown the layers
        if not hf.config.tie_word_embeddings:
            hf.lm_head.weight.normal_(0.0, 0.5, generator=g)
        proj = hf.model.embed_vision.embedding_projection.weight
        proj.copy_(torch.randn(proj.shape, generator=g))
        pixels, positions = patch_rows((4, 6), g)
        image = hf.model.get_image_features(pixels[None], positions[None]).pooler_output[0]
        text = hf.get_input_embeddings()(torch.arange(min(200, hf.config.text_config.vocab_size)))
        proj.mul_(float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt()))
        if hf.model.embed_audio is not None:
            proj = hf.model.embed_audio.embedding_projection.weight
            proj.copy_(torch.randn(proj.shape, generator=g))
            mel = torch.randn(1, 40, MEL_BINS, generator=g)
            audio = hf.model.get_audio_features(mel, torch.ones(1, 40, dtype=torch.bool)).pooler_output
            proj.mul_(float(text.pow(2).mean().sqrt() / audio.pow(2).mean().sqrt()))


def build_tiny_gemma4(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    from transformers import Gemma4ForConditionalGeneration

    return save_random_model(path, Gemma4ForConditionalGeneration, tiny_gemma4_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

def patch_rows(grid: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixels of a rows x cols patch grid: ([rows*cols, 3*PATCH^2] in [0, 1), (x, y) row-major)."""
    rows, cols = grid
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.rand(rows * cols, 3 * PATCH * PATCH, generator=g), torch.stack([x.flatten(), y.flatten()], -1)


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [L]
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _padded(self, modality: Modality) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The processor's layout: every image / frame padded to the longest with zeros at position (-1, -1)."""
        frames = [(f, p) for it in self.items if it.modality == modality
                  for f, p in zip(it.feature.reshape(-1, *it.feature.shape[-2:]),
                                  it.model_specific_data[POSITION_IDS].reshape(-1, *it.feature.shape[-2:-1], 2))]
        if not frames:
            return None
        longest = max(f.shape[0] for f, _ in frames)
        pixels = torch.zeros(len(frames), longest, frames[0][0].shape[-1])
        positions = torch.full((len(frames), longest, 2), -1, dtype=torch.long)
        for j, (f, p) in enumerate(frames):
            pixels[j, : f.shape[0]], positions[j, : f.shape[0]] = f, p
        return pixels, positions

    def hf_inputs(self) -> dict:
        ids = self.input_ids
        types = (ids == IMAGE_ID).long() + 2 * (ids == VIDEO_ID).long() + 3 * (ids == AUDIO_ID).long()
        inputs: dict[str, Any] = dict(input_ids=ids[None], attention_mask=torch.ones(1, len(self), dtype=torch.long),
                                      mm_token_type_ids=types[None])
        if (image := self._padded(Modality.IMAGE)) is not None:
            inputs["pixel_values"], inputs["image_position_ids"] = image
        if (video := self._padded(Modality.VIDEO)) is not None:
            inputs["pixel_values_videos"], inputs["video_position_ids"] = video
            inputs["num_frames_per_video"] = torch.tensor([int(it.feature.shape[0]) for it in self.items
                                                           if it.modality == Modality.VIDEO])
        mels = [it.feature for it in self.items if it.modality == Modality.AUDIO]
        if mels:  # the feature extractor's layout: padded to the longest, with a mask
            longest = max(m.shape[0] for m in mels)
            inputs["input_features"] = torch.zeros(len(mels), longest, MEL_BINS)
            inputs["input_features_mask"] = torch.zeros(len(mels), longest, dtype=torch.bool)
            for j, m in enumerate(mels):
                inputs["input_features"][j, : m.shape[0]], inputs["input_features_mask"][j, : m.shape[0]] = m, True
        return inputs


def build_prompt(parts: list, seed: int = 0) -> Prompt:
    """parts: int n = n random text tokens (ids < 240); ("image", (rows, cols)) = <boi> + rows*cols/POOL^2 image
    tokens + <eoi> of a random image of that patch grid; ("video", frames, (rows, cols)) = per frame two text
    tokens (its timestamp) + <boi> + that frame's video tokens + <eoi>; ("audio", frames) = <boa> + the audio
    tokens of that many random log-mel frames (a quarter of them, rounded up) + <eoa>."""
    ids: list[int] = []
    items = []
    for part, g in media_parts(parts, seed, ids, text_below=240):
        if part[0] == "audio":
            frames = part[1]
            n = -(-frames // 4)  # two stride-2 subsamplings: ceil(ceil(frames / 2) / 2)
            ids.append(BOA_ID)
            items.append(MultimodalDataItem(modality=Modality.AUDIO, hash=len(items), offsets=[(len(ids), len(ids) + n)],
                                            feature=torch.randn(frames, MEL_BINS, generator=g)))
            ids += [AUDIO_ID] * n + [EOA_ID]
            continue
        kind, grid = part[0], part[-1]
        frames = part[1] if kind == "video" else 1
        token = VIDEO_ID if kind == "video" else IMAGE_ID
        n = grid[0] * grid[1] // POOL ** 2
        rows, offsets = [patch_rows(grid, g) for _ in range(frames)], []
        for _ in range(frames):
            if kind == "video":
                ids += torch.randint(0, 240, (2,), generator=g).tolist()
            ids.append(BOI_ID)
            offsets.append((len(ids), len(ids) + n))
            ids += [token] * n + [EOI_ID]
        pixels, positions = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        if kind == "image":
            pixels, positions = pixels[0], positions[0]
        items.append(MultimodalDataItem(modality=Modality.VIDEO if kind == "video" else Modality.IMAGE,
                                        hash=len(items), offsets=offsets, feature=pixels,
                                        model_specific_data={POSITION_IDS: positions}))
    return Prompt(torch.tensor(ids), items)


class Gemma4Case(FamilyCase):
    """Masks from worker/masks.span_mask over the items' offsets (the model applies them to sliding layers
    only, and only for use_bidirectional_attention "vision"); chunks never split a span."""

    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(parts, seed=seed)

    def hf_inputs(self, prompt: Prompt) -> dict:
        return prompt.hf_inputs()

    def hf_step_kwargs(self, prompt: Prompt, inputs: dict, step: int) -> dict:
        return grown_mask(inputs, step)  # mm_token_type_ids on the prefill only, as generate does

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        pixels, positions = Prompt(torch.zeros(0), items)._padded(Modality.IMAGE)
        return [torch.cat(self.hf.model.get_image_features(pixels, positions).pooler_output)]

    def text_rms(self, prompt: Prompt) -> torch.Tensor:
        return self.ours.model.embed_tokens(prompt.input_ids[:3]).pow(2).mean().sqrt()

    def custom_mask(self, prompt: Prompt, lo: int, hi: int) -> torch.Tensor | None:
        from tessera.worker.masks import span_mask

        visual = sorted(r for it in prompt.items if it.modality != Modality.AUDIO for r in it.offsets)
        return span_mask(visual, lo, hi)  # audio spans stay causal (models/gemma4.py prepare_step)

    def chunks(self, prompt: Prompt, chunk: int) -> list[tuple[int, int]]:
        return atomic_chunks(len(prompt), chunk, spans_of(prompt))


PROMPTS = {
    "text": [11],
    "one_image": [5, ("image", (4, 6)), 4],  # 6 tokens, wider than tall
    "tall_image": [3, ("image", (8, 2)), 2],  # 4 tokens
    "two_images": [3, ("image", (6, 6)), 2, ("image", (2, 4)), 3],  # 9 and 2 tokens
    "video": [2, ("video", 3, (4, 4)), 3],  # 3 frames of 4 tokens
}
AUDIO_PROMPTS = {  # the spec with an audio tower
    "audio": [3, ("audio", 37), 2],  # 10 tokens
    "audio_and_image": [2, ("image", (4, 4)), 2, ("audio", 21), 1, ("audio", 9), 2],
}
DECODE_PROMPT = [3, ("image", (6, 4)), 4]
CHUNKED_PROMPT = [4, ("image", (6, 4)), 3, ("image", (4, 4)), 4]


def load_case(name: str, path: Path) -> Gemma4Case:
    from tessera.models.gemma4 import Gemma4ForConditionalGeneration

    case, config = Gemma4Case.load(SPECS[name], path, build_tiny_gemma4, Gemma4ForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.family.bidirectional_mm_spans and config.hidden_act == "gelu_pytorch_tanh"
    assert config.kv_widest is not None and config.kv_widest[1] == spec.global_head_dim
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, p.hf_inputs(), 8))
    if spec.text_extra.get("use_bidirectional_attention") == "vision":
        base = case.prompt(DECODE_PROMPT, seed=0)
        causal = {k: v for k, v in base.hf_inputs().items() if k != "mm_token_type_ids"}
        with torch.inference_mode():
            assert (hf(**causal).logits[0] - case.hf_logits(base)).abs().max() > 100 * ATOL, \
                "bidirectional image attention makes no difference"
    return case


def check_audio_matches_hf(case: Gemma4Case, monkeypatch) -> None:
    """With an audio tower: prefill logits of audio prompts (alone, and two audios of other lengths beside an image,
    their spans causal) and greedy tokens equal HF's. Without one: the model takes no audio."""
    from tests.models.family_parity import our_greedy, our_logits

    if not case.spec.audio:
        assert Modality.AUDIO not in case.ours.encoders() and case.ours.audio_tower is None
        return
    from tessera.messages.items import MultimodalInputs
    from tessera.models.base import StepSegment

    for parts in AUDIO_PROMPTS.values():
        prompt = case.prompt(parts, seed=2)
        segment = StepSegment(0, len(prompt), len(prompt), MultimodalInputs(items=prompt.items))
        spans = type(case.ours).prepare_step(case.ours.config, [segment]).bidirectional_spans
        assert spans == [[r for it in prompt.items if it.modality != Modality.AUDIO for r in it.offsets]]
        torch.testing.assert_close(our_logits(case, prompt, page_size=2, chunk=6), case.hf_logits(prompt),
                                   atol=ATOL, rtol=0)
    prompt = case.prompt(AUDIO_PROMPTS["audio"], seed=3)
    tokens, margin = case.hf_greedy(prompt, 6)
    assert margin > 1e-3 and our_greedy(case, [prompt], 6, page_size=4)[0] == [tokens]
    other = case.prompt(AUDIO_PROMPTS["audio"], seed=3)
    other.items[0].feature = torch.randn(other.items[0].feature.shape, generator=torch.Generator().manual_seed(1))
    assert case.hf_greedy(other, 6)[0] != tokens, "the audio must change HF's tokens"


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_gemma4(path, SPECS[name]),
    bytes_spec="plain", prompts=PROMPTS, text=Seeded([10], 9), decode=Seeded(DECODE_PROMPT, 0),
    decode_new=8, decode_page_sizes=(4,), batch=(Seeded(PROMPTS["two_images"], 4), Seeded([9], 5),
                                                  Seeded(PROMPTS["video"], 3)),
    chunked=(Chunked(CHUNKED_PROMPT, 6, lambda spec: 5, 1), Chunked(CHUNKED_PROMPT, 6, lambda spec: 3, 4)),
    prefix=Seeded([3, ("image", (4, 4)), 8], 8),
    prefix_cuts={"page1": (1, lambda case, a: len(a) - 6), "page4-at-image": (4, lambda case, a: spans_of(a)[0][0])},
    tower=(Seeded([2, ("image", (6, 6)), 1, ("image", (2, 4))], 2),),
    checks={"audio_matches_hf": check_audio_matches_hf},
)


# ---------------------------------------------------------------- full checkpoint directory

CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|im_start|>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|image|>{% elif item['type'] == 'video' %}<|video|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)


def make_tiny_gemma4_checkpoint(path: str | Path, spec: TinySpec | None = None, *, seed: int = 0) -> Path:
    """A complete random Gemma 4 checkpoint in `path`: demo-vl's tokenizer with Gemma 4's media tokens, a
    Gemma-style chat template, a Gemma4Processor (70 soft tokens per image and per video frame, 3-pixel patches
    pooled 2 x 2), config + weights of `spec` (default SPECS["shared_kv"]) made able to fail. Same arguments ->
    same bytes."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    from tessera.config import ASSETS_DIR

    spec = spec or SPECS["shared_kv"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens={
        "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>", "audio_token": "<|audio|>",
        "boa_token": "<|audio>", "eoa_token": "<audio|>"})
    media = dict(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                                image_processor=Gemma4ImageProcessor(**media),
                                video_processor=Gemma4VideoProcessor(**media, num_frames=4),
                                tokenizer=tok, chat_template=CHAT_TEMPLATE, image_seq_length=70)
    processor.save_pretrained(path)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio|>",
                                                       "<|audio>", "<audio|>"))
    cfg = tiny_gemma4_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, ids=ids, eos_token_id=eos,
                             pad_token_id=pad, bos_token_id=None, vocab_size_per_layer_input=(len(tok) + 63) // 64 * 64)
    cfg.vision_config.position_embedding_size = 256  # a 70-token image is up to 140 patches wide
    save_random_model(path, Gemma4ForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      None, eos, pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
