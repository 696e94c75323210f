"""tessera.Engine on a tiny random Mllama (Llama-3.2-Vision) checkpoint: greedy tokens identical to HF generate
through the chat template and processors, for one tiled image, two images, text before the image and text only,
in one batch and with small prefill chunks; the prefix cache reuses a prompt's K/V only with the same images;
every request's cross-attention state goes back to the pool when it finishes."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tests.models.mllama_testing import make_tiny_mllama_checkpoint, random_image

MAX_NEW = 8


def hf_tokens(path, conversations) -> list[list[int]]:
    """HF generate's greedy tokens for each (prompt text, images), one at a time (no padding)."""
    from transformers import AutoProcessor

    from tests.models.mllama_testing import load_hf_reference

    processor, model = AutoProcessor.from_pretrained(path), load_hf_reference(path)
    out = []
    for text, images in conversations:
        enc = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        with torch.inference_mode():
            seq = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
        out.append(seq[0, enc["input_ids"].shape[1]:].tolist())
    return out


@pytest.mark.slow  # a checkpoint, HF references and two Engines: ~30 s
def test_engine_matches_hf_and_frees_the_cross_attention_state(tmp_path):
    from transformers import AutoProcessor

    path = make_tiny_mllama_checkpoint(tmp_path / "mllama")
    processor = AutoProcessor.from_pretrained(path)
    g = torch.Generator().manual_seed(3)
    wide, tall, square = random_image(30, 70, g), random_image(84, 28, g), random_image(56, 60, g)

    def chat(*parts):
        content = [{"type": "image"} if p == "image" else {"type": "text", "text": p} for p in parts]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)

    conversations = [(chat("image", "What is this?"), [wide]),
                     (chat("Compare", "image", "with", "image"), [tall, square]),
                     (chat("Some text first, then", "image"), [square]),
                     (chat("Just text, no image."), []),
                     (chat("image", "What is this? Say more."), [wide])]
    expected = hf_tokens(path, conversations)
    assert expected[0] != hf_tokens(path, [(conversations[0][0], [square])])[0], "the answer ignores the image"
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    for chunk in (None, 6):  # whole prompts, then prefill chunks smaller than the text before an image
        kw = {} if chunk is None else {"chunked_prefill_size": chunk}
        with Engine(str(path), page_size=4, show_progress=False, **kw) as engine:
            outs = engine.generate(prompt=[c[0] for c in conversations], image_data=[c[1] for c in conversations],
                                   sampling_params=params)
            assert [o["output_ids"] for o in outs] == expected
            # The same image and prompt prefix again: its K/V come from the prefix cache; other pixels behind the
            # same tokens do not (the images salt the key from its first token).
            again = engine.generate(prompt=conversations[4][0], image_data=[wide], sampling_params=params)
            other = engine.generate(prompt=conversations[4][0], image_data=[tall], sampling_params=params)
            stats = engine.get_stats()
        assert again["output_ids"] == expected[4] and again["meta_info"]["cached_tokens"] > 8
        assert other["meta_info"]["cached_tokens"] == 0 and other["output_ids"] != expected[4]
        assert stats.kv_used_tokens == 0 and stats.cross_kv_used_tokens == 0
