"""The fixture protocol of the one family parity suite (test_family_parity.py), and the paged-driver runs it
compares with HF.

A family takes part through its testing module: a `FamilyCase` subclass (how a prompt is built, what HF takes,
HF's own stepped greedy loop, its media features, and, where the family needs them, the positions, masks and
chunk cuts of an extend step and the decode step) and one `FamilyFixture` row (its specs, how a case is
loaded, and the prompts each parity test runs, with their seeds). Adding a family is one testing module and
one row in test_family_parity.FAMILIES. A case memoises HF's references and our media embeddings per prompt,
so tests of several page sizes share them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.fixture_checks import MIN_MARGIN, check_greedy_depends_on_inputs, hf_stepped_greedy, prompt_variants
from tessera.messages.pooling import PoolingParams
from tessera.messages.worker import PoolingRows
from tessera.worker.pooling import Pooler, hidden_rows
from tests.models.paged_driver import (
    PagedKV,
    Step,
    decode_greedy,
    decode_step,
    make_batch,
    share_prefix,
)

ATOL = 1e-4
Parts = list  # a family's prompt description: ints (random text tokens) and media tuples of its own shape


def media_parts(parts: Parts, seed: int, ids: list[int],
                text_below: int = 100) -> Iterator[tuple[Any, torch.Generator]]:
    """Walks a prompt's parts: appends n random text ids (< text_below) to `ids` for an int n, and yields every
    other part with the prompt's generator, so that the same parts and seed give the same prompt."""
    g = torch.Generator().manual_seed(seed)
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, text_below, (part,), generator=g).tolist()
        else:
            yield part, g


def prompt_key(prompt: Any) -> tuple:
    """Identifies a prompt by its ids and pixels (tests edit both on copies of one built prompt)."""
    return tuple(prompt.input_ids.tolist()), tuple(float(it.feature.sum()) for it in prompt.items)


