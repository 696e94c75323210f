"""demo-vl's copy task: "Repeat after me: <text>" answered with <text>, word for word.

Taught after the scene stages (demo/train_copy.py), so that prompt lookup (NGRAM speculative decoding) has
something to find in a trained model's answers: past the answer's first token every token is in the prompt.
The text is a list of scene objects ("a red circle, a blue square and a green triangle", as "Describe the
image." answers) or a run of words of the tokenizer's scene and generic vocabulary, each one token after a
space, so the model learns to copy any of them rather than a few phrases. The text starts a line in the prompt
as the answer starts its turn, so both tokenize alike, token for token.
"""

from __future__ import annotations

import random

from tessera.demo import scenes

PREFIX = "Repeat after me:\n"  # the text on a line of its own: tokenized as the answer is
GENERIC_WORDS = ("a", "about", "and", "are", "brown", "car", "cat", "dog", "fox", "from", "here", "house",
                 "image", "in", "is", "it", "jumps", "lazy", "of", "on", "or", "over", "person", "picture",
                 "quick", "see", "street", "the", "there", "this", "to", "today", "tree", "way", "world", "yes",
                 "no", "you", "zero", "four", "five", "six", "seven", "eight", "nine", "ten")
WORDS = tuple(scenes.COLORS) + scenes.SHAPES + scenes.DIRECTIONS + scenes.COUNT_WORDS + GENERIC_WORDS


def copy_text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        parts = [f"a {rng.choice(list(scenes.COLORS))} {rng.choice(scenes.SHAPES)}" for _ in range(rng.randint(2, 8))]
        return ", ".join(parts[:-1]) + " and " + parts[-1]
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 24))]
    return " ".join(w + ("," if rng.random() < 0.15 and i < len(words) - 1 else "") for i, w in enumerate(words))


def copy_prompt(text: str) -> str:
    """The user turn that asks for `text` back."""
    return PREFIX + text


def copy_pair(rng: random.Random) -> tuple[str, str]:
    """(user turn, answer)."""
    text = copy_text(rng)
    return copy_prompt(text), text
