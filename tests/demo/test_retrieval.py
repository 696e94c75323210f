"""The retrieval demo's measure and head: recall@1 counts a hit by caption, chance is what a random pick
scores, and the contrastive head learns a hidden linear relation between the two sides (synthetic vectors)."""

from __future__ import annotations

import torch

from demo.retrieval import chance, recall_at_1, train_head


def test_recall_counts_a_same_caption_image_as_found() -> None:
    captions = ["a", "b", "a"]
    text = torch.eye(3)
    image = torch.tensor([[0.0, 0, 1], [0, 1, 0], [1, 0, 0]])  # query 0 finds image 2, whose caption is "a" too
    assert recall_at_1(text, image, captions) == 1.0
    wrong = torch.tensor([[0.0, 1, 0], [1, 0, 1], [-1, -1, -1]])  # each query's nearest has another caption
    assert recall_at_1(text, wrong, captions) == 0.0
    assert chance(captions) == (2 / 3 + 1 / 3 + 2 / 3) / 3


def test_head_learns_a_hidden_linear_relation() -> None:
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(128, 8, generator=g)
    text = latent @ torch.randn(8, 40, generator=g) + 0.01 * torch.randn(128, 40, generator=g)
    image = latent @ torch.randn(8, 24, generator=g)
    captions = [str(i) for i in range(128)]
    to_text, to_image = train_head(text[:96], image[:96], dim=16, steps=150)
    with torch.no_grad():
        trained = recall_at_1(to_text(text[96:]), to_image(image[96:]), captions[96:])
    assert trained >= 0.9 > recall_at_1(text[96:, :24], image[96:], captions[96:])
