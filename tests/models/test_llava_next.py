"""LLaVA-NeXT beyond the family parity suite (test_family_parity.py runs prefill for every aspect ratio, decode,
batches, chunked prefill, prefix hits, the tower and the language model alone for both LLaVA-NeXT specs, and
the checks in llava_next_testing.FIXTURE): a select strategy the model refuses.
"""

from __future__ import annotations

import dataclasses

import pytest
from llava_testing import SPECS, tiny_llava_config

from tessera.models.config import ModelConfig
from tessera.models.llava_next import LlavaNextForConditionalGeneration


def test_full_strategy_with_a_cls_tower_is_refused():
    spec = dataclasses.replace(SPECS["next_llama"], strategy="full")
    config = ModelConfig.from_hf(tiny_llava_config(spec))
    with pytest.raises(ValueError, match="CLS token"):
        LlavaNextForConditionalGeneration(config)
