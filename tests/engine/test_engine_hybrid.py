"""A hybrid linear-attention model (Qwen3.5) served by the engine: the worker's state pool, 32-token prefill
chunks, an image, and request rows (state slots) reused by later requests give transformers' greedy tokens, with
and without overlap scheduling and with speculative decoding. The prefix cache resumes a repeated
two-image prompt and the chat's next turn from state snapshots, with transformers' tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tessera import Engine
from tests.distributed.test_tensor_parallel import _chat
from tests.engine.hf_reference import check_speculative_matches, speculative_oracle
from tests.models.fixture_checks import hf_generate, save_random_model
from tests.models.qwen3_5_testing import make_tiny_qwen3_5_checkpoint

TEXTS = ["Hello there, how are you today? " * 4, "Tell me a story about a cat and a dog.",
         "One two three four five six seven eight nine ten " * 3]
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_engine_matches_hf_with_overlap_and_speculative_decoding(tmp_path, scene_images):
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
    # Speculative decoding (drafts: these tokens, every third wrong): the state rolls back to the last accepted one
    # (with the radix cache off too: the rollback does not need it).
    prompt_ids = [[t for _, t in o["meta_info"]["input_token_logprobs"]] for o in outs[:len(TEXTS)]]
    oracle = speculative_oracle(prompt_ids + [inputs["input_ids"][0].tolist()], [o["output_ids"] for o in outs])
    with Engine(path, page_size=4, max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=2,
                speculative_algorithm="ORACLE", speculative_oracle_path=oracle, disable_radix_cache=True,
                show_progress=False) as engine:
        spec = engine.generate(TEXTS + [image_chat], SP, image_data=[None] * len(TEXTS) + [[scene_images[0]]])
        check_speculative_matches(engine, spec, [o["output_ids"] for o in outs])


def _prefix_case(name: str, tmp_path, images: list) -> tuple[str, torch.nn.Module, list[int], dict]:
    """(checkpoint, HF model, prompt ids with one placeholder per image, HF's inputs): Qwen3.5 dense or MoE with
    two images, or Qwen3-Next text (the Qwen3.5 fixture's tokenizer beside it)."""
    import transformers

    q35 = make_tiny_qwen3_5_checkpoint(tmp_path / "qwen3_5", "moe" if name == "qwen3_5_moe" else "dense")
    processor = transformers.AutoProcessor.from_pretrained(q35)
    if name == "qwen3_next":
        from tests.models.qwen3_5_testing import make_hybrid_can_fail_, tiny_qwen3_next_config

        path = tmp_path / "qwen3_next"
        config = tiny_qwen3_next_config(processor.tokenizer.vocab_size)
        hf = save_random_model(path, transformers.Qwen3NextForCausalLM, config, 3,
                               lambda m: make_hybrid_can_fail_(m, 3))
        processor.tokenizer.save_pretrained(path)
        ids = processor.tokenizer("Tell me about cats and dogs and birds. " * 4).input_ids
        return str(path), hf, ids, {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                                                  dtype=torch.long)}
    hf = getattr(transformers, json.loads((q35 / "config.json").read_text())["architectures"][0]).from_pretrained(
        q35, dtype=torch.float32, attn_implementation="eager").eval()
    chat = _chat(str(q35), [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}])
    return str(q35), hf, processor.tokenizer(chat).input_ids, dict(processor(text=[chat], images=images,
                                                                                return_tensors="pt"))


@pytest.mark.parametrize("name, page", [("qwen3_5", 1), ("qwen3_next", 4),
                                        pytest.param("qwen3_5_moe", 1, marks=pytest.mark.slow)])
def test_prefix_cache_resumes_a_repeated_prompt_and_the_next_turn(name, page, tmp_path, scene_images):
    """A repeated prompt resumes from the snapshot its prefill saved, the chat's next turn (the prompt, its answer,
    more text) from the first request's KV and state at their end (pages of 4: at its last whole page), also in a
    mixed batch; every answer is transformers'."""
    images = list(scene_images[:2]) if name != "qwen3_next" else None
    path, hf, ids, inputs = _prefix_case(name, tmp_path, images or [])
    more = [11, 12, 13, 14]
    with Engine(path, max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=2, page_size=page,
                show_progress=False) as engine:
        first, again = (engine.generate(input_ids=ids, image_data=images, sampling_params=SP) for _ in range(2))
        turn = engine.generate(input_ids=ids + first["output_ids"] + more, image_data=images, sampling_params=SP)
        stats = engine.get_stats()
        # A mixed batch in two rows: both hits again, beside a text prompt that misses.
        other = list(range(40, 80))
        mixed = engine.generate(input_ids=[ids, ids + first["output_ids"] + more, other],
                                image_data=[images, images, None], sampling_params=SP)
    prompt_len = inputs["input_ids"].shape[1]
    snapshot = (prompt_len - 1) // page * page  # the prompt's last whole page before its last token
    kv_end = prompt_len + 8 - 1  # the first request's KV: the last sampled token never went through a forward
    hits = [o["meta_info"]["cached_tokens"] for o in (first, again, turn)]
    assert prompt_len > 32 and hits[:2] == [0, snapshot]  # prefilled in several chunks, then from its snapshot
    # The next turn: from the first request's state at its KV's last whole page, copied out or saved by the decode
    # step that completed that page (one inside the prompt: an earlier snapshot).
    last_page = kv_end // page * page
    assert hits[2] == last_page if last_page > prompt_len else snapshot <= hits[2] <= last_page
    want = hf_generate(hf, inputs, 8)
    assert first["output_ids"] == again["output_ids"] == want
    extra = torch.tensor([want + more])
    for key in ("attention_mask", "mm_token_type_ids"):  # per token: the new ones are attended text
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], torch.full_like(extra, key == "attention_mask")], 1)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    assert turn["output_ids"] == hf_generate(hf, inputs, 8)
    assert stats.prefix_hit_tokens == sum(hits) and stats.state_snapshots >= 3
    text = {"input_ids": torch.tensor([other]), "attention_mask": torch.ones(1, len(other), dtype=torch.long)}
    assert [o["output_ids"] for o in mixed] == [want, turn["output_ids"], hf_generate(hf, text, 8)]
    turn_len = prompt_len + 8 + len(more)  # the turn's prompt now hits its own prompt snapshot
    assert [o["meta_info"]["cached_tokens"] for o in mixed] == [snapshot, (turn_len - 1) // page * page, 0]
