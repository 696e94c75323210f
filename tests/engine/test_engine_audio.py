"""Greedy outputs of tessera.Engine on a tiny random Qwen2-Audio checkpoint are token-identical to HF's.

Requests are submitted together, prefill chunks are small enough to cut through the audio spans, and a
repeated clip must be served from the prefix cache with the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tests.audio_testing import INSTRUCTION, RATE, build_tiny_audio_checkpoint, noise, speechlike, tone
from tests.engine.hf_reference import check_speculative_matches, speculative_oracle

MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny_audio(tmp_path_factory):
    return build_tiny_audio_checkpoint(tmp_path_factory.mktemp("tiny-audio-engine"), num_kv_heads=2)


def chat_prompt(processor, num_clips: int, text: str = INSTRUCTION) -> str:
    content = [{"type": "audio"}] * num_clips + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


@torch.no_grad()
def hf_greedy(model, processor, prompt: str, clips: list) -> tuple[list[int], list[float], int]:
    """Greedy tokens without stopping at EOS (the engine side uses ignore_eos) and their logprobs."""
    enc = processor(text=[prompt], audio=clips, sampling_rate=RATE, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
    return ids, logprobs, enc["input_ids"].shape[1]


def test_engine_matches_hf_greedy_on_audio(tiny_audio):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_audio)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(tiny_audio).eval()
    short, pair, longer = [tone(1.1)], [noise(7.3, seed=1), speechlike(2.2, seed=2)], [speechlike(12.0, seed=3)]
    cases = [(chat_prompt(processor, 1), short), (chat_prompt(processor, 2), pair),
             (chat_prompt(processor, 1, "Hello."), longer), (chat_prompt(processor, 0, "Just text."), [])]
    expected = [hf_greedy(model, processor, p, c) if c else None for p, c in cases]
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with Engine(str(tiny_audio), page_size=4, chunked_prefill_size=48, max_running_requests=4,
                max_total_tokens=8192, show_progress=False) as engine:
        outs = engine.generate([p for p, _ in cases], sp, audio_data=[c or None for _, c in cases],
                               return_logprob=True)
        for ref, out in zip(expected, outs):
            if ref is None:  # text only: just runs
                assert len(out["output_ids"]) == MAX_NEW
                continue
            ids, logprobs, prompt_len = ref
            assert out["output_ids"] == ids
            assert out["meta_info"]["prompt_tokens"] == prompt_len
            assert [lp for lp, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=2e-4)
        again = engine.generate(cases[0][0], sp, audio_data=short)
        assert again["output_ids"] == expected[0][0]
        assert again["meta_info"]["cached_tokens"] >= expected[0][2] - 8
    # Speculative decoding (drafts: HF's tokens, every third wrong): HF's tokens still, audio in the prompt.
    audio_cases = [(p, c) for p, c in cases if c]
    prompt_ids = [processor(text=[p], audio=c, sampling_rate=RATE, return_tensors="pt")["input_ids"][0].tolist()
                  for p, c in audio_cases]
    refs = [ref[0] for ref in expected if ref is not None]
    with Engine(str(tiny_audio), page_size=4, chunked_prefill_size=48, max_running_requests=4, max_total_tokens=8192,
                show_progress=False, speculative_algorithm="ORACLE",
                speculative_oracle_path=speculative_oracle(prompt_ids, refs)) as engine:
        check_speculative_matches(engine, engine.generate([p for p, _ in audio_cases], sp,
                                                           audio_data=[c for _, c in audio_cases]), refs)
