"""Stage 5 of demo-vl: the copy task (demo/copy_task.py), fine-tuned from the scene model of stages 1-4.

    python -m demo.train_copy --base .train/demo-vl/scenes --out tessera/assets/demo-vl

Why a stage of its own: speculative decoding's prompt lookup needs answers that repeat their prompt, and the
scene answers never do. Recipe: the language model only (the vision tower is frozen: copying needs none of
it), each step a batch of copy pairs plus a batch of scene questions replayed as stages 3-4 drew them, with
stage 4's attention supervision kept on, so the scene answers stay what they were (the evaluation every
--eval-every steps scores both), and CopyProbe's attention loss. Resumable like train_vl: batches are a pure
function of (seed, step); the defaults reproduce the shipped checkpoint (docs/demo-vl-training.md, stage 5).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from demo.attention_probe import AttentionProbe, capture_attention
from demo.checkpoint import save_checkpoint
from demo.runs import out_of_time, resume, save_state
from demo.train_vl import IGNORE, batch_for_step, eval_set, evaluate, exact_match, model_inputs
from tessera.demo import copy_task, scenes

EVAL_SEED = 999_999


def copy_batch(processor, pairs: list[tuple[str, str]]) -> dict:
    """Chats "user: <question>" -> "<answer><|im_end|>", labels on the answer and <|im_end|> only.

    copy_source: for CopyProbe, per answer position (the one whose logits give answer token j)
    the prompt position of the token it copies (the text's token j; its <|im_end|> for the end), -1 elsewhere.
    The prompt's text starts a line, as the answer does, so the two tokenize alike, token for token."""
    tok = processor.tokenizer
    prompts = [processor.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q, _ in pairs]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    rows = [ids + tok(a + "<|im_end|>")["input_ids"] for ids, (_, a) in zip(prompt_ids, pairs)]
    input_ids, mask = padded(rows, tok.pad_token_id)
    labels = torch.full_like(input_ids, IGNORE)
    source = torch.full_like(input_ids, -1)
    for i, (p, ids, row, (q, _)) in enumerate(zip(prompts, prompt_ids, rows, pairs)):
        start = len(ids)
        labels[i, start:len(row)] = input_ids[i, start:len(row)]
        text_start = len(tok(p[:p.index(q)] + copy_task.PREFIX)["input_ids"])
        n = len(row) - start  # the answer's tokens and <|im_end|>
        source[i, start - 1:start - 1 + n] = torch.arange(text_start, text_start + n)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "copy_source": source}


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token rows padded on the right to the longest."""
    ids = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return ids, mask


class CopyProbe:
    """Teaches copying through attention, as stage 4 taught lookups (demo/attention_probe.py): one head of
    layer 1 looks from each position to the one before it (what an induction head builds on) and one head of
    layer 3 from each answer position to the prompt token the answer copies next. Trained on the answers alone
    the loss sat at the word distribution's entropy (~2.2 nats) for 260 steps: the model had not found a way to
    look the next word up. Other heads than the binding probe's (head 0 of layers 0 and 2)."""

    def __init__(self, model, prev_layer: int = 1, copy_layer: int = 3, head: int = 1):
        self.prev_layer, self.copy_layer, self.head = prev_layer, copy_layer, head
        self.maps = capture_attention(model, [prev_layer, copy_layer])

    def loss(self, batch: dict) -> torch.Tensor:
        source = batch["copy_source"]
        b, q = (source >= 0).nonzero(as_tuple=True)
        copy = self.maps[self.copy_layer][b, self.head, q, source[b, q]]
        valid = batch["attention_mask"].bool()
        valid[:, 0] = False
        pb, pq = valid.nonzero(as_tuple=True)
        prev = self.maps[self.prev_layer][pb, self.head, pq, pq - 1]
        return -torch.log(copy + 1e-6).mean() - torch.log(prev + 1e-6).mean()


