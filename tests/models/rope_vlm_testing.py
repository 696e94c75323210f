"""Shared parity helpers for vision-language families with plain 1-D RoPE (InternVL, Pixtral): a prompt of
text tokens and image items, HF references (its own KV-cached greedy loop, generate, logits), and the paged
driver steps (whole prefill, chunks, a prefix-cache hit, decode) for our model.

A family's testing module supplies how a prompt's ids and items are built and how HF takes them
(`VLPrompt.hf_inputs`); everything here works on any model with `get_image_feature`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.messages.items import MultimodalDataItem
from tests.models.fixture_checks import MIN_MARGIN, top2_margin  # noqa: F401  (the families' tests take them from here)
from tests.models.paged_driver import (
    PagedKV,
    Step,
    decode_greedy,
    make_batch,
    share_prefix,
)

ATOL = 1e-4


@dataclass
class VLPrompt:
    input_ids: torch.Tensor  # [L]
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order
    hf_extra: dict[str, Any] = field(default_factory=dict)  # HF forward kwargs besides input_ids

    def hf_inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids[None], **self.hf_extra}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def hf_greedy(hf, inputs: dict, num_new: int) -> tuple[list[int], float]:
    """Greedy tokens of HF's model stepped with its own KV cache, and the smallest top-2 logit margin."""
    tokens, margins = [], []
    with torch.inference_mode():
        out = hf(**inputs, use_cache=True)
        length = inputs["input_ids"].shape[1]
        for i in range(num_new):
            logits = out.logits[0, -1]
            margins.append(top2_margin(logits))
            tokens.append(int(logits.argmax()))
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True,
                     position_ids=torch.tensor([[length + i]]))
    return tokens, min(margins)


def hf_generate(hf, inputs: dict, num_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_logits(hf, prompt: VLPrompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**prompt.hf_inputs()).logits[0]


def prompt_mm_embeds(model, prompt: VLPrompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embeddings [n, H]) of the whole prompt, all images in one encoder call."""
    if not prompt.items:
        return None, None
    with torch.inference_mode():
        embeds = model.get_image_feature(list(prompt.items))
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat(embeds)


def prefill_step(model, row: int, prompt: VLPrompt, start: int = 0, end: int | None = None,
                 mm: tuple[torch.Tensor | None, torch.Tensor | None] | None = None, **kw) -> Step:
    """Tokens [start, end) of the prompt as one extend step, with the image rows that fall inside it (`mm`: the
    prompt's prompt_mm_embeds, computed here when not given)."""
    end = len(prompt) if end is None else end
    rows, embeds = prompt_mm_embeds(model, prompt) if mm is None else mm
    sel_rows = sel_embeds = None
    if rows is not None:
        sel = (rows >= start) & (rows < end)
        if sel.any():
            sel_rows, sel_embeds = rows[sel] - start, embeds[sel]
    return Step(row, prompt.input_ids[start:end], torch.arange(start, end), sel_rows, sel_embeds, **kw)


def our_logits(model, prompt: VLPrompt, page_size: int = 1, chunk: int | None = None) -> torch.Tensor:
    """Our logits for every prompt token, prefilled whole or in chunks of `chunk` tokens."""
    kv = PagedKV(model.lm_config, page_size=page_size, max_context_len=512)
    row = kv.new_request()
    n = len(prompt)
    step = chunk or n
    out = []
    mm = prompt_mm_embeds(model, prompt)
    with torch.inference_mode():
        for c in range(0, n, step):
            s = prefill_step(model, row, prompt, c, min(c + step, n), mm, all_logits=True)
            out.append(model(make_batch(kv, [s]), kv.pool))
    return torch.cat(out)


def our_greedy(model, prompts: list[VLPrompt], num_new: int, page_size: int = 1) -> list[list[int]]:
    """Prefill all prompts in one batch, then decode them together one token per step."""
    kv = PagedKV(model.lm_config, page_size=page_size, max_context_len=512)
    rows = [kv.new_request() for _ in prompts]
    with torch.inference_mode():
        logits = model(make_batch(kv, [prefill_step(model, r, p) for r, p in zip(rows, prompts)]), kv.pool)
    return decode_greedy(model, kv, rows, logits, num_new)


def prefix_hit_logits(model, a: VLPrompt, b: VLPrompt, shared: int, page_size: int) -> torch.Tensor:
    """Prefill A, then B reusing A's KV for its first `shared` tokens: B's logits for tokens shared.."""
    kv = PagedKV(model.lm_config, page_size=page_size, max_context_len=512)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        model(make_batch(kv, [prefill_step(model, ra, a)]), kv.pool)
        share_prefix(kv, ra, rb, shared)
        return model(make_batch(kv, [prefill_step(model, rb, b, shared, all_logits=True)]), kv.pool)
