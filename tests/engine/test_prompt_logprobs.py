"""Prompt (input) log-probabilities equal HF transformers' log_softmax on the same ids (fp32 demo-vl).

The shared demo-vl engine prefills in 48-token chunks, so an image prompt's logprobs come from several
steps; a request asked a second time finds its prompt in the prefix cache, and must still get every
prompt logprob (the cached prefix is not used past logprob_start_len - 1).
"""

from __future__ import annotations

import random

import pytest
import torch

from tessera.config import ASSETS_DIR
from tessera.demo import scenes
from tests.engine.hf_reference import chat_prompt

DEMO = ASSETS_DIR / "demo-vl"
TOP = 3


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(DEMO).eval(), AutoProcessor.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def image():
    return scenes.image_sample(random.Random(5)).frames[0]


@torch.no_grad()
def hf_prompt_logprobs(hf_demo, prompt: str, images=None) -> tuple[list[int], torch.Tensor]:
    """The prompt ids and HF's float32 log_softmax of every prompt row."""
    model, processor = hf_demo
    enc = processor(text=[prompt], return_tensors="pt", **({"images": images} if images else {}))
    return enc["input_ids"][0].tolist(), torch.log_softmax(model(**enc).logits[0].float(), dim=-1)


def check(out: dict, ids: list[int], lp: torch.Tensor, start: int) -> None:
    meta = out["meta_info"]
    pairs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t in pairs] == ids[start:]
    assert len(tops) == len(ids) - start
    for k, ((value, tid), top) in enumerate(zip(pairs, tops)):
        pos = start + k
        if pos == 0:  # nothing predicts the first prompt token
            assert value is None and top is None
            continue
        assert value == pytest.approx(lp[pos - 1, tid].item(), abs=1e-4)
        want_v, want_i = lp[pos - 1].topk(TOP)
        assert [t for _, t in top] == want_i.tolist()
        assert [v for v, _ in top] == pytest.approx(want_v.tolist(), abs=1e-4)


@pytest.mark.parametrize("with_image", [False, True])
def test_prompt_logprobs_match_hf_across_chunks_and_cache(demo_vl_engine, hf_demo, image, with_image):
    prompt = chat_prompt(hf_demo[1], int(with_image), "What color is the circle? Describe the picture.")
    images = [image] if with_image else None
    ids, lp = hf_prompt_logprobs(hf_demo, prompt, images)
    assert len(ids) > 48 or not with_image  # several prefill chunks
    sp = {"temperature": 0, "max_new_tokens": 2, "top_logprobs_num": TOP}
    for start in (0, 0, 7):  # the second run finds the prompt cached; a later start may use a cached prefix
        out = demo_vl_engine.generate(prompt, sp, image_data=images, return_logprob=True, logprob_start_len=start)
        check(out, ids, lp, start)
        assert out["meta_info"]["cached_tokens"] <= max(start - 1, 0)
        assert len(out["meta_info"]["output_token_logprobs"]) == 2


def test_prompt_logprobs_only_with_max_new_tokens_zero(demo_vl_engine, hf_demo):
    ids, lp = hf_prompt_logprobs(hf_demo, "Hello there, how are you today?")
    out = demo_vl_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0, "top_logprobs_num": TOP},
                                  return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    check(out, ids, lp, 0)
    # Without logprob_start_len nothing is computed, and no input logprobs are reported.
    plain = demo_vl_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True)
    assert "input_token_logprobs" not in plain["meta_info"]


def test_logprob_start_len_outside_the_prompt_is_refused(demo_vl_engine):
    with pytest.raises(ValueError, match="logprob_start_len"):
        demo_vl_engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1}, logprob_start_len=3)
    with pytest.raises(ValueError, match="logprob_start_len"):
        demo_vl_engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1}, logprob_start_len=-2)
