"""Trains demo-asr (HF Qwen2AudioForConditionalGeneration) on the espeak-ng speech grammar, on CPU.

    python -m demo.train_asr --work-dir .train/demo-asr --out tessera/assets/demo-asr

Two stages, both resumable:
1. Data: utterances of the grammar (tessera.demo.speech) synthesised with espeak-ng and turned into
   Whisper log-mel features once, in worker processes, stored as float16 shards in the work dir
   (a shard that exists is not made again). Needs espeak-ng.
2. Training: batches are a pure function of (seed, step) over the stored pool, so a resumed run sees
   exactly the data it would have; the work dir holds the latest checkpoint (model, optimizer, step).
   Evaluation every --eval-every steps on utterances of a separate seed (teacher-forced exact match,
   which equals greedy exact match); the curve is kept in the work dir's log.json.

Recipe (why): a small encoder (4 layers, d_model 128) over a 6 s chunk, warmup then cosine decay;
the transcript is a handful of tokens, so the loss is all on the words. From SILENCE_FROM_STEP on, most
clips get digital silence before and after them, so that speech inside a longer window (user audio, or
a window of a long recording) is transcribed as well as a tight espeak-ng clip.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
import torch

from demo.checkpoint import save_checkpoint
from demo.runs import out_of_time, resume, save_state
from tessera.demo import speech
from tessera.demo.build_asr import build_processor_files, build_skeleton
from tessera.models.qwen2_audio import audio_output_len

IGNORE = -100
TRAIN_SEED = 1234
EVAL_SEED = 999_999  # the curve in log.json; the held-out evaluation (eval_asr) uses yet another seed
SHARD = 1000
# Silence padding (pad_with_silence) is on from this step: the shipped run added it here, after its first
# 1200 steps had learnt the words but not to ignore silence around them.
SILENCE_FROM_STEP = 1200
# After --steps, --silence-steps more at --silence-lr with silence around 90% of the clips: at step 2000 a
# clip with up to 4 s of silence in its window (one utterance per window of a long recording) was still
# transcribed wrong in 2 of 6 fixtures.
SILENCE_P_LATE = 0.9


# ---------------------------------------------------------------- data


def _features_for(args: tuple[str, int, int]) -> tuple[np.ndarray, int, str]:
    model_dir, seed, index = args
    extractor = _extractor(model_dir)
    u = speech.utterance_for(seed, index)
    x = speech.synthesize(u)
    enc = extractor(x, sampling_rate=speech.RATE, padding="max_length", return_attention_mask=True,
                    return_tensors="np")
    return enc["input_features"][0].astype(np.float16), int(enc["attention_mask"][0].sum()), u.transcript


_EXTRACTORS: dict[str, object] = {}


def _extractor(model_dir: str):
    if model_dir not in _EXTRACTORS:
        from transformers import WhisperFeatureExtractor

        _EXTRACTORS[model_dir] = WhisperFeatureExtractor.from_pretrained(model_dir)
    return _EXTRACTORS[model_dir]


def make_pool(model_dir: Path, pool_dir: Path, seed: int, size: int, workers: int) -> None:
    """Shards of SHARD utterances: feats [n, mel, frames] f16, lengths [n] (real frames), transcripts."""
    pool_dir.mkdir(parents=True, exist_ok=True)
    for start in range(0, size, SHARD):
        path = pool_dir / f"shard-{start // SHARD:03d}.npz"
        if path.exists():
            continue
        t0 = time.time()
        jobs = [(str(model_dir), seed, i) for i in range(start, min(size, start + SHARD))]
        with mp.get_context("spawn").Pool(workers) as pool:
            rows = pool.map(_features_for, jobs, chunksize=16)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, feats=np.stack([r[0] for r in rows]), lengths=np.array([r[1] for r in rows], np.int32),
                 transcripts=np.array([r[2] for r in rows]))
        tmp.rename(path)
        print(f"pool {pool_dir.name}: {path.name} ({len(rows)} utterances, {time.time() - t0:.0f} s)", flush=True)


def load_pool(pool_dir: Path, size: int) -> dict:
    shards = [np.load(pool_dir / f"shard-{k:03d}.npz") for k in range((size + SHARD - 1) // SHARD)]
    return {
        "feats": torch.from_numpy(np.concatenate([s["feats"] for s in shards])[:size]),
        "lengths": np.concatenate([s["lengths"] for s in shards])[:size],
        "transcripts": [str(t) for s in shards for t in s["transcripts"]][:size],
    }


def pad_with_silence(feats: torch.Tensor, length: int, rng: np.random.Generator, p: float = 0.7) -> int:
    """In place: with probability p, moves the clip's `length` real frames right by a random lead and marks a
    random number of the padding frames after it as real; returns the new length.

    Exactly what the feature extractor gives for the clip with zeros before and after it (checked): padding
    frames are log-mel of zeros, and Whisper's normalisation only depends on the clip's loudest frame. Users'
    audio has silence around speech, espeak-ng's has next to none; without this a clip followed by 1 s of
    silence was transcribed right 2 times in 6.
    """
    room = feats.shape[-1] - length
    if room <= 0 or rng.random() >= p:
        return length
    total = int(rng.integers(0, room + 1))
    lead = int(rng.integers(0, total + 1))
    silence = feats[:, -1:].clone()  # a padding frame
    feats[:, lead : lead + length] = feats[:, :length].clone()
    feats[:, :lead] = silence
    feats[:, lead + length :] = silence
    return length + total


class Batcher:
    """Chat-formatted batches: the prompt with `<|AUDIO|>` expanded as Qwen2AudioProcessor does."""

    def __init__(self, processor):
        self.tokenizer = processor.tokenizer
        self.tokenizer.padding_side = "right"  # labels are the last tokens of each row
        msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": speech.INSTRUCTION}]}]
        self.prompt = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        self.audio_token = processor.audio_token

    def __call__(self, pool: dict, idx: list[int], rng: np.random.Generator | None = None,
                 silence_p: float = 0.7) -> dict:
        """With `rng`, clips get digital silence before and after them with probability silence_p
        (see pad_with_silence)."""
        feats = pool["feats"][idx].float()
        lengths = torch.as_tensor(pool["lengths"][idx]).clone()
        if rng is not None:
            for row in range(len(idx)):
                lengths[row] = pad_with_silence(feats[row], int(lengths[row]), rng, silence_p)
        texts, answer_lens = [], []
        for row, i in enumerate(idx):
            n = audio_output_len(int(lengths[row]))
            answer = pool["transcripts"][i] + "<|im_end|>"
            texts.append(self.prompt.replace(self.audio_token, self.audio_token * n) + answer)
            answer_lens.append(len(self.tokenizer(answer, add_special_tokens=False)["input_ids"]))
        enc = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        labels = torch.full_like(enc["input_ids"], IGNORE)
        for row, n_ans in enumerate(answer_lens):
            end = int(enc["attention_mask"][row].sum())
            labels[row, end - n_ans : end] = enc["input_ids"][row, end - n_ans : end]
        frames = feats.shape[-1]
        return {
            "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels,
            "input_features": feats,
            "feature_attention_mask": (torch.arange(frames)[None, :] < lengths[:, None]).long(),
        }


@torch.no_grad()
def evaluate(model, batcher: Batcher, pool: dict, batch_size: int = 64, silence_seed: int | None = None) -> dict:
    """Teacher-forced exact match (equals greedy exact match) and per-token accuracy on the answers; with
    `silence_seed`, on the clips padded with silence (the same padding at every evaluation)."""
    rng = np.random.default_rng(silence_seed) if silence_seed is not None else None
    model.eval()
    exact = tokens = tokens_ok = 0
    n = len(pool["transcripts"])
    for start in range(0, n, batch_size):
        batch = batcher(pool, list(range(start, min(n, start + batch_size))), rng)
        labels = batch.pop("labels")[:, 1:]
        pred = model(**batch).logits[:, :-1].argmax(-1)
        ok = (pred == labels) | (labels == IGNORE)
        exact += int(ok.all(-1).sum())
        mask = labels != IGNORE
        tokens += int(mask.sum())
        tokens_ok += int(((pred == labels) & mask).sum())
    model.train()
    return {"exact": round(exact / n, 4), "token": round(tokens_ok / tokens, 4)}


def save_model(model, out_dir: Path) -> None:
    # the processor files of the current code; the speech grammar is English (tessera/demo/speech.py)
    save_checkpoint(model, out_dir, build_processor_files, language="en")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=Path(".train/demo-asr"))
    ap.add_argument("--out", type=Path, default=Path("tessera/assets/demo-asr"))
    ap.add_argument("--pool-size", type=int, default=16_000, help="training utterances synthesised once")
    ap.add_argument("--eval-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2000, help="length of the main LR schedule")
    ap.add_argument("--silence-steps", type=int, default=400, help="then this many with more silence")
    ap.add_argument("--silence-lr", type=float, default=2e-4)
    ap.add_argument("--stop-step", type=int, default=None, help="stop (and save) after this step")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-workers", type=int, default=2)
    ap.add_argument("--data-only", action="store_true", help="make the data pools and stop")
    ap.add_argument("--max-minutes", type=float, default=175.0, help="stop (after saving) when exceeded")
    args = ap.parse_args()

    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    skel = args.work_dir / "skeleton"
    config = build_skeleton(skel)
    make_pool(skel, args.work_dir / f"pool-{TRAIN_SEED}", TRAIN_SEED, args.pool_size, args.data_workers)
    make_pool(skel, args.work_dir / f"pool-{EVAL_SEED}", EVAL_SEED, args.eval_size, args.data_workers)
    if args.data_only:
        return
    train = load_pool(args.work_dir / f"pool-{TRAIN_SEED}", args.pool_size)
    evals = load_pool(args.work_dir / f"pool-{EVAL_SEED}", args.eval_size)

    torch.set_num_threads(args.threads)
    torch.manual_seed(TRAIN_SEED)
    processor = AutoProcessor.from_pretrained(skel)
    batcher = Batcher(processor)
    model = Qwen2AudioForConditionalGeneration(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step, log, _ = resume(args.work_dir, model=model, opt=opt)

    def lr_at(s: int) -> float:
        if s >= args.steps:  # the silence phase: its own short warmup and cosine
            p = (s - args.steps) / max(1, args.silence_steps)
            return args.silence_lr * min(1.0, (s - args.steps + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        p = (s - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    def checkpoint() -> None:
        save_state(args.work_dir, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, log)

    total = args.steps + args.silence_steps
    last = min(total, args.stop_step or total)
    t_start = t_last = time.time()
    model.train()
    while step < last:
        rng = np.random.default_rng(TRAIN_SEED * 1_000_003 + step)
        idx = rng.integers(0, args.pool_size, args.batch_size).tolist()
        batch = batcher(train, idx, rng if step >= SILENCE_FROM_STEP else None,
                        SILENCE_P_LATE if step >= args.steps else 0.7)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            dt = (time.time() - t_last) / 20
            t_last = time.time()
            print(f"step {step} loss {loss.item():.4f} lr {lr_at(step):.2e} {dt:.2f}s/step", flush=True)
        if step % args.eval_every == 0 or step == last:
            padded = evaluate(model, batcher, evals, silence_seed=0)
            log.append({"step": step, "minutes": round((time.time() - t_start) / 60, 1),
                        **evaluate(model, batcher, evals),
                        "exact_with_silence": padded["exact"], "token_with_silence": padded["token"]})
            print("eval", json.dumps(log[-1]), flush=True)
            save_model(model, args.out)
        if step % args.save_every == 0:
            checkpoint()
        if out_of_time(t_start, args.max_minutes):
            break
    checkpoint()
    save_model(model, args.out)


if __name__ == "__main__":
    main()
