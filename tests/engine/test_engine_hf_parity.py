"""Greedy outputs of tessera.Engine are token-identical to HF transformers (the oracle).

Requests are submitted together so batching, chunked prefill (tiny chunks that cut through
image spans) and prefix-cache hits are all exercised; logprobs of the greedy tokens match HF's
log-softmax within a tight tolerance (a check on the prefill and decode logits).
"""

from __future__ import annotations

import pytest

from tessera import Engine
from tests.engine.hf_reference import chat_prompt, check_speculative_matches, hf_greedy, speculative_oracle

MAX_NEW = 8


def _cases(processor, images, video):
    return [
        dict(prompt=chat_prompt(processor, 0, "Hello there, how are you?")),
        dict(prompt=chat_prompt(processor, 1, "What color is the circle?"), image_data=[images[0]]),
        dict(prompt=chat_prompt(processor, 2, "Describe the image."), image_data=[images[1], images[2]]),
        dict(prompt=chat_prompt(processor, 1, "What color is the circle?"), image_data=[images[3]]),
        dict(prompt=chat_prompt(processor, 0, "Describe the video.", num_videos=1), video_data=[video]),
        # Same image and text as case 1: must hit the prefix cache and still match.
        dict(prompt=chat_prompt(processor, 1, "What color is the circle?"), image_data=[images[0]]),
    ]


@pytest.mark.parametrize("fixture,page_size,chunk", [("tiny_gqa", 1, 16), ("tiny_mha", 4, 11)])
def test_engine_matches_hf_greedy(request, fixture, page_size, chunk, scene_images, scene_video):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    path = request.getfixturevalue(fixture)
    processor = AutoProcessor.from_pretrained(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    cases = _cases(processor, scene_images, scene_video)
    expected = [hf_greedy(model, processor, c["prompt"], c.get("image_data"),
                          [c["video_data"][0]] if c.get("video_data") else None, MAX_NEW) for c in cases]
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with Engine(str(path), page_size=page_size, chunked_prefill_size=chunk, max_running_requests=4,
                max_total_tokens=4096, show_progress=False) as engine:
        outs = engine.generate([c["prompt"] for c in cases], sp,
                               image_data=[c.get("image_data") for c in cases],
                               video_data=[c.get("video_data") for c in cases], return_logprob=True)
        for (ids, logprobs, prompt_len), out in zip(expected, outs):
            assert out["output_ids"] == ids
            assert out["meta_info"]["prompt_tokens"] == prompt_len
            ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            assert ours == pytest.approx(logprobs, abs=2e-4)
        # A second round of the same requests is served from the prefix cache, identically.
        again = engine.generate([c["prompt"] for c in cases[:2]], sp,
                                image_data=[c.get("image_data") for c in cases[:2]])
        for (ids, _, prompt_len), out in zip(expected[:2], again):
            assert out["output_ids"] == ids
            assert out["meta_info"]["cached_tokens"] >= prompt_len - page_size - 1 - prompt_len % page_size
    # With speculative decoding (drafts: HF's tokens, every third wrong) the tokens and logprobs stay HF's.
    prompt_ids = [processor(text=[c["prompt"]], images=c.get("image_data"), videos=c.get("video_data"),
                            return_tensors="pt")["input_ids"][0].tolist() for c in cases]
    oracle = speculative_oracle(prompt_ids, [ids for ids, _, _ in expected])
    with Engine(str(path), page_size=page_size, chunked_prefill_size=chunk, max_running_requests=4,
                max_total_tokens=4096, show_progress=False, speculative_algorithm="ORACLE",
                speculative_oracle_path=oracle) as engine:
        outs = engine.generate([c["prompt"] for c in cases], sp, image_data=[c.get("image_data") for c in cases],
                               video_data=[c.get("video_data") for c in cases], return_logprob=True)
        check_speculative_matches(engine, outs, [ids for ids, _, _ in expected])
        for (_, logprobs, _), out in zip(expected, outs):
            assert [lp for lp, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=2e-4)
