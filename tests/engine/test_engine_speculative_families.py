"""Speculative decoding on families whose attention or positions differ from those the engine-level HF tests
cover (Qwen2-VL, Gemma 3, InternVL, Pixtral, Whisper): the verify steps (drafts: the plain engine's tokens with
every third one wrong) give the plain engine's greedy tokens and logprobs, with an image in the prompt. LLaVA's
Mistral text model has a sliding window far shorter than the prompt; Qwen3-VL continues its M-RoPE positions
after the image; Llama 4 has chunked attention and layers without RoPE."""

from __future__ import annotations

import importlib

import pytest

from tessera import Engine
from tests.distributed.test_tensor_parallel import _chat
from tests.engine.hf_reference import check_speculative_matches, speculative_oracle

BUILDERS = {
    "llava-mistral": ("tests.models.llava_testing:make_tiny_llava_checkpoint", {"spec": "mistral"}),
    "qwen3_vl": ("tests.models.qwen3_vl_testing:make_tiny_qwen3_vl_checkpoint", {}),
    "llama4": ("tests.models.llama4_testing:make_tiny_llama4_checkpoint", {}),
}
SP = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_verify_steps_keep_the_plain_tokens(family: str, tmp_path, scene_images) -> None:
    module, fn = BUILDERS[family][0].split(":")
    path = str(getattr(importlib.import_module(module), fn)(tmp_path / family, **BUILDERS[family][1]))
    prompts = [_chat(path, [{"type": "image"}, {"type": "text", "text": "Describe it."}]),
               _chat(path, [{"type": "text", "text": "Hello there, how are you?"}])]
    images = [[scene_images[0]], None]
    kwargs = dict(page_size=4, max_total_tokens=4096, show_progress=False)
    with Engine(path, **kwargs) as engine:
        # The prompt's ids as the engine saw them (media placeholders expanded), from its prompt logprobs.
        plain = engine.generate(prompts, SP, image_data=images, return_logprob=True, logprob_start_len=0)
    prompt_ids = [[t for _, t in o["meta_info"]["input_token_logprobs"]] for o in plain]
    oracle = speculative_oracle(prompt_ids, [o["output_ids"] for o in plain])
    with Engine(path, speculative_algorithm="ORACLE", speculative_oracle_path=oracle, **kwargs) as engine:
        outs = engine.generate(prompts, SP, image_data=images, return_logprob=True)
        check_speculative_matches(engine, outs, [o["output_ids"] for o in plain])
    for want, got in zip(plain, outs):
        assert [lp for lp, _ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-4)
