"""--tp-size 2 for every family with images: the same greedy tokens as one rank (logprobs within 1e-5)."""

from __future__ import annotations

import importlib

import pytest

from tessera import Engine
from tests.distributed.test_tensor_parallel import _chat, _compare

BUILDERS = {
    "gemma3": "tests.models.gemma3_testing:make_tiny_gemma3_checkpoint",
    "llava": "tests.models.llava_testing:make_tiny_llava_checkpoint",
    "internvl": "tests.models.internvl_testing:make_tiny_internvl_checkpoint",
    "pixtral": "tests.models.pixtral_testing:make_tiny_pixtral_checkpoint",
    "qwen3_vl": "tests.models.qwen3_vl_testing:make_tiny_qwen3_vl_checkpoint",
    "qwen3_vl_moe": "tests.models.qwen3_vl_moe_testing:make_tiny_qwen3_vl_moe_checkpoint",
}


def _build(name: str, path) -> str:
    module, fn = BUILDERS[name].split(":")
    return str(getattr(importlib.import_module(module), fn)(path))


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_family_tp2_matches_tp1(family: str, tmp_path, scene_images) -> None:
    path = _build(family, tmp_path / family)
    prompts = [_chat(path, [{"type": "image"}, {"type": "text", "text": t}]) for t in ("What is it?", "Describe.")]
    _compare(path, prompts, image_data=scene_images[:2])


def test_llama4_refuses_tp_with_a_clear_error(tmp_path) -> None:
    from tests.models.llama4_testing import make_tiny_llama4_checkpoint

    path = str(make_tiny_llama4_checkpoint(tmp_path / "llama4"))
    with pytest.raises(RuntimeError, match="(?i)tensor parallel"):
        Engine(path, tp_size=2, max_total_tokens=1024, show_progress=False)
