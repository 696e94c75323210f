"""HF transformers greedy reference for engine parity tests."""

from __future__ import annotations

import torch


def chat_prompt(processor, num_images: int, text: str, num_videos: int = 0, system: str | None = None) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": text}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def hf_greedy(model, processor, prompt: str, images=None, videos=None, max_new_tokens: int = 8):
    """Greedy tokens without stopping at EOS (the engine side uses ignore_eos) and their logprobs."""
    kwargs = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
    enc = processor(text=[prompt], return_tensors="pt", **kwargs)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
    return ids, logprobs, enc["input_ids"].shape[1]
