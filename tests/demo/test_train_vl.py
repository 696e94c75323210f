"""demo-vl training batches: the labels each loss is computed against, checked against the scenes they come from."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.config import ASSETS_DIR
from tessera.demo import scenes
from demo.attention_probe import AttentionProbe
from demo.train_vl import IGNORE, make_batch, model_inputs

DEMO = ASSETS_DIR / "demo-vl"


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(DEMO)


def _samples(qtypes: list[str], seed: int = 7) -> list[scenes.Sample]:
    rng = random.Random(seed)
    return [scenes.image_sample(rng, q) for q in qtypes]


def test_lm_labels_are_the_answer_and_end_token(processor) -> None:
    samples = _samples(["color", "shape", "count", "describe"])
    batch = make_batch(processor, samples)
    tok = processor.tokenizer
    for i, s in enumerate(samples):
        labelled = batch["labels"][i][batch["labels"][i] != IGNORE]
        assert tok.decode(labelled) == s.answer + "<|im_end|>"


def test_aux_labels_one_per_image_token(processor) -> None:
    samples = _samples(["describe"] * 3)
    batch = make_batch(processor, samples)
    n_image_tokens = int((batch["input_ids"] == tok_id(processor, "<|image_pad|>")).sum())
    for key in ("shape", "color", "direction", "xbin"):
        assert batch[f"aux_{key}"].shape == (n_image_tokens,)
    # Every shape of every scene covers at least one token, labelled with its own color.
    colors = list(scenes.COLORS)
    offset = 0
    for s, grid in zip(samples, batch["image_grid_thw"].tolist()):
        n = grid[0] * grid[1] * grid[2] // 4
        present = set(batch["aux_color"][offset : offset + n].tolist()) - {0}
        assert present == {1 + colors.index(sh.color) for sh in s.scenes[0].shapes}
        offset += n


def tok_id(processor, token: str) -> int:
    return processor.tokenizer.convert_tokens_to_ids(token)


def test_binding_targets_point_at_the_asked_object(processor) -> None:
    samples = _samples(["color", "shape"] * 6 + ["count", "describe"])
    batch = make_batch(processor, samples)
    ids, colors = batch["input_ids"], list(scenes.COLORS)
    image_id = tok_id(processor, "<|image_pad|>")
    checked = 0
    for i, s in enumerate(samples):
        q1, q2 = int(batch["bind_q1"][i]), int(batch["bind_q2"][i])
        if s.question_type not in ("color", "shape"):
            assert q1 == q2 == -1 and not batch["bind_t1"][i].any()
            continue
        word = s.question.rstrip("?").split()[-1 if s.question_type == "color" else -2]
        obj = next(sh for sh in s.scenes[0].shapes if word in (sh.kind, sh.color))
        assert processor.tokenizer.decode(ids[i, q1]).strip() == word
        # Hop 1's targets are image tokens, all of the asked object (its color label), and nothing else.
        targets = batch["bind_t1"][i].nonzero().flatten()
        assert len(targets) > 0 and bool((ids[i, targets] == image_id).all())
        image_pos = (ids[i] == image_id).nonzero().flatten().tolist()
        grid = batch["image_grid_thw"][: i + 1].prod(-1) // 4
        start = int(grid[:i].sum())
        token_colors = batch["aux_color"][start : start + int(grid[i])]
        for pos in targets.tolist():
            assert int(token_colors[image_pos.index(pos)]) == 1 + colors.index(obj.color)
        # Hop 2 goes from the position predicting the answer's first token to the keyword.
        assert int(batch["labels"][i, q2 + 1]) != IGNORE and int(batch["labels"][i, q2]) == IGNORE
        assert batch["bind_t2"][i].nonzero().flatten().tolist() == [q1]
        checked += 1
    assert checked == 12


def test_attention_probe_loss_matches_the_attention_maps(processor) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(
        DEMO, attn_implementation={"text_config": "eager", "vision_config": "sdpa"}).eval()
    probe = AttentionProbe(model)
    batch = make_batch(processor, _samples(["color", "shape", "count"]))
    with torch.no_grad():
        attentions = model(**model_inputs(batch), output_attentions=True).attentions
    expected = torch.zeros(())
    for layer, q_key, t_key in probe.hops:
        rows = [i for i in range(3) if batch[q_key][i] >= 0]
        mass = torch.stack([(attentions[layer][i, probe.head, batch[q_key][i]] * batch[t_key][i]).sum() for i in rows])
        expected = expected + (-torch.log(mass + 1e-6)).mean()
    assert torch.allclose(probe.loss(batch), expected)
    assert float(expected) > 0
