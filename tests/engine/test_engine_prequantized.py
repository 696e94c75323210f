"""Pre-quantized Qwen2-VL checkpoints served by the Engine give the greedy tokens of HF transformers running the
same checkpoint dequantized (its float config with the weights the quantized tensors stand for) on text and image
prompts: AWQ, GPTQ, compressed-tensors W4A16 and FP8 (every scheme on a text family: tests/models/
test_quantized_checkpoints.py). The vision tower and lm_head stay float (the config's ignore list);
/get_server_info names the scheme and what runs it. Logprob differences are printed (`-s`) and bounded."""

from __future__ import annotations

import pytest

from tessera import Engine
from tests.engine.hf_reference import chat_prompt, hf_greedy
from tests.models.quant_fixtures import Scheme, check_quantization_report, quantize_checkpoint

MAX_NEW = 8
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
CT_IGNORE, HF_IGNORE = ["lm_head", "re:.*visual.*"], ["visual", "lm_head"]
VL_SCHEMES = {  # name: (scheme, what /get_server_info calls it)
    "awq-4bit-g32": (Scheme("awq"), "awq 4-bit g32 asym"),
    "gptq-4bit-g32-asym-v1": (Scheme("gptq"), "gptq 4-bit g32 asym"),
    "ct-w4a16-g32-sym": (Scheme("ct-pack", symmetric=True), "compressed-tensors pack-quantized 4-bit g32 sym"),
    "ct-fp8-channel": (Scheme("ct-fp8"), "compressed-tensors fp8 per-channel, dynamic activations"),
}


def _quantized(tmp_path_factory, src, name: str, scheme: Scheme):
    root = tmp_path_factory.mktemp(name)
    dst, ref = root / "quantized", root / "reference"
    ignore = CT_IGNORE if scheme.method.startswith("ct") else HF_IGNORE
    modules = quantize_checkpoint(src, dst, ref, scheme, ignore)
    assert modules
    return dst, ref


def _check(path, expected: list, prompts: list, images: list, name: str, reported: str) -> None:
    with Engine(str(path), page_size=4, chunked_prefill_size=16, max_running_requests=4, max_total_tokens=2048,
                show_progress=False) as engine:
        outs = engine.generate(prompts, SP, image_data=images, return_logprob=True)
        quantization = engine.get_server_info()["effective"]["quantization"]
    check_quantization_report(quantization, reported)
    diffs = []
    for i, ((ids, logprobs, prompt_len), out) in enumerate(zip(expected, outs)):
        assert out["output_ids"] == ids, f"{name} case {i}"
        assert out["meta_info"]["prompt_tokens"] == prompt_len
        diffs += [abs(a - b) for (a, _), b in zip(out["meta_info"]["output_token_logprobs"], logprobs)]
    print(f"\n{name}: {len(diffs)} greedy tokens equal to HF dequantized, max |logprob diff| {max(diffs):.2e}")
    assert max(diffs) < 2e-4


@pytest.mark.parametrize("name", list(VL_SCHEMES))
def test_qwen2_vl_quantized_matches_hf_dequantized(name, tiny_gqa, tmp_path_factory, scene_images):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    scheme, reported = VL_SCHEMES[name]
    path, ref = _quantized(tmp_path_factory, tiny_gqa, name, scheme)
    processor = AutoProcessor.from_pretrained(tiny_gqa)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(ref).eval()
    cases = [(chat_prompt(processor, 0, "Hello there, how are you?"), None),
             (chat_prompt(processor, 1, "What color is the circle?"), [scene_images[0]]),
             (chat_prompt(processor, 2, "Describe the image."), [scene_images[1], scene_images[2]])]
    expected = [hf_greedy(hf, processor, p, ims, max_new_tokens=MAX_NEW) for p, ims in cases]
    assert len({tuple(ids) for ids, _, _ in expected}) == len(cases), "the reference ignores its inputs"
    _check(path, expected, [p for p, _ in cases], [ims for _, ims in cases], name, reported)
