"""Test helpers for Gemma-3: tiny random checkpoints that can fail, prompts, HF references.

Two entry points build checkpoints:
- `build_tiny_gemma3(path, spec)`: weights + config only, ids BOI/EOI/IMAGE in a 256-token vocab (the model
  parity tests, which feed pixel values directly);
- `make_tiny_gemma3_checkpoint(path, ...)`: a complete checkpoint directory (weights, config with
  architectures=["Gemma3ForConditionalGeneration"], the demo-vl tokenizer with Gemma's image tokens, a
  Gemma-style chat template and a Gemma3Processor that `AutoProcessor.from_pretrained` loads), for processor,
  engine and server tests.

Both make fixtures that can fail (shared/design/FAMILY-FIXTURES.md): HF initialises the image projection at
zero (images would be ignored) and every Gemma RMSNorm weight at 0 (= scale 1); here norm weights, layer-norm
weights and biases are random, and the projection is random, rescaled so image embeddings have the RMS of the
(sqrt(hidden)-scaled) text embeddings. Sliding windows are shorter than an image's token run, so the window
cuts into the bidirectional spans; query_pre_attn_scalar (an int, as HF's strict config demands) differs from
head_dim; one spec soft-caps the final logits and scales the global RoPE linearly.

Other test directories import it as `tests.models.gemma3_testing`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import ATOL, Chunked, FamilyCase, FamilyFixture, Seeded, media_parts
from tests.models.fixture_checks import (  # noqa: F401  (MIN_MARGIN, top2_margin: re-exported to the tests)
    MIN_MARGIN,
    grown_mask,
    hf_generate,
    save_random_model,
    top2_margin,
)

VOCAB, BOI_ID, EOI_ID, IMAGE_ID = 256, 250, 251, 252
CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|im_start|>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    query_pre_attn_scalar: int
    layer_types: tuple[str, ...]
    sliding_window: int
    tie: bool
    final_logit_softcapping: float | None
    global_rope: dict
    image_size: int
    patch_size: int
    tokens_per_image: int
    vision_hidden: int
    vision_layers: int
    seed: int


SPECS = {
    # 8x8 patches pooled to 4x4 = 16 tokens per image; window 6 < 16.
    "gqa": TinySpec("gqa", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, query_pre_attn_scalar=24,
                    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
                    sliding_window=6, tie=True, final_logit_softcapping=None,
                    global_rope={"rope_type": "default", "rope_theta": 1_000_000.0},
                    image_size=56, patch_size=7, tokens_per_image=16, vision_hidden=32, vision_layers=2, seed=0),
    # 6x6 patches pooled to 3x3 = 9 tokens; window 4 < 9; soft-capped logits, linear global RoPE, untied head.
    "mha_softcap": TinySpec("mha_softcap", hidden=48, layers=3, heads=2, kv_heads=2, head_dim=24,
                            query_pre_attn_scalar=32,
                            layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                            sliding_window=4, tie=False, final_logit_softcapping=3.0,
                            global_rope={"rope_type": "linear", "rope_theta": 100_000.0, "factor": 4.0},
                            image_size=42, patch_size=7, tokens_per_image=9, vision_hidden=24, vision_layers=2,
                            seed=1),
}


def tiny_gemma3_config(spec: TinySpec, vocab_size: int = VOCAB, boi: int = BOI_ID, eoi: int = EOI_ID,
                       image: int = IMAGE_ID, **text_extra: Any):
    from transformers import Gemma3Config

    text = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, query_pre_attn_scalar=spec.query_pre_attn_scalar,
        layer_types=list(spec.layer_types), sliding_window=spec.sliding_window,
        final_logit_softcapping=spec.final_logit_softcapping, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": dict(spec.global_rope)},
        # Wider than HF's 0.02: top logits stay apart and greedy continuations vary.
        initializer_range=0.2, tie_word_embeddings=spec.tie, **text_extra,
    )
    vision = dict(model_type="siglip_vision_model", hidden_size=spec.vision_hidden,
                  intermediate_size=2 * spec.vision_hidden, num_hidden_layers=spec.vision_layers,
                  num_attention_heads=2, image_size=spec.image_size, patch_size=spec.patch_size,
                  vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=spec.tokens_per_image,
                        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                        tie_word_embeddings=spec.tie, architectures=["Gemma3ForConditionalGeneration"])


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """In place: Gemma RMSNorm weights uniform in [-0.5, 0.5) (scales 0.5..1.5), SigLIP layer-norm weights
    0.5..1.5 and biases N(0, 0.1), linear biases N(0, 0.1); the image projection random, scaled so image
    embeddings have the RMS of the scaled text embeddings."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) - 0.5)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        # The input embedding is multiplied by sqrt(hidden): at HF's init it outweighs every layer's output in
        # the residual stream and a tied head then echoes one token. A quarter of it lets the layers speak.
        hf.get_input_embeddings().weight.mul_(0.25)
        if not hf.config.tie_word_embeddings:
            hf.lm_head.weight.normal_(0.0, 0.5, generator=g)
        proj = hf.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(torch.randn(proj.shape, generator=g))
        size = hf.config.vision_config.image_size
        probe = torch.randn(2, 3, size, size, generator=g)
        image = hf.model.get_image_features(probe).pooler_output
        text = hf.get_input_embeddings()(torch.arange(min(200, hf.config.text_config.vocab_size)))
        proj.mul_(float(text.pow(2).mean().sqrt() / image.pow(2).mean().sqrt()))