def conversation_batch(processor, rng: random.Random, n: int) -> dict:
    """Follow-up questions about one image: 2-3 turns, the image in the first, every answer labelled. Stages 1-4
    saw single questions only, and a third turn's "What color is the circle?" was a near tie there (red -3.6
    against blue -4.2 in log-probability); the copy task's text-only turns tipped it."""
    texts, images = [], []
    for _ in range(n):
        scene = scenes.random_scene(rng)
        turns = [scenes.ask(scene, q, rng.choice(scene.shapes))
                 for q in rng.sample(scenes.IMAGE_QUESTION_TYPES, rng.randint(2, 3))]
        msgs: list[dict] = []
        for i, (q, a) in enumerate(turns):
            content = [{"type": "image"}, {"type": "text", "text": q}] if i == 0 else q
            msgs += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
        texts.append(processor.apply_chat_template(msgs, tokenize=False))
        images.append(scenes.render(scene))
    enc = processor(text=texts, images=images, padding=True, return_tensors="pt")
    ids, tok = enc["input_ids"], processor.tokenizer
    start, end, assistant = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "assistant"))
    labels = torch.full_like(ids, IGNORE)
    for i in range(len(texts)):
        row = ids[i].tolist()
        for p in range(len(row) - 2):
            if row[p] == start and row[p + 1] == assistant:
                stop = row.index(end, p + 3)
                labels[i, p + 3:stop + 1] = ids[i, p + 3:stop + 1]  # the answer and its <|im_end|>
    return {**{k: enc[k] for k in enc if k != "labels"}, "labels": labels}


ANCHOR_QUESTIONS = ("Count the shapes.", "Is there a red circle?", "What is in the picture?", "Hello!",
                    "Describe the video.", "Which way is it moving?", "Tell me about the objects.")


@torch.no_grad()
def anchor_pool(teacher, processor, seed: int, n: int, new_tokens: int = 24) -> list[list[int]]:
    """Text-only chats (no image) with the stage-4 model's own greedy continuations: the copy task is text-only,
    and trained without these the model took to answering any text-only turn with a run of copied-looking words
    (json_object output for "Count the shapes." went from "{}" to an unterminated string). The student is held
    to the teacher's distributions over these (KL at every position)."""
    from tessera.demo.build_vl import GENERIC_TEXT

    rng = random.Random(seed)
    lines = [line for line in GENERIC_TEXT.splitlines() if line]
    prompts = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            q = rng.choice(ANCHOR_QUESTIONS)
        elif kind == 1:  # a scene question without its image
            scene = scenes.random_scene(rng)
            q = scenes.ask(scene, rng.choice(scenes.IMAGE_QUESTION_TYPES), rng.choice(scene.shapes))[0]
        elif kind == 2:
            q = rng.choice(lines)
        else:  # words that are not asked back: the copy task's texts without its request
            q = copy_task.copy_text(rng)
        prompts.append(processor.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=False))
    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, "left"  # generate() continues each row from its end
    out = []
    for b in range(0, n, 32):
        enc = tok(prompts[b:b + 32], return_tensors="pt", padding=True)
        gen = teacher.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
        mask = torch.cat([enc["attention_mask"], torch.ones_like(gen[:, enc["input_ids"].shape[1]:])], 1).bool()
        out += [row[keep].tolist() for row, keep in zip(gen, mask)]
    tok.padding_side = side
    return out


def anchor_loss(model, teacher, pool: list[list[int]], rng: random.Random, n: int, pad: int) -> torch.Tensor:
    """KL(teacher || student) at every position of n chats of the anchor pool."""
    ids, mask = padded(rng.sample(pool, n), pad)
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits, -1)
    logp = F.log_softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
    kl = (target.exp() * (target - logp)).sum(-1)
    return (kl * mask).sum() / mask.sum()


def copy_pairs(seed: int, step: int, n: int) -> list[tuple[str, str]]:
    rng = random.Random(seed * 1_000_003 + step)
    return [copy_task.copy_pair(rng) for _ in range(n)]


