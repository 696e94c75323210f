"""Shared parity helpers for the M-RoPE vision-language families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a prompt of
text tokens and media items, HF references (its own KV-cached greedy loop, logits, rope index), the paged
driver steps (whole prefill, a slice of it, decode at M-RoPE positions) and the parity checks the Qwen2.5-VL and
Qwen3-VL tests run alike (greedy decode, two requests in one batch, chunked prefill, a prefix-cache hit, a
fixture that can fail, a real processor's output).

A family's testing module supplies how a prompt is laid out (`build_prompt`), its own positions
(`our_positions`) and, where HF takes more than the grids, `MRopePrompt.hf_extra`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.mrope_reference import decode_mrope_positions
from tests.models.fixture_checks import (
    MIN_MARGIN,
    check_greedy_depends_on_inputs,
    hf_stepped_greedy,
    prompt_variants,
    top2_margin,
)
from tests.models.paged_driver import (
    PagedKV,
    Step,
    decode_greedy,
    make_batch,
    share_prefix,
)

ATOL = 1e-4


@dataclass
class MRopePrompt:
    input_ids: torch.Tensor  # [L]
    mm_token_type_ids: torch.Tensor  # [L] 0 text, 1 image, 2 video
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def _of(self, modality: Modality) -> list[MultimodalDataItem]:
        return [it for it in self.items if it.modality == modality]

    def grids(self, modality: Modality) -> torch.Tensor | None:
        key = "image_grid_thw" if modality == Modality.IMAGE else "video_grid_thw"
        g = [it.model_specific_data[key] for it in self._of(modality)]
        return torch.cat(g) if g else None

    def pixels(self, modality: Modality) -> torch.Tensor | None:
        p = [it.feature for it in self._of(modality)]
        return torch.cat(p) if p else None

    def hf_extra(self) -> dict[str, Any]:
        """What HF's forward and get_rope_index take besides the ids, types and grids (none here)."""
        return {}

    def hf_inputs(self) -> dict:
        """HF forward/generate kwargs. Absent media are left out rather than passed as None: transformers
        5.24's generate runs every modality's get_*_features whose pixel key is present, even when None."""
        inputs = dict(
            input_ids=self.input_ids[None], mm_token_type_ids=self.mm_token_type_ids[None],
            pixel_values=self.pixels(Modality.IMAGE), image_grid_thw=self.grids(Modality.IMAGE),
            pixel_values_videos=self.pixels(Modality.VIDEO), video_grid_thw=self.grids(Modality.VIDEO),
            **self.hf_extra(),
        )
        return {k: v for k, v in inputs.items() if v is not None}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def hf_positions(hf, prompt: MRopePrompt) -> tuple[torch.Tensor, int]:
    """HF's rope index for one prompt ([3, L], delta)."""
    if not prompt.items:
        return torch.arange(len(prompt)).expand(3, -1).clone(), 0
    pos, delta = hf.model.get_rope_index(
        prompt.input_ids[None], prompt.mm_token_type_ids[None], image_grid_thw=prompt.grids(Modality.IMAGE),
        video_grid_thw=prompt.grids(Modality.VIDEO), **prompt.hf_extra(),
    )
    return pos[:, 0], int(delta.reshape(-1)[0])