def build_tiny_gemma3(path: str | Path, spec: TinySpec, attn_implementation: str = "eager"):
    """The HF reference model (eval mode), also saved to `path` (config + safetensors only)."""
    from transformers import Gemma3ForConditionalGeneration

    return save_random_model(path, Gemma3ForConditionalGeneration, tiny_gemma3_config(spec), spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), attn_implementation)


# ---------------------------------------------------------------- prompts

@dataclass
class Prompt:
    input_ids: torch.Tensor  # [L]
    token_type_ids: torch.Tensor  # [L] 1 on image soft tokens
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def pixels(self) -> torch.Tensor | None:
        p = [it.feature for it in self.items]
        return torch.cat(p) if p else None

    def hf_inputs(self) -> dict:
        inputs = dict(input_ids=self.input_ids[None], token_type_ids=self.token_type_ids[None],
                      attention_mask=torch.ones(1, len(self), dtype=torch.long), pixel_values=self.pixels())
        return {k: v for k, v in inputs.items() if v is not None}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def build_prompt(spec: list, tokens_per_image: int, image_size: int, seed: int = 0) -> Prompt:
    """spec parts: int n = n random text tokens (ids < 240); ("image", num_crops) = the original image and
    num_crops crops, each <boi> + tokens_per_image image tokens + <eoi>, with random pixels. Same spec and
    seed -> same prompt."""
    ids: list[int] = []
    items = []
    for (_, num_crops), g in media_parts(spec, seed, ids, text_below=240):
        offsets = []
        for _ in range(1 + num_crops):
            ids.append(BOI_ID)
            offsets.append((len(ids), len(ids) + tokens_per_image))
            ids += [IMAGE_ID] * tokens_per_image
            ids.append(EOI_ID)
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE, hash=len(items), offsets=offsets,
            feature=torch.randn(1 + num_crops, 3, image_size, image_size, generator=g),
            model_specific_data={"num_crops": torch.tensor([num_crops])},
        ))
    input_ids = torch.tensor(ids)
    return Prompt(input_ids, (input_ids == IMAGE_ID).long(), items)


def prompt_mm_embeds(model, prompt: Prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embeddings [n, H]) for the whole prompt, all images in one encoder call."""
    if not prompt.items:
        return None, None
    embeds = model.get_image_feature(prompt.items)
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat(embeds)


# ---------------------------------------------------------------- references

def hf_logits(hf, prompt: Prompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**prompt.hf_inputs()).logits[0]


# ---------------------------------------------------------------- the parity suite's row

def spans_of(prompt: Prompt) -> list[tuple[int, int]]:
    return sorted(r for item in prompt.items for r in item.offsets)


def atomic_chunks(n: int, chunk: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) chunks of at most `chunk` tokens, except that a span is never split: a chunk stops before a
    span it would cut, and a chunk starting at a span takes it whole (scheduler/policy._schedule_chunk)."""
    out, lo = [], 0
    while lo < n:
        hi = min(lo + chunk, n)
        for s, e in spans:
            if s < hi < e:
                hi = s if s > lo else e
                break
        out.append((lo, hi))
        lo = hi
    return out


