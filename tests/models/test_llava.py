"""LLaVA-1.5 beyond the family parity suite (test_family_parity.py runs prefill, decode, batches, chunked
prefill, prefix hits, the tower and the language model alone for three language models from text_config: Llama
with attention biases, Mistral with a sliding window shorter than the prompts and tied embeddings, Qwen2 with
q/k/v biases; three feature selections: layer -2 without CLS, layers [-3, -1] concatenated with CLS kept
("full"), the last layer; CLIP towers and a SigLIP one): what the model refuses.
"""

from __future__ import annotations

import pytest
from llava_testing import SPECS, tiny_llava_config
from transformers import GemmaConfig

from tessera.models.llava import LlavaImageGeometry


def test_unknown_language_models_and_towers_are_refused_by_name():
    import dataclasses

    from tessera.models.config import ModelConfig
    from tessera.models.llava import LlavaForConditionalGeneration

    cfg = tiny_llava_config(SPECS["llama"])
    cfg.text_config = GemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(NotImplementedError, match="gemma"):
        LlavaForConditionalGeneration(ModelConfig.from_hf(cfg))
    cfg = tiny_llava_config(dataclasses.replace(SPECS["llama"], text_extra=(("mlp_bias", True),)))
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        LlavaForConditionalGeneration(ModelConfig.from_hf(cfg))
    cfg = tiny_llava_config(SPECS["llama"])
    cfg.vision_config.model_type = "made_up_vision_model"
    with pytest.raises(NotImplementedError, match="made_up_vision_model"):
        LlavaImageGeometry.from_config(cfg)
