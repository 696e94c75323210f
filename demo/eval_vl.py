"""Accuracy of demo-vl with HF transformers greedy generation on held-out scenes.

    python -m demo.eval_vl --model-path tessera/assets/demo-vl [--images 500 --videos 200]
    python -m demo.eval_vl --engine --dtype bfloat16     # Tessera's own tokens, in a format HF lacks

With --engine the answers come from tessera.Engine (the arithmetic a server runs, e.g. a bf16 model's bf16
products on a CPU, which no HF configuration reproduces); without it from HF with the same weights.

Exact match per question type on images and videos from a seed never used in training
(training draws from seeds derived from --seed 1234 and evaluates on 999_999 during training), and on the
copy task (demo/copy_task.py: "Repeat after me:" and a text, answered with the text).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from demo.runs import report
from tessera.demo import copy_task, scenes

HELD_OUT_SEED = 20_261_129
MAX_NEW_TOKENS = 48  # the longest copy answer is ~40 tokens; a scene answer ~16


def held_out(num_images: int, num_videos: int, num_copies: int = 0,
             seed: int = HELD_OUT_SEED) -> list[scenes.Sample]:
    rng = random.Random(seed)
    out = [scenes.image_sample(rng, scenes.IMAGE_QUESTION_TYPES[i % 4]) for i in range(num_images)]
    out += [scenes.video_sample(rng, scenes.VIDEO_QUESTION_TYPES[i % 2]) for i in range(num_videos)]
    out += [scenes.Sample("text", "copy", *copy_task.copy_pair(rng), (), ()) for _ in range(num_copies)]
    return out


def _content(s: scenes.Sample) -> list[dict]:
    return ([{"type": s.kind}] if s.kind != "text" else []) + [{"type": "text", "text": s.question}]


def _media(s: scenes.Sample) -> dict:
    if s.kind == "text":
        return {}
    return {"images": [s.frames[0]]} if s.kind == "image" else {"videos": [list(s.frames)]}


@torch.no_grad()
def hf_answers(model_path: str, samples: list[scenes.Sample], batch_size: int = 16,
               torchao_config: str = "") -> list[str]:
    """torchao_config: HF's language-model linears get the dequantized weights of Tessera's
    --torchao-config (int_linear.fake_quantize_; tests/models/test_int_quant.py checks that the two
    generate the same tokens), so the accuracy is the quantized format's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
    if torchao_config:
        from tessera.layers.quantization.int_linear import fake_quantize_

        if not fake_quantize_(model, torchao_config, "model.language_model."):
            raise ValueError(f"torchao_config: no language-model linears in {model_path}")
    answers = [""] * len(samples)
    for kind in ("image", "video", "text"):
        idx = [i for i, s in enumerate(samples) if s.kind == kind]
        for b in range(0, len(idx), batch_size):
            group = [samples[i] for i in idx[b : b + batch_size]]
            texts = [processor.apply_chat_template([{"role": "user", "content": _content(s)}],
                                                   add_generation_prompt=True, tokenize=False) for s in group]
            media: dict = {}
            for s in group:
                for key, value in _media(s).items():
                    media.setdefault(key, []).extend(value)
            enc = processor(text=texts, padding=True, return_tensors="pt", **media)
            out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            decoded = processor.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, text in zip(idx[b : b + batch_size], decoded):
                answers[i] = text.strip()
    return answers


def engine_answers(model_path: str, samples: list[scenes.Sample], dtype: str = "auto",
                   torchao_config: str = "", batch_size: int = 64) -> list[str]:
    """Greedy answers from tessera.Engine (MAX_NEW_TOKENS at most, as hf_answers), in batches."""
    from tessera.entrypoints.engine import Engine

    answers: list[str] = []
    with Engine(model_path=model_path, dtype=dtype, torchao_config=torchao_config, show_progress=False) as engine:
        for b in range(0, len(samples), batch_size):
            group = samples[b : b + batch_size]
            prompts = [engine.apply_chat_template([{"role": "user", "content": _content(s)}]) for s in group]
            outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
                                   image_data=[[s.frames[0]] if s.kind == "image" else None for s in group],
                                   video_data=[[list(s.frames)] if s.kind == "video" else None for s in group])
            answers += [o["text"].strip() for o in outs]
    return answers


def accuracy(samples: list[scenes.Sample], answers: list[str]) -> dict[str, float]:
    totals: dict[str, list[int]] = {}
    for s, a in zip(samples, answers):
        t = totals.setdefault(s.question_type, [0, 0])
        t[0] += int(a == s.answer)
        t[1] += 1
    return {q: round(c / n, 4) for q, (c, n) in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="tessera/assets/demo-vl")
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--videos", type=int, default=200)
    ap.add_argument("--copies", type=int, default=200, help="copy-task prompts")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--torchao-config", default="", help="evaluate this weight-only quantization "
                                                         "(int8wo, int4wo-32, ...) of the language model")
    ap.add_argument("--engine", action="store_true", help="answers from tessera.Engine instead of HF")
    ap.add_argument("--dtype", default="auto", help="with --engine: the Engine's --dtype (auto, bfloat16, ...)")
    args = ap.parse_args()
    if args.dtype != "auto" and not args.engine:
        ap.error("--dtype is the Engine's: add --engine")
    samples = held_out(args.images, args.videos, args.copies)
    t0 = time.time()
    if args.engine:
        answers = engine_answers(args.model_path, samples, args.dtype, args.torchao_config)
    else:
        answers = hf_answers(args.model_path, samples, torchao_config=args.torchao_config)
    acc = accuracy(samples, answers)
    result = {"model_path": args.model_path, "answers_from": "tessera" if args.engine else "hf",
              "dtype": args.dtype, "torchao_config": args.torchao_config, "images": args.images,
              "videos": args.videos, "copies": args.copies, "seed": HELD_OUT_SEED, "accuracy": acc,
              "seconds": round(time.time() - t0, 1)}
    report(result, args.output_json)


if __name__ == "__main__":
    main()
