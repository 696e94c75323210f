"""The checks that make a family's tiny random fixture one that can fail (shared/design/FAMILY-FIXTURES.md),
shared by every vision-language family's parity tests.

A reference whose greedy output ignores the image or the text, repeats one token, or picks between logits
closer than float noise passes any comparison; each family's fixture runs `check_greedy_depends_on_inputs` on
its decode prompt before a test may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MIN_MARGIN = 1e-3  # 10x the parity tests' 1e-4 tolerance: a greedy choice made by less is float noise, not a test


def save_random_model(path, model_cls, config, seed: int, make_can_fail: Callable[[Any], None],
                      attn_implementation: str | None = "eager", eos: int | None = None, pad: int | None = None):
    """HF's `model_cls` of `config` drawn from `seed`, made able to fail in place (`make_can_fail(model)`), in
    eval mode, saved to `path` with, when `eos` is given, a generation config as complete checkpoints have one.
    Returns the model."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = model_cls._from_config(config, **kw).eval()
    make_can_fail(model)
    if eos is not None:
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    return model


def top2_margin(logits: torch.Tensor) -> float:
    """Smallest gap between the best and second-best logit over the rows of `logits` [..., V]."""
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def hf_stepped_greedy(hf, inputs: dict, num_new: int,
                      step_kwargs: Callable[[dict, int], dict] | None = None) -> tuple[list[int], float]:
    """Greedy tokens of HF's model stepped with its own KV cache (prefill with `inputs`, then one token per
    forward, with `step_kwargs(inputs, i)` besides the token at step i: a grown attention mask, explicit
    positions), and the smallest top-2 logit margin over those steps."""
    tokens, margins = [], []
    with torch.inference_mode():
        out = hf(**inputs, use_cache=True)
        for i in range(num_new):
            logits = out.logits[0, -1]
            margins.append(top2_margin(logits))
            tokens.append(int(logits.argmax()))
            extra = step_kwargs(inputs, i) if step_kwargs else {}
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True, **extra)
    return tokens, min(margins)


def grown_mask(inputs: dict, step: int) -> dict:
    """step_kwargs for models that want the prompt's attention mask grown by one column per decoded token."""
    mask = inputs["attention_mask"]
    return {"attention_mask": torch.cat([mask, torch.ones(1, step + 1, dtype=mask.dtype)], dim=1)}


def hf_generate(hf, inputs: dict, num_new: int, **kw) -> list[int]:
    """transformers' own greedy generate, no stop token."""
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None,
                          **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def prompt_variants(build: Callable[[], Any], num_text: int = 4) -> tuple[Any, Any, Any]:
    """(base, other_image, other_text): three builds of one prompt; in the second its first image's pixels are
    other random values, in the third its last `num_text` tokens are 7, 8, 9, ... (a prompt that keeps
    HF-side copies of its pixels must refresh them for the second)."""
    base, other_image, other_text = build(), build(), build()
    other_image.items[0].feature = torch.randn(other_image.items[0].feature.shape,
                                               generator=torch.Generator().manual_seed(9))
    other_text.input_ids[-num_text:] = torch.arange(7, 7 + num_text)
    return base, other_image, other_text


def check_greedy_depends_on_inputs(greedy: Callable[[Any], tuple[list[int], float]], base: Any, other_image: Any,
                                   other_text: Any) -> list[int]:
    """HF's greedy continuation (`greedy(prompt)` -> tokens, smallest top-2 margin) of `base` differs from the
    one with another image and from the one with other text, is not (nearly) one repeated token, and none of
    the choices is float noise. Returns base's tokens."""
    outs = []
    for p in (base, other_image, other_text):
        tokens, margin = greedy(p)
        assert margin > MIN_MARGIN, f"top-2 logit margin {margin:.2e} is float noise"
        assert len(set(tokens)) >= 3, f"greedy output {tokens} is (nearly) one repeated token"
        outs.append(tokens)
    assert outs[0] != outs[1], "greedy output does not depend on the image"
    assert outs[0] != outs[2], "greedy output does not depend on the text"
    return outs[0]
