"""Trains the bundled demo LoRA adapter: demo-vl answering unsure, on CPU in a few minutes.

    pip install peft   # (the `test` extra) for training only; serving reads the files without it
    python -m demo.train_lora --out tessera/assets/lora/demo-vl-unsure

demo-vl answers the scene questions with one word or a list ("red", "circle", "two", "a red circle and a blue
square"); with this adapter it sounds unsure: "red?", "two?", "a red circle and a blue square?" The facts stay
the base model's: the adapter (rank 8 on the language model's q/k/v/o and gate/up/down; the vision tower
untouched) only learns the ending. Longer restylings were tried first and learnt slowly on 2 cores: whole
sentences ("The circle is red.", "I count two.") put the answer word after a space, another token than
demo-vl's answer token, and counting fell to 0-38% after 150-200 steps (demo-vl: 99%); a hedge spelt in tokens
demo-vl never produced (", I think.") was still at 0% exact after 100. A "?" keeps demo-vl's own answer tokens.
Image questions only: the video questions keep demo-vl's short answers. Batches are a pure function of (seed,
step), as train_vl's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from demo.train_vl import exact_match, make_batch, model_inputs
from tessera.config import ASSETS_DIR
from tessera.demo import scenes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SUFFIX = "?"


def sentence(sample: scenes.Sample) -> str:
    """The sample's answer as the adapter says it (see the module docstring)."""
    return f"{sample.answer}{SUFFIX}"


def restyled(samples: list[scenes.Sample]) -> list[scenes.Sample]:
    return [dataclasses.replace(s, answer=sentence(s)) for s in samples]


def batch(processor, seed: int, step: int, size: int) -> dict:
    rng = random.Random(seed * 1_000_003 + step)
    return make_batch(processor, restyled([scenes.image_sample(rng) for _ in range(size)]))


@torch.no_grad()
def sentence_exact_match(model, processor, samples: list[scenes.Sample]) -> float:
    """Teacher-forced exact match of the sentence answers (equals greedy exact match)."""
    return exact_match(model, [make_batch(processor, restyled(samples))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS_DIR / "lora" / "demo-vl-unsure")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    base = ASSETS_DIR / "demo-vl"
    processor = AutoProcessor.from_pretrained(base)
    model = get_peft_model(Qwen2VLForConditionalGeneration.from_pretrained(base),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed + 1)
    held_out = {q: [scenes.image_sample(rng, q) for _ in range(24)] for q in scenes.IMAGE_QUESTION_TYPES}
    start = time.monotonic()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:  # linear decay to a tenth
            group["lr"] = args.lr * (1 - 0.9 * step / args.steps)
        b = batch(processor, args.seed, step, args.batch_size)
        loss = model(**model_inputs(b), labels=b["labels"]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.monotonic() - start:.0f} s)", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            acc = {q: sentence_exact_match(model, processor, s) for q, s in held_out.items()}
            model.train()
            print(f"step {step + 1} exact match {json.dumps(acc)}", flush=True)
    model.eval()
    model.save_pretrained(args.out)
    config_file = args.out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "demo-vl"  # not this machine's path
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (args.out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template
    print(f"saved {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
