"""Trains demo-vl (HF Qwen2VLForConditionalGeneration) on the scene grammar, on CPU.

    python -m tessera.demo.train_vl --work-dir .train/demo-vl --out tessera/assets/demo-vl

Resumable: the work dir holds the latest checkpoint (model, optimizer, step); batches are
a pure function of (seed, step), so a resumed run sees exactly the data it would have, and the
default command reproduces the shipped checkpoint (up to floating-point thread nondeterminism).

Recipe (why):
- Few image tokens: every image is resized to about 224x224 px of area (64 tokens), video
  frames to 112x112 px; small canvases are scaled up so their shapes get enough patches
  (from RESOLUTION_SWITCH_STEP on; earlier steps used HF's default minimum area).
- A curriculum from one shape to three (curriculum_max_shapes), warmup + cosine LR.
- Auxiliary per-token losses on the vision tower's merged output (linear heads, dropped from the
  saved model): the shape and color under each token from the start, because shape recognition
  is what a plain LM loss learns slowest; from EXTRA_HEADS_STEP also the motion direction of video
  tokens (a temporal patch holds two frames, so one token can see it) and the horizontal band of
  the shape (left-to-right order for "Describe the image."), which rotary positions give the
  language model only indirectly.
- Evaluation every --eval-every steps by question type (teacher-forced exact match, which equals
  greedy exact match); the curve is kept in the work dir's log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tessera.demo import scenes
from tessera.demo.build_vl import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS_PHASE1, build_processor_files, build_skeleton

IGNORE = -100
# Steps before this one resized small images less (HF's default minimum area); from here on every
# image gets the checkpoint's fixed area. Kept so that retraining reproduces the shipped model.
RESOLUTION_SWITCH_STEP = 800
# The motion and position heads join here, with a fresh optimizer and a 50-step re-warmup (the
# shipped run added them at this step after seeing shape and direction stall near chance).
EXTRA_HEADS_STEP = 1100


def curriculum_max_shapes(step: int) -> int:
    return 1 if step < 300 else 2 if step < 900 else 3


NUM_XBINS = 8


def token_labels(sample: scenes.Sample, grid_thw: list[int], patch: int, merge: int) -> dict[str, np.ndarray]:
    """Per merged vision token: what lies under it, for the auxiliary heads.

    shape / color: class of the shape covering the token (0 = background).
    direction: for video tokens on the shape, its motion (1 + index in DIRECTIONS); ignored elsewhere.
      A temporal patch holds two frames, so the motion is visible to one token.
    xbin: for tokens on a shape, which of NUM_XBINS vertical bands of the canvas the shape's centre
      is in (1-based); ignored elsewhere. It puts left-to-right order into the features, which
      "Describe the image." needs and rotary positions give the language model only indirectly.
    """
    t, gh, gw = grid_thw
    h, w = gh * patch, gw * patch
    block = patch * merge
    out: dict[str, list[np.ndarray]] = {"shape": [], "color": [], "direction": [], "xbin": []}
    direction = (1 + scenes.DIRECTIONS.index(sample.answer.split()[-1])) if sample.kind == "video" else IGNORE
    for ti in range(t):
        scene = sample.scenes[min(2 * ti, len(sample.scenes) - 1)]
        smap, cmap = scenes.label_maps(scene)
        ys = (np.arange(h) * scene.height / h).astype(int)  # nearest-neighbour resize
        xs = (np.arange(w) * scene.width / w).astype(int)
        best_shape = None
        for name, lab, ncls in (("shape", smap, 4), ("color", cmap, 7)):
            r = lab[ys][:, xs].reshape(gh // merge, block, gw // merge, block).transpose(0, 2, 1, 3)
            r = r.reshape(gh // merge, gw // merge, block * block)
            counts = np.stack([(r == c).sum(-1) for c in range(ncls)], -1)
            counts[..., 0] = 0
            best = counts.argmax(-1)
            best[counts.max(-1) < 0.15 * block * block] = 0
            out[name].append(best.reshape(-1))
            if name == "color":
                best_shape = best.reshape(-1)
        fg = best_shape > 0
        out["direction"].append(np.where(fg, direction, IGNORE))
        xbin = np.full(fg.shape, IGNORE)
        colors = list(scenes.COLORS)
        for sh in scene.shapes:
            on = best_shape == 1 + colors.index(sh.color)
            xbin[on] = 1 + min(NUM_XBINS - 1, int(sh.center_x / scene.width * NUM_XBINS))
        out["xbin"].append(xbin)
    return {k: np.concatenate(v) for k, v in out.items()}


def chat_text(processor, sample: scenes.Sample, answer: bool) -> str:
    media = {"type": "image"} if sample.kind == "image" else {"type": "video"}
    msgs = [{"role": "user", "content": [media, {"type": "text", "text": sample.question}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return text + (sample.answer + "<|im_end|>\n" if answer else "")


def make_batch(processor, samples: list[scenes.Sample], with_answer: bool = True,
               image_min_pixels: int | None = None) -> dict:
    texts = [chat_text(processor, s, with_answer) for s in samples]
    kind = samples[0].kind
    if kind == "image":
        kw = {}
        if image_min_pixels is not None:
            kw["images_kwargs"] = {"size": {"shortest_edge": image_min_pixels, "longest_edge": IMAGE_MAX_PIXELS}}
        enc = processor(text=texts, images=[s.frames[0] for s in samples], padding=True, return_tensors="pt", **kw)
        grids = enc["image_grid_thw"].tolist()
    else:
        enc = processor(text=texts, videos=[list(s.frames) for s in samples], padding=True, return_tensors="pt")
        grids = enc["video_grid_thw"].tolist()
    ip = processor.image_processor
    labs = [token_labels(s, g, ip.patch_size, ip.merge_size) for s, g in zip(samples, grids)]
    for key in ("shape", "color", "direction", "xbin"):
        enc[f"aux_{key}"] = torch.from_numpy(np.concatenate([lab[key] for lab in labs])).long()
    # LM labels: the answer tokens and the closing <|im_end|>, nothing of the prompt.
    ids = enc["input_ids"]
    labels = torch.full_like(ids, IGNORE)
    start_tok = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    for i in range(len(samples)):
        valid = enc["attention_mask"][i].bool()
        pos = (ids[i] == start_tok).nonzero().flatten()
        a0 = int(pos[-1]) + 3 if with_answer else int(valid.sum())  # <|im_start|> assistant \n
        end = int(valid.nonzero().max()) + 1
        labels[i, a0 : end - 1] = ids[i, a0 : end - 1]  # drop the trailing "\n"
    enc["labels"] = labels
    enc["answers"] = [s.answer for s in samples]
    enc["qtypes"] = [s.question_type for s in samples]
    return enc


def batch_for_step(processor, seed: int, step: int, batch_size: int, video_fraction: float) -> dict:
    rng = random.Random(seed * 1_000_003 + step)
    if rng.random() < video_fraction:
        samples = [scenes.video_sample(rng) for _ in range(batch_size // 2)]  # videos are longer
    else:
        ms = curriculum_max_shapes(step)
        samples = [scenes.image_sample(rng, max_shapes=ms) for _ in range(batch_size)]
        if step < RESOLUTION_SWITCH_STEP:
            return make_batch(processor, samples, image_min_pixels=IMAGE_MIN_PIXELS_PHASE1)
    return make_batch(processor, samples)


class StepBatches(torch.utils.data.IterableDataset):
    def __init__(self, model_dir: str, seed: int, start: int, batch_size: int, video_fraction: float):
        self.model_dir, self.seed, self.start = model_dir, seed, start
        self.batch_size, self.video_fraction = batch_size, video_fraction

    def __iter__(self):
        from transformers import AutoProcessor

        torch.set_num_threads(1)
        processor = AutoProcessor.from_pretrained(self.model_dir)
        step = self.start
        while True:
            yield batch_for_step(processor, self.seed, step, self.batch_size, self.video_fraction)
            step += 1


class AuxHeads(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.shape = torch.nn.Linear(dim, 4)
        self.color = torch.nn.Linear(dim, 7)
        self.direction = torch.nn.Linear(dim, 1 + len(scenes.DIRECTIONS))
        self.xbin = torch.nn.Linear(dim, 1 + NUM_XBINS)

    def loss(self, merged: torch.Tensor, batch: dict, step: int) -> torch.Tensor:
        if step < EXTRA_HEADS_STEP:  # the first phase of the shipped recipe
            return F.cross_entropy(self.shape(merged), batch["aux_shape"]) + F.cross_entropy(
                self.color(merged), batch["aux_color"])
        # Shape is what the tower learns slowest, so it weighs double.
        total = 2.0 * F.cross_entropy(self.shape(merged), batch["aux_shape"])
        total = total + F.cross_entropy(self.color(merged), batch["aux_color"])
        for key in ("direction", "xbin"):
            target = batch[f"aux_{key}"]
            if bool((target != IGNORE).any()):
                total = total + F.cross_entropy(getattr(self, key)(merged), target, ignore_index=IGNORE)
        return total


def model_inputs(batch: dict) -> dict:
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: batch[k] for k in keys if k in batch}


@torch.no_grad()
def evaluate(model, processor, samples_by_type: dict[str, list[scenes.Sample]], batch_size: int = 32) -> dict[str, float]:
    """Teacher-forced exact match: every answer token (and <|im_end|>) is the argmax.

    This equals greedy exact match: greedy reproduces the answer iff each step's argmax does.
    """
    model.eval()
    acc = {}
    for qtype, samples in samples_by_type.items():
        correct = 0
        for i in range(0, len(samples), batch_size):
            batch = make_batch(processor, samples[i : i + batch_size])
            logits = model(**model_inputs(batch)).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            ok = (logits.argmax(-1) == labels) | (labels == IGNORE)
            correct += int(ok.all(-1).sum())
        acc[qtype] = correct / len(samples)
    model.train()
    return acc


def eval_set(seed: int, per_type: int) -> dict[str, list[scenes.Sample]]:
    rng = random.Random(seed)
    out = {q: [scenes.image_sample(rng, q) for _ in range(per_type)] for q in scenes.IMAGE_QUESTION_TYPES}
    out.update({q: [scenes.video_sample(rng, q) for _ in range(per_type // 2)] for q in scenes.VIDEO_QUESTION_TYPES})
    return out


def save_model(model, skeleton_dir: Path, out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(skeleton_dir, tmp)
    build_processor_files(tmp)  # the processor files and chat template of the current code
    model.save_pretrained(tmp, safe_serialization=True)
    gen = {"do_sample": False, "eos_token_id": [model.config.text_config.eos_token_id,
                                                model.config.text_config.pad_token_id],
           "pad_token_id": model.config.text_config.pad_token_id, "max_new_tokens": 32}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=Path(".train/demo-vl"))
    ap.add_argument("--out", type=Path, default=Path("tessera/assets/demo-vl"))
    ap.add_argument("--steps", type=int, default=2600, help="length of the LR schedule")
    ap.add_argument("--stop-step", type=int, default=2000,
                    help="stop (and save) after this step; the shipped run was cut here for time, its "
                         "schedule planned for --steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--aux-weight", type=float, default=0.5)
    ap.add_argument("--video-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=175.0, help="stop (after saving) when exceeded")
    args = ap.parse_args()

    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    skel = args.work_dir / "skeleton"
    config = build_skeleton(skel)
    processor = AutoProcessor.from_pretrained(skel)
    model = Qwen2VLForConditionalGeneration(config)
    aux = AuxHeads(config.text_config.hidden_size)
    params = list(model.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step, log = 0, []
    rewarm_from: int | None = None  # step at which the optimizer was rebuilt (the shipped run: 1100)
    ckpt = args.work_dir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        step, log = state["step"], state["log"]
        missing, _ = aux.load_state_dict(state["aux"], strict=False)
        rewarm_from = state.get("rewarm_from")
        if missing:  # a checkpoint from before the direction/xbin heads: new heads, fresh optimizer
            rewarm_from = step
            print(f"new aux heads {sorted(missing)}; fresh optimizer, re-warmup from step {step}", flush=True)
        else:
            opt.load_state_dict(state["opt"])
        print(f"resumed at step {step}", flush=True)

    captured: dict[str, torch.Tensor] = {}
    model.model.visual.merger.register_forward_hook(lambda m, i, o: captured.__setitem__("merged", o))

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        if rewarm_from is not None and s < rewarm_from + 50:
            return cosine(s) * (s - rewarm_from + 1) / 50
        return cosine(s)

    def cosine(s: int) -> float:
        p = (s - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    def checkpoint() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "aux": aux.state_dict(), "opt": opt.state_dict(),
                    "step": step, "log": log, "rewarm_from": rewarm_from}, tmp)
        tmp.rename(ckpt)
        (args.work_dir / "log.json").write_text(json.dumps(log, indent=1))

    evals = eval_set(seed=999_999, per_type=64)
    loader = torch.utils.data.DataLoader(
        StepBatches(str(skel), args.seed, step, args.batch_size, args.video_fraction),
        batch_size=None, num_workers=1, prefetch_factor=4,
    )
    t_start, t_last = time.time(), time.time()
    model.train()
    for batch in loader:
        if step >= min(args.steps, args.stop_step):
            break
        if step == EXTRA_HEADS_STEP and rewarm_from is None:
            opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
            rewarm_from = step
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(**model_inputs(batch), labels=batch["labels"])
        merged = captured["merged"]
        aux_loss = aux.loss(merged, batch, step)
        loss = out.loss + args.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            dt = (time.time() - t_last) / 20
            t_last = time.time()
            print(f"step {step} lm {out.loss.item():.4f} aux {aux_loss.item():.4f} lr {lr_at(step):.2e} "
                  f"{dt:.2f}s/step", flush=True)
        if step % args.eval_every == 0 or step == min(args.steps, args.stop_step):
            acc = evaluate(model, processor, evals)
            log.append({"step": step, "minutes": round((time.time() - t_start) / 60, 1), **acc})
            print("eval", json.dumps(log[-1]), flush=True)
            save_model(model, skel, args.out)
        if step % args.save_every == 0:
            checkpoint()
        if (time.time() - t_start) / 60 > args.max_minutes:
            print("time budget reached; saving", flush=True)
            break
    checkpoint()
    save_model(model, skel, args.out)


if __name__ == "__main__":
    main()
