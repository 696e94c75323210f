"""Text -> image search over the demo scenes with embeddings from Tessera (demo-vl through Engine.encode).

    python -m demo.retrieval [--train 256 --test 64]

Captions ("a red circle and a blue square") and rendered scenes (chat-templated with "Describe the image.") are
embedded by demo-vl, mean-pooled over their tokens (an image's include its vision tokens). demo-vl was trained to
answer questions, not to embed, so the raw vectors of a caption and its image live in different places; a
tiny contrastively trained head (one linear map per side, InfoNCE over the training pairs, a few seconds on a
CPU) maps both into one space. Reported: recall@1 of text -> image search over the held-out scenes, with the
raw vectors and with the head, against chance. A retrieved image counts as found when its caption is the query's
(two scenes can have the same caption).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tessera.demo import scenes

TRAIN_SEED, TEST_SEED = 7, 20_261_204
IMAGE_PROMPT = "Describe the image."


def scene_pairs(n: int, seed: int) -> tuple[list[str], list]:
    rng = random.Random(seed)
    drawn = [scenes.random_scene(rng) for _ in range(n)]
    return [scenes.describe(s) for s in drawn], [scenes.render(s) for s in drawn]


def embed(engine, captions: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
    texts = engine.encode(captions, pooling="mean")
    pics = engine.encode([IMAGE_PROMPT] * len(images), image_data=images, pooling="mean")
    return (torch.tensor([o["embedding"] for o in texts]), torch.tensor([o["embedding"] for o in pics]))


def recall_at_1(text: torch.Tensor, image: torch.Tensor, captions: list[str]) -> float:
    """Share of captions whose most similar image has that caption."""
    best = (torch.nn.functional.normalize(text, dim=-1) @ torch.nn.functional.normalize(image, dim=-1).T).argmax(1)
    return sum(captions[int(j)] == c for j, c in zip(best, captions)) / len(captions)


def chance(captions: list[str]) -> float:
    """Recall@1 of a random pick: per query, the share of images with its caption."""
    return sum(captions.count(c) / len(captions) for c in captions) / len(captions)


def train_head(text: torch.Tensor, image: torch.Tensor, dim: int = 64, steps: int = 400,
               seed: int = 0) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """One linear map per side trained with a symmetric InfoNCE loss (CLIP's) over the pairs."""
    torch.manual_seed(seed)
    to_text, to_image = torch.nn.Linear(text.shape[1], dim), torch.nn.Linear(image.shape[1], dim)
    opt = torch.optim.Adam([*to_text.parameters(), *to_image.parameters()], lr=3e-3, weight_decay=1e-4)
    labels = torch.arange(text.shape[0])
    for _ in range(steps):
        t = torch.nn.functional.normalize(to_text(text), dim=-1)
        i = torch.nn.functional.normalize(to_image(image), dim=-1)
        logits = t @ i.T / 0.05
        loss = (torch.nn.functional.cross_entropy(logits, labels)
                + torch.nn.functional.cross_entropy(logits.T, labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return to_text, to_image


def run(num_train: int = 256, num_test: int = 64, model_path: str = "demo-vl") -> dict:
    from tessera.entrypoints.engine import Engine

    train_c, train_i = scene_pairs(num_train, TRAIN_SEED)
    test_c, test_i = scene_pairs(num_test, TEST_SEED)
    start = time.perf_counter()
    with Engine(model_path, show_progress=False) as engine:
        train_t, train_v = embed(engine, train_c, train_i)
        test_t, test_v = embed(engine, test_c, test_i)
    embed_s = time.perf_counter() - start
    to_text, to_image = train_head(train_t, train_v)
    with torch.no_grad():
        head = recall_at_1(to_text(test_t), to_image(test_v), test_c)
    return {"train_pairs": num_train, "test_pairs": num_test, "chance": chance(test_c),
            "recall_at_1_raw": recall_at_1(test_t, test_v, test_c), "recall_at_1_head": head,
            "embed_seconds": embed_s, "embeddings": 2 * (num_train + num_test)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--model-path", default="demo-vl")
    ns = ap.parse_args()
    r = run(ns.train, ns.test, ns.model_path)
    print(f"text -> image recall@1 over {r['test_pairs']} held-out scenes: {r['recall_at_1_head']:.3f} with the "
          f"head trained on {r['train_pairs']} pairs, {r['recall_at_1_raw']:.3f} raw, chance {r['chance']:.3f} "
          f"({r['embeddings']} embeddings in {r['embed_seconds']:.1f} s)")


if __name__ == "__main__":
    main()
