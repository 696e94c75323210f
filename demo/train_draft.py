"""Distils demo-vl-draft, the bundled draft model for STANDALONE speculative decoding on demo-vl, on CPU.

    python -m demo.train_draft --out tessera/assets/demo-vl-draft

The draft (worker/draft_model.py) is a decoder-only Qwen2ForCausalLM over demo-vl's tokenizer: it reads a
request's token ids with the media placeholders as plain tokens (it never sees the pixels) and proposes
greedy drafts that demo-vl verifies. What it must learn is therefore demo-vl's own greedy choice, given only
the text: the teacher's outputs, not the scene grammar's reference answers.

Recipe (why):
- Teacher data from tessera.Engine on demo-vl (the arithmetic the verify step runs): greedy answers to
  scene questions (images and videos, every question type, as demo-vl ends them), and long continuations
  (ignore_eos) of scene prompts and of random-token prompts, for generations past the answer. The token
  sequence of each is the engine's prompt ids (placeholders expanded, as the draft gets them) plus its output.
- Loss: cross-entropy on the output tokens only. Their targets are demo-vl's argmax, so this is the KL to
  its one-hot greedy distribution, the only thing greedy verification checks.
- Size for speed: one decoder layer of width 64 (one head of demo-vl's head size 64, 90K parameters). A draft
  forward is mostly fixed per-call cost on a CPU: one layer at width 256 / 128 / 64 took 0.19 / 0.16 / 0.13 ms
  (1 thread), where demo-vl's 4-layer decode step takes ~0.55 ms in the engine; in `tessera bench spec`
  (random, k = 8) the width-64 draft gave a median 1.4x at batch 1 where a width-256 one (demo-vl's first
  layer, copied) gave 1.2x, at the same acceptance (docs/benchmarks.md). The embedding (tied to the output head)
  starts as demo-vl's projected on its top 64 principal directions; at demo-vl's width (--hidden 256) the
  embedding, the first layer and the final norm are copied instead.
- The answers' content words (which colors, which shapes) are in the image, which the draft cannot see:
  there it can only learn demo-vl's priors. The structure around them (articles, separators, <|im_end|>, a
  shape that is the one not named yet) and the long continuations are where drafts get accepted.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from demo.checkpoint import save_checkpoint
from tessera.config import resolve_model_path
from tessera.demo import scenes

IGNORE = -100
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def draft_config(teacher_dir: Path, num_layers: int, hidden: int | None = None):
    """A Qwen2 text config with demo-vl's vocabulary, head size and special ids, `num_layers` layers and
    `hidden` width (demo-vl's when None; narrower keeps its head size and MLP ratio, with fewer heads)."""
    from transformers import AutoConfig, Qwen2Config

    text = AutoConfig.from_pretrained(teacher_dir).get_text_config()
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("mrope_section", None)  # 1-D positions: equal to demo-vl's M-RoPE on text
    hidden = hidden or text.hidden_size
    head_dim = text.hidden_size // text.num_attention_heads
    heads = max(1, hidden // head_dim)
    kv_heads = max(1, heads * text.num_key_value_heads // text.num_attention_heads)
    return Qwen2Config(
        vocab_size=text.vocab_size, hidden_size=hidden,
        intermediate_size=text.intermediate_size * hidden // text.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads, head_dim=head_dim,
        num_key_value_heads=kv_heads, max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps, tie_word_embeddings=True, rope_parameters=rope,
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
    )


def init_from_teacher(model, teacher_dir: Path) -> int:
    """Copies demo-vl's embedding, final norm and first layers into the draft (same names, same shapes);
    returns how many tensors were copied."""
    from safetensors import safe_open

    own = model.state_dict()
    copied = 0
    with safe_open(str(teacher_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():
            name = key.replace("model.language_model.", "model.")
            if name in own and tuple(own[name].shape) == tuple(f.get_slice(key).get_shape()):
                own[name].copy_(f.get_tensor(key))
                copied += 1
            elif name == "model.embed_tokens.weight" and own[name].shape[1] < f.get_slice(key).get_shape()[1]:
                # Narrower: the embedding's projection on its top principal directions, whose dot products
                # (the tied head's logits) stay closest to the teacher's.
                emb = f.get_tensor(key).float()
                width = own[name].shape[1]
                _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
                own[name].copy_(emb @ v[:width].T)
                copied += 1
    return copied


def _scene_requests(rng: random.Random, engine, num_images: int, num_videos: int) -> list[dict]:
    samples = [scenes.image_sample(rng) for _ in range(num_images)]
    samples += [scenes.video_sample(rng) for _ in range(num_videos)]
    rng.shuffle(samples)
    out = []
    for s in samples:
        prompt = engine.apply_chat_template([{"role": "user", "content": [{"type": s.kind},
                                                                            {"type": "text", "text": s.question}]}])
        out.append({"prompt": prompt, "image": [s.frames[0]] if s.kind == "image" else None,
                    "video": [list(s.frames)] if s.kind == "video" else None})
    return out


def teacher_sequences(teacher: str, seed: int, num_images: int, num_videos: int, num_long_scenes: int,
                      num_random: int, long_len: int, batch_size: int = 64) -> dict[str, list[dict]]:
    """{"answers": [...], "long": [...]}, each {"ids": prompt + output ids, "start": where the output begins}:
    demo-vl's greedy outputs through tessera.Engine."""
    from tessera.entrypoints.engine import Engine

    rng = random.Random(seed)
    out: dict[str, list[dict]] = {"answers": [], "long": []}
    from tessera.models.config import ModelConfig

    vocab = ModelConfig.load(resolve_model_path(teacher)).vocab_size
    with Engine(model_path=teacher, show_progress=False) as engine:
        jobs = [("answers", r, {"temperature": 0, "max_new_tokens": 32})
                for r in _scene_requests(rng, engine, num_images, num_videos)]
        jobs += [("long", r, {"temperature": 0, "max_new_tokens": long_len, "ignore_eos": True})
                 for r in _scene_requests(rng, engine, num_long_scenes * 3 // 4, num_long_scenes // 4)]
        # Random-token prompts (as `tessera bench spec --dataset random` sends, from another seed): what demo-vl
        # does with text it never saw.
        jobs += [("long", {"input_ids": [rng.randrange(20, vocab) for _ in range(rng.randint(16, 96))]},
                  {"temperature": 0, "max_new_tokens": long_len, "ignore_eos": True}) for _ in range(num_random)]
        for b in range(0, len(jobs), batch_size):
            group = jobs[b:b + batch_size]
            # logprob_start_len=0 returns the prompt's ids as the engine expanded them (placeholders included).
            kw = dict(sampling_params=[sp for _, _, sp in group], return_logprob=True, logprob_start_len=0)
            if "input_ids" in group[0][1]:
                outs = engine.generate(input_ids=[r["input_ids"] for _, r, _ in group], **kw)
            else:
                outs = engine.generate([r["prompt"] for _, r, _ in group], image_data=[r["image"] for _, r, _ in group],
                                       video_data=[r["video"] for _, r, _ in group], **kw)
            for (kind, _, _), o in zip(group, outs):
                prompt_ids = [t for _, t in o["meta_info"]["input_token_logprobs"]]
                out[kind].append({"ids": prompt_ids + list(o["output_ids"]), "start": len(prompt_ids)})
            print(f"teacher: {min(b + batch_size, len(jobs))}/{len(jobs)} sequences", flush=True)
    return out


def make_batch(seqs: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) padded on the right; labels are the next token at every output position."""
    width = max(len(s["ids"]) for s in seqs) - 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        x = torch.tensor(s["ids"], dtype=torch.long)
        ids[i, :len(x) - 1] = x[:-1]
        labels[i, s["start"] - 1:len(x) - 1] = x[s["start"]:]
    return ids, labels


@torch.no_grad()
def agreement(model, seqs: list[dict], pad_id: int, batch_size: int = 64) -> float:
    """Teacher-forced share of output tokens where the draft's argmax is demo-vl's: the per-token chance a draft
    is accepted, given the drafts before it were."""
    model.eval()
    hit = total = 0
    for b in range(0, len(seqs), batch_size):
        ids, labels = make_batch(seqs[b:b + batch_size], pad_id)
        pred = model(input_ids=ids).logits.argmax(-1)
        mask = labels != IGNORE
        hit += int((pred[mask] == labels[mask]).sum())
        total += int(mask.sum())
    model.train()
    return hit / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default="demo-vl", help="the target checkpoint (a bundled name or a directory)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, default=Path(".train/demo-vl-draft"), help="teacher data cache")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64, help="width (demo-vl's, 256, copies its first layer)")
    ap.add_argument("--images", type=int, default=2400, help="scene questions on images (greedy answers)")
    ap.add_argument("--videos", type=int, default=600, help="scene questions on videos (greedy answers)")
    ap.add_argument("--long-scenes", type=int, default=200, help="scene prompts continued with ignore_eos")
    ap.add_argument("--random", type=int, default=400, help="random-token prompts continued with ignore_eos")
    ap.add_argument("--long-len", type=int, default=160, help="tokens of each ignore_eos continuation")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--held-out", type=int, default=200, help="answers and continuations kept for evaluation")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    teacher_dir = Path(resolve_model_path(args.teacher))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache = args.work_dir / f"teacher-{args.seed}-{args.images}-{args.videos}-{args.long_scenes}-{args.random}-" \
                            f"{args.long_len}.json"
    t0 = time.time()
    if cache.exists():
        data = json.loads(cache.read_text())
    else:
        data = teacher_sequences(args.teacher, args.seed, args.images, args.videos, args.long_scenes, args.random,
                                 args.long_len)
        cache.write_text(json.dumps(data))
    print(f"teacher data: {len(data['answers'])} answers, {len(data['long'])} continuations "
          f"({time.time() - t0:.0f} s)", flush=True)
    held = {k: v[:args.held_out // 2] for k, v in data.items()}
    # A batch holds one kind: answers (~100 tokens) padded to continuations' length (~250) took 2.5x the time.
    train = {k: v[args.held_out // 2:] for k, v in data.items()}
    kinds, weights = list(train), [len(v) for v in train.values()]

    config = draft_config(teacher_dir, args.layers, args.hidden)
    model = Qwen2ForCausalLM(config)
    print(f"draft: {args.layers} layer(s), {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{init_from_teacher(model, teacher_dir)} tensors from {teacher_dir.name}", flush=True)
    pad = config.pad_token_id
    log = [{"step": 0, **{k: round(agreement(model, v, pad), 4) for k, v in held.items()}}]
    print("eval", json.dumps(log[-1]), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(args.seed)
    model.train()
    for step in range(1, args.steps + 1):
        warm = step / args.warmup
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
        lr = args.lr * (warm if step < args.warmup else 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr
        kind = rng.choices(kinds, weights)[0]
        ids, labels = make_batch(rng.sample(train[kind], args.batch_size), pad)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {time.time() - t0:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            log.append({"step": step, **{k: round(agreement(model, v, pad), 4) for k, v in held.items()}})
            print("eval", json.dumps(log[-1]), flush=True)

    def tokenizer_files(d: Path) -> None:  # the target's tokenizer: the draft also serves on its own
        for name in TOKENIZER_FILES:
            (d / name).write_bytes((teacher_dir / name).read_bytes())

    save_checkpoint(model, args.out, tokenizer_files)
    (args.work_dir / "log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {args.out} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
