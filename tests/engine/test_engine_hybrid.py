"""A hybrid linear-attention model (Qwen3.5) served by the engine: the worker's state pool, 32-token prefill
chunks, and request rows (state slots) reused by later requests give transformers' greedy tokens; speculative
decoding is refused by name."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tests.models.fixture_checks import hf_generate
from tests.models.qwen3_5_testing import make_tiny_qwen3_5_checkpoint

PROMPTS = ["Hello there, how are you today? " * 4, "Tell me a story about a cat and a dog.",
           "One two three four five six seven eight nine ten " * 3]
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_engine_matches_hf_and_refuses_speculative_decoding(tmp_path):
    import transformers

    path = str(make_tiny_qwen3_5_checkpoint(tmp_path / "qwen3_5"))
    # Two rows for three requests: the third runs in a row (state slot) a finished request gave back.
    with Engine(path, page_size=4, max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=2,
                show_progress=False) as engine:
        outs = engine.generate(PROMPTS, SP, return_logprob=True, logprob_start_len=0)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                       attn_implementation="eager").eval()
    lengths = []
    for out in outs:
        ids = [t for _, t in out["meta_info"]["input_token_logprobs"]]
        lengths.append(len(ids))
        want = hf_generate(hf, {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                                               dtype=torch.long)}, 8)
        assert out["output_ids"] == want
    assert max(lengths) > 32  # prefilled in several chunks
    with pytest.raises(RuntimeError, match="speculative_algorithm: .*linear-attention state"):
        Engine(path, speculative_algorithm="NGRAM", show_progress=False)
