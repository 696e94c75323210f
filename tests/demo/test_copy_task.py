"""demo-vl's copy task: the texts it asks back, and the training batch's labels (the answer and <|im_end|>)."""

from __future__ import annotations

import random

from tessera.config import ASSETS_DIR
from tessera.demo import copy_task
from demo.train_copy import copy_batch, copy_pairs
from demo.train_vl import IGNORE


def test_copy_pairs_ask_back_their_answer_and_vary() -> None:
    pairs = copy_pairs(3, 0, 200)
    assert all(q == copy_task.PREFIX + a for q, a in pairs)
    assert len({a for _, a in pairs}) == 200
    lengths = [len(a.split()) for _, a in pairs]
    assert min(lengths) <= 4 and max(lengths) >= 20
    assert copy_pairs(3, 0, 5) == pairs[:5] and copy_pairs(3, 1, 5) != pairs[:5]  # a pure function of (seed, step)
    assert any(" and a " in a for _, a in pairs) and any("," not in a and " and a " not in a for _, a in pairs)


def test_copy_words_are_one_token_each() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl")
    assert all(len(tok.tokenize(" " + w)) == 1 for w in copy_task.WORDS)


def test_copy_batch_labels_are_the_answer_and_end_token() -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")
    pairs = [copy_task.copy_pair(random.Random(s)) for s in range(4)]
    batch = copy_batch(processor, pairs)
    tok = processor.tokenizer
    for i, (question, answer) in enumerate(pairs):
        labelled = batch["labels"][i][batch["labels"][i] != IGNORE]
        assert tok.decode(labelled) == answer + "<|im_end|>"
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        assert tok.decode(ids).endswith(question + "<|im_end|>\n<|im_start|>assistant\n" + answer + "<|im_end|>")


def test_copy_sources_line_up_with_the_answer() -> None:
    """Each answer position's source is the prompt token the next answer token copies, the same id."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")
    tok = processor.tokenizer
    batch = copy_batch(processor, copy_pairs(5, 0, 6))
    for i in range(6):
        q = (batch["copy_source"][i] >= 0).nonzero().flatten()
        src = batch["copy_source"][i][q]
        assert (batch["labels"][i][q + 1] != IGNORE).all() and int((batch["labels"][i] != IGNORE).sum()) == len(q)
        ids = batch["input_ids"][i]
        assert (ids[src] == ids[q + 1]).all()
        assert tok.decode(ids[src[-1]]) == "<|im_end|>"


def test_conversation_batch_labels_every_answer() -> None:
    from transformers import AutoProcessor

    from demo.train_copy import conversation_batch

    processor = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")
    tok = processor.tokenizer
    batch = conversation_batch(processor, random.Random(2), 4)
    assert batch["pixel_values"].shape[0] > 0 and batch["image_grid_thw"].shape[0] == 4
    for i in range(4):
        text = tok.decode(batch["input_ids"][i][batch["attention_mask"][i].bool()])
        answers = [part.split("<|im_end|>")[0] for part in text.split("<|im_start|>assistant\n")[1:]]
        assert 2 <= len(answers) <= 3 and text.count("<|image_pad|>") > 16
        labelled = tok.decode(batch["labels"][i][batch["labels"][i] != IGNORE])
        assert labelled == "".join(a + "<|im_end|>" for a in answers)


def test_anchor_chats_hold_a_model_to_its_teacher() -> None:
    """The anchor pool is text-only chats continued by the teacher; the KL is 0 for the teacher itself and grows
    when the student moves."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from demo.train_copy import anchor_loss, anchor_pool

    processor = AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")
    teacher = Qwen2VLForConditionalGeneration.from_pretrained(ASSETS_DIR / "demo-vl").eval()
    pool = anchor_pool(teacher, processor, seed=1, n=8, new_tokens=6)
    tok = processor.tokenizer
    assert len(pool) == 8 and all("<|image_pad|>" not in tok.decode(p) for p in pool)
    assert all(tok.decode(p).count("<|im_start|>assistant\n") == 1 for p in pool)
    pad = tok.pad_token_id
    with torch.no_grad():
        assert float(anchor_loss(teacher, teacher, pool, random.Random(0), 4, pad)) < 1e-5
        student = Qwen2VLForConditionalGeneration.from_pretrained(ASSETS_DIR / "demo-vl").eval()
        student.lm_head.weight.add_(0.05 * torch.randn_like(student.lm_head.weight))
        assert float(anchor_loss(student, teacher, pool, random.Random(0), 4, pad)) > 1e-3