def media_embeds(model, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
    """Our embeddings of `items`, per item in their order: all images in one encoder call, all videos in one,
    all audios in one."""
    by_item: dict[int, torch.Tensor] = {}
    for modality, fn in ((Modality.IMAGE, "get_image_feature"), (Modality.VIDEO, "get_video_feature"),
                         (Modality.AUDIO, "get_audio_feature")):
        idx = [i for i, it in enumerate(items) if it.modality == modality]
        if idx:
            by_item.update(zip(idx, getattr(model, fn)([items[i] for i in idx])))
    return [by_item[i] for i in range(len(items))]


@dataclass
class FamilyCase(ABC):
    """A tiny checkpoint of one family: HF's model and ours loaded from its safetensors."""

    spec: Any
    hf: Any
    ours: Any
    path: Path
    refs: dict = field(default_factory=dict, repr=False)
    embeds: dict = field(default_factory=dict, repr=False)
    row: FamilyFixture | None = field(default=None, repr=False)  # set by the suite: the prompts its tests run

    tower_attr: ClassVar[str] = "vision_tower"  # our vision tower's attribute (None when language-model-only)

    @abstractmethod
    def prompt(self, parts: Parts, seed: int = 0) -> Any:
        """A prompt (input_ids [L], items) from the family's parts; same parts and seed -> same prompt."""

    @abstractmethod
    def hf_inputs(self, prompt: Any) -> dict:
        """HF forward/generate kwargs for `prompt`."""

    @abstractmethod
    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """HF's embedding rows of each item, in order."""

    def hf_step_kwargs(self, prompt: Any, inputs: dict, step: int) -> dict:
        """What HF's cached forward takes for decode step `step` besides the token and the cache."""
        return {}

    def hf_greedy_of(self, inputs: dict, prompt: Any, num_new: int) -> tuple[list[int], float]:
        """HF's stepped greedy tokens and smallest top-2 margin on HF inputs `inputs` laid out as `prompt`."""
        return hf_stepped_greedy(self.hf, inputs, num_new, lambda inputs, i: self.hf_step_kwargs(prompt, inputs, i))

    def hf_greedy_uncached(self, prompt: Any, num_new: int) -> tuple[list[int], float]:
        return self.hf_greedy_of(self.hf_inputs(prompt), prompt, num_new)

    def hf_greedy(self, prompt: Any, num_new: int) -> tuple[list[int], float]:
        """HF's greedy tokens stepped with its own KV cache and the smallest top-2 margin, memoised."""
        key = (prompt_key(prompt), num_new)
        if key not in self.refs:
            self.refs[key] = self.hf_greedy_uncached(prompt, num_new)
        return self.refs[key]

    def hf_logits(self, prompt: Any) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf(**self.hf_inputs(prompt)).logits[0]

    def mm_embeds(self, prompt: Any, model=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(placeholder rows [n], embedding rows [n, width]) of the whole prompt, memoised for our model."""
        model = self.ours if model is None else model
        key = prompt_key(prompt)
        if model is not self.ours or key not in self.embeds:
            if not prompt.items:
                return None, None
            with torch.inference_mode():
                embeds = torch.cat(media_embeds(model, prompt.items))
            rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
            if model is not self.ours:
                return rows, embeds
            self.embeds[key] = rows, embeds
        return self.embeds[key]

    @classmethod
    def load(cls, spec: Any, path: Path, build: Callable[[Path, Any], Any], model_cls: type) -> tuple[FamilyCase, Any]:
        """(a case of HF's model from `build(path, spec)` and ours, a `model_cls`, loaded from what it saved; our
        model config)."""
        from tessera.models.registry import load_model

        hf = build(path, spec)
        ours, config = load_model(path, torch.float32)
        assert isinstance(ours, model_cls)
        return cls(spec, hf, ours, path), config

    def build(self, seeded: Seeded) -> Any:
        parts = seeded.parts(self.spec) if callable(seeded.parts) else seeded.parts
        return self.prompt(parts, seeded.seed)

    def text_rms(self, prompt: Any) -> torch.Tensor:
        """The RMS of text embeddings that media embeddings must match."""
        return self.ours.model.embed_tokens.weight.pow(2).mean().sqrt()

    def positions(self, prompt: Any, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi)

    def custom_mask(self, prompt: Any, lo: int, hi: int) -> torch.Tensor | None:
        return None

    def extend_step(self, row: int, prompt: Any, lo: int = 0, hi: int | None = None, **kw) -> Step:
        """Tokens [lo, hi) of `prompt` for request `row` (whose KV holds 0..lo-1), with the media rows inside."""
        hi = len(prompt) if hi is None else hi
        rows, embeds = self.mm_embeds(prompt)
        mm_rows = mm_embeds = None
        if rows is not None:
            sel = (rows >= lo) & (rows < hi)
            if sel.any():
                mm_rows, mm_embeds = rows[sel] - lo, embeds[sel]
        return Step(row, prompt.input_ids[lo:hi], self.positions(prompt, lo, hi), mm_rows, mm_embeds,
                    custom_mask=self.custom_mask(prompt, lo, hi), **kw)

    def decode_step(self, kv: PagedKV, row: int, logits: torch.Tensor, prompt: Any) -> Step:
        return decode_step(kv, row, logits)

    def chunks(self, prompt: Any, chunk: int) -> list[tuple[int, int]]:
        """The [lo, hi) prefill chunks of at most `chunk` tokens the scheduler would cut."""
        return [(lo, min(lo + chunk, len(prompt))) for lo in range(0, len(prompt), chunk)]

    def check_fixture_can_fail(self, decode_parts: Parts, hf_generate: Callable[[Any], list[int]],
                               num_text: int = 4) -> list[int]:
        """Media embeddings are text-sized; HF's greedy output on the decode prompt depends on the media and on
        the text, is not one repeated token, its choices are not float noise, and the reference is
        deterministic and HF generate's (`hf_generate(prompt)`). Returns the decode prompt's tokens."""
        base = self.prompt(decode_parts, seed=0)
        _, embeds = self.mm_embeds(base)
        text_rms = self.text_rms(base)
        for level in embeds.split(self.ours.config.hidden_size, dim=-1):  # the main rows, then any extra levels
            ratio = float(level.pow(2).mean().sqrt() / text_rms)
            assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
        variants = prompt_variants(lambda: self.prompt(decode_parts, seed=0), num_text)
        tokens = check_greedy_depends_on_inputs(lambda p: self.hf_greedy(p, 8), *variants)
        assert self.hf_greedy_uncached(base, 8)[0] == tokens == hf_generate(base), "the reference is HF's"
        return tokens


@dataclass(frozen=True)
class Seeded:
    parts: Parts | Callable[[Any], Parts]  # or spec -> parts, where the layout depends on the spec
    seed: int


@dataclass(frozen=True)
class Chunked:
    parts: Parts
    seed: int
    chunk: Callable[[Any], int]  # spec -> tokens per chunk
    page_size: int


@dataclass(frozen=True)
class FamilyFixture:
    """One family's row of the parity suite: its specs, how a case is built, and each test's prompts."""

    specs: tuple[str, ...]
    load_case: Callable[[str, Path], FamilyCase]  # spec name, empty directory -> a checked case
    build: Callable[[Path, str], Any]  # spec name -> the checkpoint's config and weights written to the path
    prompts: dict[str, Parts]  # prefill parity, seed 1
    text: Parts  # the language-model-only prompt
    decode: Seeded
    batch: tuple[Seeded, ...]  # prefilled in one forward, then decoded together
    chunked: tuple[Chunked, ...]
    prefix: Seeded  # B is this prompt with its last 6 tokens changed
    prefix_cuts: dict[str, tuple[int, Callable[[FamilyCase, Any], int]]]  # id -> (page size, shared(case, A))
    tower: tuple[Seeded, ...]  # prompts whose media go through the towers together
    tower_lengths: tuple[int, ...] | None = None  # expected rows per item (default: each item's token count)
    bytes_spec: str = ""
    decode_new: int = 10
    decode_page_sizes: tuple[int, ...] = (1, 4)
    checks: dict[str, Callable[..., None]] = field(default_factory=dict)  # (case, monkeypatch) -> None


# ---------------------------------------------------------------- our model through the paged driver

def our_logits(case: FamilyCase, prompt: Any, page_size: int = 1, chunk: int | None = None,
               model=None) -> torch.Tensor:
    """Our logits for every prompt token, prefilled whole or in the family's chunks of `chunk` tokens."""
    model = case.ours if model is None else model
    kv = PagedKV(model.lm_config, page_size=page_size, max_context_len=512)
    row = kv.new_request()
    cuts = case.chunks(prompt, chunk) if chunk else [(0, len(prompt))]
    with torch.inference_mode():
        return torch.cat([model(make_batch(kv, [case.extend_step(row, prompt, lo, hi, all_logits=True)]), kv.pool)
                          for lo, hi in cuts])


def decode_together(case: FamilyCase, kv: PagedKV, rows: list[int], prompts: list, logits,
                    num_new: int) -> list[list[int]]:
    prompt_of = dict(zip(rows, prompts))
    return decode_greedy(case.ours, kv, rows, logits, num_new,
                         lambda kv, r, lo: case.decode_step(kv, r, lo, prompt_of[r]))


def our_greedy(case: FamilyCase, prompts: list, num_new: int,
               page_size: int = 1) -> tuple[list[list[int]], torch.Tensor]:
    """All prompts prefilled in one forward, then decoded together: (tokens per prompt, prefill last logits)."""
    kv = PagedKV(case.ours.lm_config, page_size=page_size, max_context_len=512)
    rows = [kv.new_request() for _ in prompts]
    with torch.inference_mode():
        logits = case.ours(make_batch(kv, [case.extend_step(r, p) for r, p in zip(rows, prompts)]), kv.pool)
    return decode_together(case, kv, rows, prompts, logits, num_new), logits


def prefix_hit(case: FamilyCase, a: Any, b: Any, shared: int, page_size: int,
               num_new: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill A, then B reusing A's KV for its first `shared` tokens: (B's logits for tokens shared.., the
    greedy tokens of A and B decoded together)."""
    kv = PagedKV(case.ours.lm_config, page_size=page_size, max_context_len=512)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        la = case.ours(make_batch(kv, [case.extend_step(ra, a)]), kv.pool)[-1]
        share_prefix(kv, ra, rb, shared)
        lb = case.ours(make_batch(kv, [case.extend_step(rb, b, shared, all_logits=True)]), kv.pool)
    return lb, decode_together(case, kv, [ra, rb], [a, b], [la, lb[-1]], num_new)


def check_processed_prompt_matches_hf(case: FamilyCase, prompt: Any, hf_inputs: dict, num_new: int = 6) -> None:
    """Our model on our processor's output `prompt` gives HF's logits and greedy tokens on HF's processor
    output `hf_inputs`."""
    ref_tokens, margin = case.hf_greedy_of(hf_inputs, prompt, num_new)
    assert margin > MIN_MARGIN
    with torch.inference_mode():
        ref = case.hf(**hf_inputs).logits[0]
    torch.testing.assert_close(our_logits(case, prompt, page_size=2), ref, atol=ATOL, rtol=0)
    assert our_greedy(case, [prompt], num_new, page_size=2)[0] == [ref_tokens]


def load_real_processor(path: Path, load_hf_reference, case_cls, spec: Any = None) -> tuple[FamilyCase, Any, Any]:
    """(a case over the complete checkpoint at `path`, our processor through the registry, HF's AutoProcessor)."""
    from transformers import AutoProcessor

    from tessera.models.registry import load_model
    from tessera.multimodal.media import MediaLimits
    from tests.multimodal.processor_registry import create_processor

    hf_processor = AutoProcessor.from_pretrained(path)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    return case_cls(spec, hf, ours, path), processor, hf_processor


def process_two_images(processor, hf_processor, parts: list[str], add_generation_prompt: bool = True) -> tuple:
    """A wide (130x40) and a tall (50x90) random image in a user turn of `parts` ("image" or text) through our
    processor and HF's: (our output, HF's), the same ids."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]
    content = [{"type": "image"} if p == "image" else {"type": "text", "text": p} for p in parts]
    messages = [{"role": "user", "content": content}]
    kw = {"add_generation_prompt": True} if add_generation_prompt else {}  # Pixtral's template has no such flag
    text = hf_processor.apply_chat_template(messages, tokenize=False, **kw)
    try:
        out = processor.process(prompt=text, image_data=images)
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    assert out.input_ids == ref["input_ids"][0].tolist()
    return out, ref


# ---------------------------------------------------------------- embeddings: pooled final hidden states

def hf_last_hidden(case, prompt) -> torch.Tensor:
    """HF's final-norm hidden states [L, H]: the base model's last_hidden_state (HF's hidden_states[-1])."""
    with torch.inference_mode():
        out = case.hf(**case.hf_inputs(prompt), output_hidden_states=True)
    return out.hidden_states[-1][0]


def our_pooled(case, prompt, method: str, chunk: int | None) -> torch.Tensor:
    """The pooled vector through the worker's Pooler, the prompt prefilled whole or in chunks."""
    kv = PagedKV(case.ours.lm_config, page_size=2, max_context_len=512)
    row = kv.new_request()
    pooler, params = Pooler(), PoolingParams(method, normalize=True)
    cuts = case.chunks(prompt, chunk) if chunk else [(0, len(prompt))]
    out: list[torch.Tensor] = []
    for lo, hi in cuts:
        fb = make_batch(kv, [case.extend_step(row, prompt, lo, hi)])
        entry = PoolingRows(0, 0, lo, hi - lo, hi == len(prompt), params)
        fb.hidden_indices = torch.tensor(hidden_rows([entry]), dtype=torch.int64)
        with torch.inference_mode():
            case.ours(fb, kv.pool)
        out += pooler.pool(fb.hidden_states, [entry], ["r"])
    assert len(out) == 1
    return out[0]