def prompt_mm_embeds(model, prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embedding rows [n, width]) for the whole prompt, in row order; images in one
    encoder call, videos in one."""
    if not prompt.items:
        return None, None
    by_item: dict[int, torch.Tensor] = {}
    for modality, fn in ((Modality.IMAGE, model.get_image_feature), (Modality.VIDEO, model.get_video_feature)):
        idx = [i for i, it in enumerate(prompt.items) if it.modality == modality]
        if idx:
            by_item.update(zip(idx, fn([prompt.items[i] for i in idx])))
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat([by_item[i] for i in range(len(prompt.items))])


# ---------------------------------------------------------------- references

def hf_greedy(hf, inputs: dict, num_new: int) -> tuple[list[int], float]:
    """Greedy tokens of HF's model stepped with its own KV cache, and the smallest top-2 logit margin.

    The decode positions are the model's: prompt length + i + rope_deltas, with rope_deltas = max prompt
    position + 1 - prompt length (Qwen's convention, HF's cached forward, vLLM, SGLang and ours). The deltas a
    previous call left on the model are cleared first. transformers 5.24's generate() differs: it continues each
    M-RoPE row from the LAST prompt position + 1 (GenerationMixin._update_model_kwargs_for_generation), which is
    not max + 1 when a video's time-scaled temporal positions reach past the text after it. For prompts whose
    last position is the max the two agree (the fixtures check this against their `hf_generate`).
    """
    hf.model.rope_deltas = None
    return hf_stepped_greedy(hf, inputs, num_new)


def hf_logits(hf, prompt: MRopePrompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**prompt.hf_inputs()).logits[0]


# ---------------------------------------------------------------- our model through the paged driver

@dataclass
class MRopeCase:
    """A tiny checkpoint: HF's model, ours loaded from its safetensors, and the family's own positions."""

    name: str
    hf: torch.nn.Module
    ours: torch.nn.Module
    our_positions: Callable[[Any], tuple[torch.Tensor, int]]


def prefill_step(case: MRopeCase, row: int, prompt: MRopePrompt, **kw) -> Step:
    """The whole prompt as one extend step: our positions (checked against HF's), our media embeddings."""
    positions, delta = case.our_positions(prompt)
    ref_positions, ref_delta = hf_positions(case.hf, prompt)
    assert torch.equal(positions, ref_positions) and delta == ref_delta
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    return Step(row, prompt.input_ids, positions, rows, embeds, **kw)


def sub_step(whole: Step, row: int, lo: int, hi: int) -> Step:
    """Tokens [lo, hi) of a whole-prompt step, with the media rows that fall inside them."""
    mm_rows, embeds = None, None
    if whole.mm_rows is not None:
        sel = (whole.mm_rows >= lo) & (whole.mm_rows < hi)
        if sel.any():
            mm_rows, embeds = whole.mm_rows[sel] - lo, whole.mm_embeds[sel]
    return Step(row, whole.input_ids[lo:hi], whole.positions[:, lo:hi], mm_rows, embeds, all_logits=True)


def decode_step(kv: PagedKV, row: int, logits: torch.Tensor, delta: int) -> Step:
    return Step(row, logits.argmax().reshape(1), decode_mrope_positions(kv.lens[row], delta))


def decode_together(model, kv: PagedKV, rows: list[int], logits, deltas: list[int],
                    num_new: int) -> list[list[int]]:
    """Greedy tokens of the requests `rows` (each with its M-RoPE delta), decoded in one batched step per token
    from their last logits."""
    delta_of = dict(zip(rows, deltas))
    return decode_greedy(model, kv, rows, logits, num_new, lambda kv, r, lo: decode_step(kv, r, lo, delta_of[r]))


# ---------------------------------------------------------------- the parity checks

def check_fixture_can_fail(hf, build_decode_prompt: Callable[[], MRopePrompt], hf_generate) -> None:
    """HF's greedy output on the decode prompt depends on the image and on the text, is not one repeated token
    and its choices are not float noise; the reference is deterministic and equals HF generate."""
    base, other_image, other_text = prompt_variants(build_decode_prompt)
    tokens = check_greedy_depends_on_inputs(lambda p: hf_greedy(hf, p.hf_inputs(), 8), base, other_image, other_text)
    # The reference is a reference: deterministic, and equal to HF generate where their decode positions agree.
    assert hf_greedy(hf, base.hf_inputs(), 8)[0] == tokens == hf_generate(hf, base.hf_inputs(), 8)


def check_prefill_logits(case: MRopeCase, prompt: MRopePrompt) -> None:
    kv = PagedKV(case.ours.lm_config)
    with torch.inference_mode():
        ours = case.ours(make_batch(kv, [prefill_step(case, kv.new_request(), prompt, all_logits=True)]), kv.pool)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def check_greedy_decode(case: MRopeCase, prompt: MRopePrompt, num_new: int, page_size: int) -> None:
    ref_tokens, margin = hf_greedy(case.hf, prompt.hf_inputs(), num_new)
    assert margin > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    with torch.inference_mode():
        logits = case.ours(make_batch(kv, [prefill_step(case, row, prompt)]), kv.pool)[-1:]
    assert decode_together(case.ours, kv, [row], logits, [case.our_positions(prompt)[1]], num_new) == [ref_tokens]


def check_two_requests_in_one_batch(case: MRopeCase, prompts: list[MRopePrompt], num_new: int) -> None:
    """The prompts prefilled in one forward (last logits equal HF's), then decoded together."""
    refs = [hf_greedy(case.hf, p.hf_inputs(), num_new) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=4)
    rows = [kv.new_request() for _ in prompts]
    with torch.inference_mode():
        logits = case.ours(make_batch(kv, [prefill_step(case, r, p) for r, p in zip(rows, prompts)]), kv.pool)
        for p, lo in zip(prompts, logits):
            torch.testing.assert_close(lo, hf_logits(case.hf, p)[-1], atol=ATOL, rtol=0)
    deltas = [case.our_positions(p)[1] for p in prompts]
    assert decode_together(case.ours, kv, rows, logits, deltas, num_new) == [t for t, _ in refs]


def check_chunked_prefill(case: MRopeCase, prompt: MRopePrompt, page_size: int, chunk: int = 7) -> None:
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    whole = prefill_step(case, row, prompt)
    out = []
    with torch.inference_mode():
        for c in range(0, len(prompt), chunk):
            out.append(case.ours(make_batch(kv, [sub_step(whole, row, c, min(c + chunk, len(prompt)))]), kv.pool))
    torch.testing.assert_close(torch.cat(out), hf_logits(case.hf, prompt), atol=ATOL, rtol=0)


def check_prefix_cache_hit(case: MRopeCase, a: MRopePrompt, b: MRopePrompt, shared: int, page_size: int,
                           num_new: int = 4) -> None:
    """B reuses A's KV slots for its first `shared` tokens, extends only the rest (with the rest of its media
    rows) and gives HF's logits for them; both then decode in one batch."""
    refs = [hf_greedy(case.hf, p.hf_inputs(), num_new) for p in (a, b)]
    assert min(m for _, m in refs) > MIN_MARGIN
    kv = PagedKV(case.ours.lm_config, page_size=page_size)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        la = case.ours(make_batch(kv, [prefill_step(case, ra, a)]), kv.pool)[-1]
        share_prefix(kv, ra, rb, shared)
        lb_all = case.ours(make_batch(kv, [sub_step(prefill_step(case, rb, b), rb, shared, len(b))]), kv.pool)
        torch.testing.assert_close(lb_all, hf_logits(case.hf, b)[shared:], atol=ATOL, rtol=0)
    deltas = [case.our_positions(a)[1], case.our_positions(b)[1]]
    assert decode_together(case.ours, kv, [ra, rb], [la, lb_all[-1]], deltas, num_new) == [t for t, _ in refs]


def check_processor_output_matches_hf(hf, ours, out, ref_inputs: dict, num_new: int = 6) -> None:
    """Our model on our processor's output (ids, items, positions) gives HF's logits and greedy tokens on HF's
    processor output `ref_inputs`."""
    ref_tokens, margin = hf_greedy(hf, ref_inputs, num_new)
    assert margin > MIN_MARGIN
    kv = PagedKV(ours.lm_config, page_size=2)
    row = kv.new_request()
    items = out.mm_inputs.items
    with torch.inference_mode():
        embeds = torch.cat([e for it in items for e in (ours.get_image_feature([it]) if it.modality == Modality.IMAGE
                                                          else ours.get_video_feature([it]))])
        mm_rows = torch.cat([torch.arange(s, e) for it in items for s, e in it.offsets])
        step = Step(row, torch.tensor(out.input_ids), out.mm_inputs.mrope_positions, mm_rows, embeds,
                    all_logits=True)
        logits = ours(make_batch(kv, [step]), kv.pool)
        torch.testing.assert_close(logits, hf(**ref_inputs).logits[0], atol=ATOL, rtol=0)
    case = MRopeCase("processor", hf, ours, lambda _: (None, out.mm_inputs.mrope_position_delta))
    tokens = decode_together(case.ours, kv, [row], logits[-1:], [out.mm_inputs.mrope_position_delta], num_new)
    assert tokens == [ref_tokens]
