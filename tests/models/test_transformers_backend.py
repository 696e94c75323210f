"""The Transformers backend (`--model-impl transformers`) against HF `generate`: per family of the table in
transformers_backend_testing.py, and Qwen2-VL (the demo checkpoint) served both ways.

Each family's checkpoint is served once (module-scoped), and its requests go in as one batch so that the
scheduler mixes them: images of two sizes, two images where the family takes them, and text only, prefilled in
chunks of 16 tokens over pages of 4 (a family whose prompt must be computed whole, PaliGemma's, keeps it whole).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import ASSETS_DIR
from tests.models.transformers_backend_testing import FAMILIES, make_checkpoint, random_clip, random_image

NUM_NEW = 8
QUESTION = "what is in the picture"


def cases(processor, family_sizes: tuple[tuple[int, int], ...], two_images: bool,
          video: bool = False) -> list[tuple[str, list, list]]:
    """(chat prompt, images, videos) per request: one image of each size, both images, a video where the family's
    are tested, text only."""
    images = [random_image(i + 1, size) for i, size in enumerate(family_sizes)]

    def chat(n: int, kind: str = "image") -> str:
        content = [{"type": kind}] * n + [{"type": "text", "text": QUESTION}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)

    out = [(chat(1), [im], []) for im in images]
    if two_images:
        out.append((chat(2), images, []))
    if video:
        out.append((chat(1, "video"), [], [random_clip(5, family_sizes[0])]))
    return out + [(chat(0), [], [])]


def hf_greedy(model, processor, text: str, images: list, videos: list) -> list[int]:
    """HF generate's greedy tokens for the prompt as the HF processor makes it (the tokenizer without media:
    some processors, PaliGemma's, refuse text alone)."""
    media = {k: v for k, v in (("images", images), ("videos", videos)) if v}
    enc = processor(text=[text], return_tensors="pt", **media) if media else \
        processor.tokenizer([text], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def served_greedy(path: Path, requests: list[tuple[str, list, list]], **kwargs) -> list[list[int]]:
    """Our greedy tokens for every request, submitted together (one mixed batch)."""
    from tessera.entrypoints.engine import Engine

    with Engine(str(path), show_progress=False, chunked_prefill_size=16, page_size=4, max_total_tokens=4096,
                **kwargs) as engine:
        outs = engine.generate(prompt=[t for t, _, _ in requests], image_data=[ims or None for _, ims, _ in requests],
                               video_data=[vids or None for _, _, vids in requests],
                               sampling_params={"temperature": 0, "max_new_tokens": NUM_NEW})
    return [o["output_ids"] for o in outs]


def check_can_fail(refs: list[list[int]]) -> None:
    """The reference depends on the image and on the text, and is not one repeated token."""
    assert refs[0] != refs[1], "the first two images give the same tokens: the fixture ignores images"
    assert refs[-1] not in refs[:-1], "text alone gives an image prompt's tokens"
    assert any(len(set(r)) > 1 for r in refs), "every answer repeats one token"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, tmp_path_factory):
    import transformers
    from transformers import AutoProcessor

    family = FAMILIES[request.param]
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), family)
    processor = AutoProcessor.from_pretrained(path)
    hf = getattr(transformers, family.architecture).from_pretrained(path).eval()
    requests = cases(processor, family.image_sizes, family.two_images, family.video_token is not None)
    refs = [hf_greedy(hf, processor, *request) for request in requests]
    return refs, served_greedy(path, requests)


def test_family_greedy_matches_hf(family_run):
    refs, got = family_run
    check_can_fail(refs)
    assert got == refs


def test_qwen2_vl_backend_matches_native_and_hf():
    """Qwen2-VL's M-RoPE positions (from the native processor) through the backend: HF, native and backend agree."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    path = ASSETS_DIR / "demo-vl"
    processor = AutoProcessor.from_pretrained(path)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    requests = cases(processor, ((56, 84), (112, 56)), True)
    refs = [hf_greedy(hf, processor, *request) for request in requests]
    check_can_fail(refs)
    assert served_greedy(path, requests, model_impl="transformers") == refs
    assert served_greedy(path, requests, model_impl="native") == refs


def _config(cls_name: str, architecture: str, **kwargs):
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [architecture]
    return config


def test_model_impl_picks_the_family_row():
    from tessera.models.transformers_family import GENERIC_PROCESSOR, resolve_family

    qwen2_vl = _config("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")
    assert resolve_family(qwen2_vl, "auto").impl == "native"
    backend = resolve_family(qwen2_vl, "transformers")
    # M-RoPE positions come from the native processor, which the backend's row keeps.
    assert backend.impl == "transformers" and backend.positions == "mrope"
    assert backend.processor == resolve_family(qwen2_vl, "native").processor
    onevision = _config("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration")
    row = resolve_family(onevision, "auto")
    assert row.impl == "transformers" and row.processor == GENERIC_PROCESSOR and not row.prefix_lm
    assert resolve_family(_config("PaliGemmaConfig", "PaliGemmaForConditionalGeneration")).prefix_lm


@pytest.mark.parametrize("cls_name, architecture, impl, words", [
    ("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration", "native", ["--model-impl transformers"]),
    ("Qwen2Config", "FancyNewForCausalLM", "auto", ["FancyNewForCausalLM", "--model-impl"]),
    ("BloomConfig", "BloomForCausalLM", "auto", ["BloomForCausalLM", "attention interface", "--model-impl"]),
    ("T5Config", "T5ForConditionalGeneration", "transformers", ["encoder-decoder", "--model-impl"]),
    ("Gemma2Config", "Gemma2ForCausalLM", "auto", ["attn_logit_softcapping"]),
    ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "transformers", ["DeepStack", "--model-impl"]),
])
def test_what_the_backend_cannot_run_is_one_error_before_loading(cls_name, architecture, impl, words):
    from tessera.models.config import ModelConfig
    from tessera.models.families import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        ModelConfig.from_hf(_config(cls_name, architecture), impl)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_int8_weights_match_hf_dequantized(tmp_path):
    """--torchao-config int8wo quantizes the backend's text linears (ours, swapped in): the tokens are HF's over
    the same weights quantized and dequantized."""
    import transformers
    from transformers import AutoProcessor

    from tessera.layers.quantization.int_linear import fake_quantize_

    family = FAMILIES["LlavaOnevisionForConditionalGeneration"]
    path = make_checkpoint(tmp_path / "onevision", family)
    processor = AutoProcessor.from_pretrained(path)
    hf = getattr(transformers, family.architecture).from_pretrained(path).eval()
    assert fake_quantize_(hf, "int8wo", "model.language_model.") == 7 * 2  # q, k, v, o, gate, up, down x 2 layers
    requests = cases(processor, family.image_sizes[:1], False)
    assert served_greedy(path, requests, torchao_config="int8wo") == [hf_greedy(hf, processor, *r) for r in requests]


@pytest.mark.parametrize("flags, words", [({"enable_lora": True, "tp_size": 1}, "enable_lora"),
                                          ({"enable_lora": False, "tp_size": 2}, "tp_size")])
def test_lora_and_tensor_parallelism_are_refused_by_flag(flags, words):
    from tessera.models.transformers_family import refuse_backend_options, resolve_family

    row = resolve_family(_config("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration"))
    with pytest.raises(ValueError, match=words):
        refuse_backend_options(row, **flags)
    refuse_backend_options(resolve_family(_config("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")), **flags)
