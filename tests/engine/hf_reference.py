"""HF transformers greedy reference for engine parity tests, and the image families' shared engine check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def chat_prompt(processor, num_images: int, text: str, num_videos: int = 0, system: str | None = None,
                add_generation_prompt: bool = True) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": text}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    if not add_generation_prompt:  # templates without the flag (Pixtral's) are called exactly as HF's docs do
        return processor.apply_chat_template(messages, tokenize=False)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def hf_greedy(model, processor, prompt: str, images=None, videos=None, max_new_tokens: int = 8):
    """Greedy tokens without stopping at EOS (the engine side uses ignore_eos) and their logprobs."""
    ids, dists, prompt_len = hf_greedy_distributions(model, processor, prompt, images, videos, max_new_tokens)
    return ids, [d[t].item() for d, t in zip(dists, ids)], prompt_len


@torch.no_grad()
def hf_greedy_distributions(model, processor, prompt: str, images=None, videos=None, max_new_tokens: int = 8):
    """Greedy tokens, each step's float32 log_softmax over the vocabulary (HF upcasts the logits to float32
    before its processors, whatever the model's dtype), and the prompt length."""
    kwargs = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
    enc = processor(text=[prompt], return_tensors="pt", **kwargs)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    return ids, [torch.log_softmax(s[0].float(), -1) for s in out.scores], enc["input_ids"].shape[1]


def noise_images(sizes: tuple[tuple[int, int], ...], seed: int = 3) -> list:
    """Uniform-noise RGB images of the given (height, width) sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@torch.no_grad()
def hf_generate(model, processor, prompt: str, images, max_new_tokens: int,
                images_kwargs: dict | None = None) -> tuple[list[int], int, list[int]]:
    """HF's greedy tokens (no EOS stop, as ignore_eos), the prompt length and the prompt's ids; text only when
    `images` is empty."""
    kwargs = {"images": images, **({"images_kwargs": images_kwargs} if images_kwargs else {})} if images else {}
    enc = processor(text=[prompt], return_tensors="pt", **kwargs)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    n = enc["input_ids"].shape[1]
    return out[0, n:].tolist(), int(n), enc["input_ids"][0].tolist()


def speculative_oracle(prompt_ids: list[list[int]], outputs: list[list[int]]) -> str:
    """An ORACLE answers file (scheduler/speculative.py) holding `outputs` with every third token wrong (its
    lowest bit flipped), so that verify steps both accept and reject drafts."""
    import json
    import tempfile

    wrong = [[t ^ 1 if i % 3 == 1 else t for i, t in enumerate(out)] for out in outputs]
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    with f:
        json.dump([{"input_ids": p, "output_ids": o} for p, o in zip(prompt_ids, wrong)], f)
    return f.name


def check_speculative_matches(engine, outs: list[dict], expected: list[list[int]]) -> None:
    """The outputs of an ORACLE engine (speculative_oracle's drafts) are `expected`, and its verify steps both
    accepted and rejected drafts."""
    for i, (ids, out) in enumerate(zip(expected, outs)):
        assert out["output_ids"] == ids, f"case {i}"
    stats = engine.get_server_info()["stats"]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


def check_engine_matches_hf_generate(path: Path, model, processor, cases: list[tuple[str, list | None]], *,
                                     second_round: tuple[int, int], min_distinct: int, chunked_prefill_size: int,
                                     max_new_tokens: int = 6, images_kwargs: dict | None = None,
                                     **engine_kwargs) -> None:
    """The image families' engine parity check: all `cases` (prompt, images) in one Engine batch (pages of 4,
    chunks of `chunked_prefill_size`, 4 running) give HF generate's tokens and prompt lengths; then the two
    cases of `second_round` (an image seen before) give them again with at least half the prompt cached.
    `min_distinct` different HF continuations guard against a reference that ignores its inputs."""
    from tessera import Engine

    expected = [hf_generate(model, processor, p, ims, max_new_tokens, images_kwargs) for p, ims in cases]
    assert len({tuple(ids) for ids, _, _ in expected}) >= min_distinct, "the reference ignores its inputs"
    sp = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    with Engine(str(path), page_size=4, chunked_prefill_size=chunked_prefill_size, max_running_requests=4,
                max_total_tokens=4096, show_progress=False, **engine_kwargs) as engine:
        outs = engine.generate([p for p, _ in cases], sp, image_data=[ims for _, ims in cases])
        for i, ((ids, prompt_len, _), out) in enumerate(zip(expected, outs)):
            assert out["output_ids"] == ids, f"case {i}"
            assert out["meta_info"]["prompt_tokens"] == prompt_len, f"case {i}"
        a, b = second_round
        again = engine.generate([cases[a][0], cases[b][0]], sp, image_data=[cases[a][1], cases[b][1]])
        for (ids, prompt_len, _), out in zip((expected[a], expected[b]), again):
            assert out["output_ids"] == ids
            assert out["meta_info"]["cached_tokens"] >= prompt_len // 2
    # The batch again with speculative decoding: verify steps over HF's tokens, some of them wrong.
    oracle = speculative_oracle([p for _, _, p in expected], [ids for ids, _, _ in expected])
    with Engine(str(path), page_size=4, chunked_prefill_size=chunked_prefill_size, max_running_requests=4,
                max_total_tokens=4096, show_progress=False, speculative_algorithm="ORACLE",
                speculative_oracle_path=oracle, **engine_kwargs) as engine:
        check_speculative_matches(engine, engine.generate([p for p, _ in cases], sp,
                                                           image_data=[ims for _, ims in cases]),
                                  [ids for ids, _, _ in expected])