def copy_exact_match(model, processor, pairs: list[tuple[str, str]], batch_size: int = 32) -> float:
    """Teacher-forced exact match of the copies (equals greedy exact match)."""
    return exact_match(model, [copy_batch(processor, pairs[i:i + batch_size])
                               for i in range(0, len(pairs), batch_size)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path(".train/demo-vl/scenes"), help="the scene model (stage 4)")
    ap.add_argument("--work-dir", type=Path, default=Path(".train/demo-vl-copy"))
    ap.add_argument("--out", type=Path, default=Path("tessera/assets/demo-vl"))
    ap.add_argument("--steps", type=int, default=640)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--decay-steps", type=int, default=240)
    ap.add_argument("--copy-batch", type=int, default=24)
    ap.add_argument("--scene-batch", type=int, default=16)
    ap.add_argument("--bind-weight", type=float, default=1.0)
    ap.add_argument("--probe-weight", type=float, default=0.5, help="CopyProbe's attention loss")
    ap.add_argument("--conversation-batch", type=int, default=6, help="follow-up conversations per step")
    ap.add_argument("--anchor-batch", type=int, default=12, help="text-only chats held to the teacher per step")
    ap.add_argument("--anchor-pool", type=int, default=512)
    ap.add_argument("--anchor-weight", type=float, default=1.0)
    ap.add_argument("--video-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=175.0)
    args = ap.parse_args()

    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    processor = AutoProcessor.from_pretrained(args.base)
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.base, torch_dtype=torch.float32)
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})  # the probe reads attention
    probe = AttentionProbe(model)
    copy_probe = CopyProbe(model)
    teacher = Qwen2VLForConditionalGeneration.from_pretrained(args.base, torch_dtype=torch.float32).eval()
    anchors = anchor_pool(teacher, processor, args.seed, args.anchor_pool)
    model.model.visual.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    step, log, state = resume(args.work_dir, model=model)
    if state is not None:
        opt.load_state_dict(state["opt"])
    held_copy = copy_pairs(EVAL_SEED, 0, 128)
    held_scenes = eval_set(seed=EVAL_SEED, per_type=32)
    held_talk = [conversation_batch(processor, random.Random(EVAL_SEED + i), 16) for i in range(4)]

    def evaluation() -> dict:
        row = {"step": step, "copy": round(copy_exact_match(model, processor, held_copy), 4),
               "conversation": round(exact_match(model, held_talk), 4)}
        row.update({k: round(v, 4) for k, v in evaluate(model, processor, held_scenes).items()})
        log.append(row)
        print("eval", json.dumps(row), flush=True)
        return row

    def files(d: Path) -> None:
        for f in args.base.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
                shutil.copy(f, d / f.name)

    def lr_at(s: int) -> float:
        """Warm-up, the peak, then a cosine down to 5% over the last --decay-steps (the scene answers moved
        most while the rate was at its peak)."""
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        p = max(0.0, (s - (args.steps - args.decay_steps)) / args.decay_steps)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    if step == 0:
        evaluation()
    model.train()
    t_start = t_last = time.time()
    while step < args.steps:
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        cb = copy_batch(processor, copy_pairs(args.seed, step, args.copy_batch))
        copy_loss = model(input_ids=cb["input_ids"], attention_mask=cb["attention_mask"], labels=cb["labels"]).loss
        probe_loss = copy_probe.loss(cb)  # before the scene forward replaces the attention maps
        rng = random.Random(args.seed * 1_000_003 + step + 1)
        talk = conversation_batch(processor, rng, args.conversation_batch)
        talk_loss = model(**model_inputs(talk), labels=talk["labels"]).loss
        keep = anchor_loss(model, teacher, anchors, rng, args.anchor_batch, processor.tokenizer.pad_token_id)
        sb = batch_for_step(processor, args.seed, step, args.scene_batch, args.video_fraction, focus_from=0)
        scene_loss = model(**model_inputs(sb), labels=sb["labels"]).loss
        bind_loss = probe.loss(sb)  # the scene batch's attention maps: its forward came last
        loss = (copy_loss + args.probe_weight * probe_loss + scene_loss + args.bind_weight * bind_loss
                + talk_loss + args.anchor_weight * keep)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            print(f"step {step} copy {copy_loss.item():.4f} probe {probe_loss.item():.4f} "
                  f"talk {talk_loss.item():.4f} anchor {keep.item():.4f} scenes {scene_loss.item():.4f} "
                  f"bind {bind_loss.item():.4f} {(time.time() - t_last) / 10:.2f}s/step", flush=True)
            t_last = time.time()
        if step % args.eval_every == 0 or step == args.steps:
            evaluation()
        if step % args.save_every == 0 or step == args.steps:
            save_state(args.work_dir, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, log)
        if out_of_time(t_start, args.max_minutes):
            break
    if step >= args.steps:
        save_checkpoint(model, args.out, files)


if __name__ == "__main__":
    main()