class Gemma3Case(FamilyCase):
    """Masks come from worker/masks.span_mask over the items' offsets, as the worker builds them; chunks never
    split a span, as the scheduler cuts them."""

    def prompt(self, parts: list, seed: int = 0) -> Prompt:
        return build_prompt(parts, self.spec.tokens_per_image, self.spec.image_size, seed=seed)

    def hf_inputs(self, prompt: Prompt) -> dict:
        return prompt.hf_inputs()

    def hf_step_kwargs(self, prompt: Prompt, inputs: dict, step: int) -> dict:
        return grown_mask(inputs, step)  # token_type_ids on the prefill only, as generate does

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        ref = self.hf.model.get_image_features(torch.cat([it.feature for it in items])).pooler_output
        return [ref.reshape(-1, ref.shape[-1])]

    def text_rms(self, prompt: Prompt) -> torch.Tensor:
        return self.ours.model.embed_tokens(prompt.input_ids[:3]).pow(2).mean().sqrt()  # sqrt(hidden)-scaled

    def custom_mask(self, prompt: Prompt, lo: int, hi: int) -> torch.Tensor | None:
        from tessera.worker.masks import span_mask

        return span_mask(spans_of(prompt), lo, hi)

    def chunks(self, prompt: Prompt, chunk: int) -> list[tuple[int, int]]:
        return atomic_chunks(len(prompt), chunk, spans_of(prompt))


PROMPTS = {
    "text": [12],
    "one_image": [5, ("image", 0), 4],
    "image_with_crops": [3, ("image", 2), 2],  # pan-and-scan: the original and two crops, three spans
    "two_images": [3, ("image", 1), 2, ("image", 0), 3],
}
DECODE_PROMPT = [3, ("image", 1), 4]
CHUNKED_PROMPT = [4, ("image", 1), 3, ("image", 0), 4]


def load_case(name: str, path: Path) -> Gemma3Case:
    from tessera.models.gemma3 import Gemma3ForConditionalGeneration

    case, config = Gemma3Case.load(SPECS[name], path, build_tiny_gemma3, Gemma3ForConditionalGeneration)
    spec, hf = case.spec, case.hf
    assert config.family.bidirectional_mm_spans and config.hidden_act == "gelu_pytorch_tanh"
    assert config.sliding_windows == tuple(spec.sliding_window if t == "sliding_attention" else None
                                           for t in spec.layer_types)
    case.check_fixture_can_fail(DECODE_PROMPT, lambda p: hf_generate(hf, p.hf_inputs(), 8))
    base = case.prompt(DECODE_PROMPT, seed=0)
    causal = {k: v for k, v in base.hf_inputs().items() if k != "token_type_ids"}
    with torch.inference_mode():
        assert (hf(**causal).logits[0] - hf_logits(hf, base)).abs().max() > 100 * ATOL, \
            "bidirectional image attention makes no difference"
    return case


def check_chunks_keep_spans_whole(case: Gemma3Case, monkeypatch) -> None:
    """The chunked-prefill prompt's chunks of 5 tokens, fewer than an image's: one that would cut an image span
    stops before it, and the next takes the span whole."""
    chunks = case.chunks(case.prompt(CHUNKED_PROMPT, seed=6), 5)
    assert len(chunks) > 4 and any(hi - lo > 5 for lo, hi in chunks)


def check_split_image_span_would_differ(case: Gemma3Case, monkeypatch) -> None:
    """The reason chunks keep spans whole: an image cut in two, with causal attention across the cut, gives
    other logits than HF's (span_mask refuses such a step)."""
    import pytest

    from tessera.worker.masks import span_mask
    from tests.models.paged_driver import PagedKV, Step, make_batch

    prompt = case.prompt([2, ("image", 0), 3], seed=7)
    (s, e), = spans_of(prompt)
    cut = s + (e - s) // 2
    with pytest.raises(ValueError, match="split"):
        span_mask(spans_of(prompt), 0, cut)
    model, kv = case.ours, PagedKV(case.ours.lm_config)
    row = kv.new_request()
    rows, embeds = case.mm_embeds(prompt)
    outs = []
    with torch.inference_mode():
        for lo, hi in ((0, cut), (cut, len(prompt))):
            sel = (rows >= lo) & (rows < hi)
            mask = torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None]  # causal only
            step = Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), rows[sel] - lo, embeds[sel],
                        custom_mask=mask, all_logits=True)
            outs.append(model(make_batch(kv, [step]), kv.pool))
    assert (torch.cat(outs) - hf_logits(case.hf, prompt)).abs().max() > 100 * ATOL


