"""Placeholder resolution, the combined regex, and count checks."""

from __future__ import annotations

import re

import pytest

from tessera.demo.build_vl import token_id
from tessera.messages.items import Modality
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

IMG, VID = "<|image_pad|>", "<|video_pad|>"


@pytest.fixture(scope="module")
def tokens(skeleton):
    return MultimodalSpecialTokens(image_token=IMG, video_token=VID).build(skeleton.processor)


def test_build_resolves_ids_from_the_tokenizer(tokens, skeleton):
    assert tokens.image_token_id == token_id(skeleton.path, IMG) == skeleton.config.image_token_id
    assert tokens.video_token_id == skeleton.config.video_token_id
    assert tokens.audio_token_id is None and tokens.modalities == [Modality.IMAGE, Modality.VIDEO]
    by_id = MultimodalSpecialTokens(image_token_id=skeleton.config.image_token_id).build(skeleton.processor)
    assert by_id.image_token == IMG


def test_build_rejects_unknown_or_inconsistent_tokens(skeleton):
    with pytest.raises(ValueError, match="not in the tokenizer vocabulary"):
        MultimodalSpecialTokens(image_token="<nope>").build(skeleton.processor)
    with pytest.raises(ValueError, match="disagrees"):
        MultimodalSpecialTokens(image_token=IMG, image_token_id=skeleton.config.video_token_id).build(
            skeleton.processor)
    with pytest.raises(ValueError, match="both image and video"):
        MultimodalSpecialTokens(image_token=IMG, video_token=IMG).build(skeleton.processor)


def test_split_and_count(tokens):
    prompt = f"a{IMG}{IMG} b {VID}c{IMG}"
    assert tokens.split(prompt) == ["a", IMG, IMG, " b ", VID, "c", IMG]
    assert tokens.count(prompt) == {Modality.IMAGE: 3, Modality.VIDEO: 1}
    assert tokens.split("") == [] and tokens.count("plain") == {Modality.IMAGE: 0, Modality.VIDEO: 0}
    assert tokens.modality_of(VID) is Modality.VIDEO and tokens.modality_of("c") is None


def test_one_regex_longest_alias_first(skeleton):
    # "<img>" is a prefix of "<img>x"; the longer alias must win wherever it appears.
    t = MultimodalSpecialTokens(image_token=[IMG, "<img>", "<img>x"])
    t.compile_regex()
    assert t.split("1<img>x2<img>3") == ["1", "<img>x", "2", "<img>", "3"]
    assert t.count("<img>x<img>") == {Modality.IMAGE: 2}
    assert t.combined_regex is not None
    assert t.combined_regex.pattern == "(" + "|".join(re.escape(s) for s in (IMG, "<img>x", "<img>")) + ")"


def test_check_counts(tokens):
    tokens.check_counts(f"{IMG} {IMG} {VID}", {Modality.IMAGE: 2, Modality.VIDEO: 1})
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*but 2 image item\(s\)"):
        tokens.check_counts(f"{IMG} {VID}", {Modality.IMAGE: 2, Modality.VIDEO: 1})
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\).*but 0 video"):
        tokens.check_counts(f"{IMG} {VID}", {Modality.IMAGE: 1})
    with pytest.raises(ValueError, match="no media placeholders.*chat template"):
        tokens.check_counts("describe it", {Modality.IMAGE: 1})
    with pytest.raises(ValueError, match="no audio placeholder"):
        tokens.check_counts("x", {Modality.AUDIO: 1})
