"""Accuracy of demo-asr with HF transformers greedy generation on held-out utterances.

    python -m demo.eval_asr --model-path tessera/assets/demo-asr [--num 300]

Exact-match transcripts (and word accuracy, aligned position by position) on utterances of the
grammar synthesised with espeak-ng from a seed never used in training (training draws from seed
1234 and evaluates on 999_999 during training). Needs espeak-ng.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from demo.runs import report
from tessera.demo import speech

HELD_OUT_SEED = 20_261_129


def held_out(num: int, seed: int = HELD_OUT_SEED) -> list[speech.Utterance]:
    return [speech.utterance_for(seed, i) for i in range(num)]


@torch.no_grad()
def hf_transcripts(model_path: str, clips: list[np.ndarray], batch_size: int = 32) -> list[str]:
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_path)
    processor.tokenizer.padding_side = "left"
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_path).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": speech.INSTRUCTION}]}],
        add_generation_prompt=True, tokenize=False)
    out: list[str] = []
    for b in range(0, len(clips), batch_size):
        group = clips[b : b + batch_size]
        enc = processor(text=[prompt] * len(group), audio=group, sampling_rate=speech.RATE, padding=True,
                        return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=24, do_sample=False)
        out += [t.strip() for t in processor.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]
    return out


def scores(refs: list[str], hyps: list[str]) -> dict[str, float]:
    exact = sum(r == h for r, h in zip(refs, hyps))
    words = sum(len(r.split()) for r in refs)
    right = sum(a == b for r, h in zip(refs, hyps) for a, b in zip(r.split(), h.split()))
    return {"exact_match": round(exact / len(refs), 4), "word_accuracy": round(right / words, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="tessera/assets/demo-asr")
    ap.add_argument("--num", type=int, default=300)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    utts = held_out(args.num)
    clips = [speech.synthesize(u) for u in utts]
    t0 = time.time()
    hyps = hf_transcripts(args.model_path, clips)
    refs = [u.transcript for u in utts]
    # The same clips inside a longer recording: 0.5 s of silence before, 1.5 s after (what a user's clip or a
    # window of a long recording looks like; the training data has next to none).
    quiet = [np.concatenate([np.zeros(speech.RATE // 2, np.float32), c, np.zeros(3 * speech.RATE // 2, np.float32)])
             for c in clips]
    padded = scores(refs, hf_transcripts(args.model_path, quiet))
    by_len: dict[int, list[int]] = {}
    for r, h in zip(refs, hyps):
        t = by_len.setdefault(len(r.split()), [0, 0])
        t[0] += int(r == h)
        t[1] += 1
    result = {"model_path": args.model_path, "utterances": args.num, "seed": HELD_OUT_SEED, **scores(refs, hyps),
              "exact_match_by_words": {n: round(c / k, 4) for n, (c, k) in sorted(by_len.items())},
              "with_silence": padded,
              "errors": [{"ref": r, "hyp": h} for r, h in zip(refs, hyps) if r != h][:20],
              "seconds": round(time.time() - t0, 1)}
    report(result, args.output_json)


if __name__ == "__main__":
    main()
