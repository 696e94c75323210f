"""A hybrid linear-attention model (Qwen3.5) served by the engine: the worker's state pool, 32-token prefill
chunks, an image, and request rows (state slots) reused by later requests give transformers' greedy tokens, with
and without overlap scheduling; speculative decoding is refused by name."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tests.distributed.test_tensor_parallel import _chat
from tests.models.fixture_checks import hf_generate
from tests.models.qwen3_5_testing import make_tiny_qwen3_5_checkpoint

TEXTS = ["Hello there, how are you today? " * 4, "Tell me a story about a cat and a dog.",
         "One two three four five six seven eight nine ten " * 3]
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_engine_matches_hf_with_overlap_and_refuses_speculative_decoding(tmp_path, scene_images):
    import transformers

    path = str(make_tiny_qwen3_5_checkpoint(tmp_path / "qwen3_5"))
    image_chat = _chat(path, [{"type": "image"}, {"type": "text", "text": "Describe it."}])
    # Two rows for four requests: the later ones run in rows (state slots) that finished requests gave back.
    with Engine(path, page_size=4, max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=2,
                show_progress=False) as engine:
        outs = engine.generate(TEXTS + [image_chat], SP, image_data=[None] * len(TEXTS) + [[scene_images[0]]],
                               return_logprob=True, logprob_start_len=0)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                       attn_implementation="eager").eval()
    lengths = []
    for out in outs[:len(TEXTS)]:
        ids = [t for _, t in out["meta_info"]["input_token_logprobs"]]
        lengths.append(len(ids))
        mask = torch.ones(1, len(ids), dtype=torch.long)
        assert out["output_ids"] == hf_generate(hf, {"input_ids": torch.tensor([ids]), "attention_mask": mask}, 8)
    assert max(lengths) > 32  # prefilled in several chunks
    inputs = transformers.AutoProcessor.from_pretrained(path)(text=[image_chat], images=[scene_images[0]],
                                                               return_tensors="pt")
    assert outs[-1]["output_ids"] == hf_generate(hf, dict(inputs), 8)
    # Overlap scheduling: the next step is formed while this one runs; the states still see every token in order.
    with Engine(path, page_size=4, max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=2,
                enable_overlap_schedule=True, show_progress=False) as engine:
        overlapped = engine.generate(TEXTS + [image_chat], SP, image_data=[None] * len(TEXTS) + [[scene_images[0]]])
    assert [o["output_ids"] for o in overlapped] == [o["output_ids"] for o in outs]
    with pytest.raises(RuntimeError, match="speculative_algorithm: .*linear-attention state"):
        Engine(path, speculative_algorithm="NGRAM", show_progress=False)