def _prefix_shared(page_size: int, cut: str) -> Callable[[Gemma3Case, Prompt], int]:
    """B reuses A's KV up to its last page before the difference (the image included), or, where a cached
    prefix would end inside the image, only up to the image's start (scheduler/kv_manager.KVManager.admit)."""
    def shared(case: Gemma3Case, a: Prompt) -> int:
        (s, e), = spans_of(a)
        n = (len(a) - 6) // page_size * page_size if cut == "after_image" else s
        assert n >= e or n == s
        return n
    return shared


FIXTURE = FamilyFixture(
    specs=tuple(SPECS), load_case=load_case, build=lambda path, name: build_tiny_gemma3(path, SPECS[name]),
    bytes_spec="mha_softcap", prompts=PROMPTS, text=Seeded([10], 9), decode=Seeded(DECODE_PROMPT, 0),
    decode_new=8, decode_page_sizes=(4,), batch=(Seeded(PROMPTS["two_images"], 4), Seeded([9], 5)),
    chunked=tuple(Chunked(CHUNKED_PROMPT, 6, lambda spec: 5, page) for page in (1, 4)),
    prefix=Seeded([3, ("image", 0), 8], 8),
    prefix_cuts={f"page{p}-{cut}": (p, _prefix_shared(p, cut))
                 for p, cut in ((1, "after_image"), (4, "after_image"), (1, "at_image"))},
    tower=(Seeded([2, ("image", 2), 1, ("image", 0)], 2),),
    checks={"chunks_keep_spans_whole": check_chunks_keep_spans_whole,
            "split_image_span_would_differ": check_split_image_span_would_differ},
)


# ---------------------------------------------------------------- full checkpoint directory

def make_tiny_gemma3_checkpoint(path: str | Path, spec: TinySpec | None = None, *, seed: int = 0) -> Path:
    """Writes a complete random Gemma-3 checkpoint to `path` (created if missing) and returns it.

    - tokenizer: demo-vl's, with Gemma's image tokens added as extra special tokens (<start_of_image> = boi,
      <end_of_image> = eoi, <image_soft_token> = image); eos <|im_end|>; a Gemma-style chat template
      (roles user/model, `<start_of_image>` for each image part);
    - processor: Gemma3Processor (image_seq_length = mm_tokens_per_image) over a Gemma3ImageProcessor that
      resizes to the tower's image_size (pan-and-scan is a per-call images_kwarg: HF's processor defaults
      override the image processor's saved do_pan_and_scan);
    - config + model.safetensors from `spec` (default SPECS["gqa"]) with the tokenizer's vocabulary and ids,
      made to be able to fail (make_fixture_can_fail_); same arguments -> same bytes.
    """
    from transformers import (
        AutoTokenizer,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    from tessera.config import ASSETS_DIR

    spec = spec or SPECS["gqa"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl", extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    image_processor = Gemma3ImageProcessor(size={"height": spec.image_size, "width": spec.image_size})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                                image_seq_length=spec.tokens_per_image)
    processor.save_pretrained(path)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = tiny_gemma3_config(spec, vocab_size=(len(tok) + 63) // 64 * 64, boi=tok.boi_token_id,
                             eoi=tok.eoi_token_id, image=tok.image_token_id, eos_token_id=eos, pad_token_id=pad,
                             bos_token_id=None)
    save_random_model(path, Gemma3ForConditionalGeneration, cfg, seed, lambda m: make_fixture_can_fail_(m, seed),
                      None, eos, pad)
    return path


def load_hf_reference(path: str | Path) -> Any:
    """transformers' Gemma3ForConditionalGeneration from `path`, float32, eager attention, eval mode."""
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
