from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tessera.frontend.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """One token per UTF-8 byte: multi-byte characters span several tokens."""

    def __init__(self) -> None:
        self.tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                                        merges=[]))
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


def _stream(tok, text: str, stop=None, step: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for i in range(0, len(ids), step):
        chunk = ids[i : i + step]
        deltas.append(d.add(chunk, finished=i + step >= len(ids)))
    return deltas, d


@pytest.mark.parametrize("text", ["hello world", "héllo wörld ✓ 日本語 🎉!", "🎉🎉🎉"])
def test_stream_never_splits_characters(tok, text: str) -> None:
    assert len(tok.encode("🎉")) == 4  # the fixture really splits characters
    deltas, d = _stream(tok, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert d.output_text == text


def test_stop_string_is_cut_and_held_back(tok) -> None:
    deltas, d = _stream(tok, "the answer is red. STOP and more", stop=["STOP"])
    assert "".join(deltas) == "the answer is red. "
    assert d.stopped
    # Nothing that later turned out to be part of the stop string was ever released.
    assert all("S" not in x for x in deltas)


def test_partial_stop_released_when_not_matched(tok) -> None:
    deltas, _ = _stream(tok, "a STO b", stop=["STOP"])
    assert "".join(deltas) == "a STO b"


def test_keep_stop_leaves_the_matched_stop_string(tok) -> None:
    ids = tok.encode("the answer is red. STOP and more")
    d = IncrementalDetokenizer(tok, stop=["STOP", "red"], keep_stop=True)
    text = "".join(d.add([i]) for i in ids)
    assert text == d.output_text == "the answer is red" and d.stopped  # the earliest match ends it
