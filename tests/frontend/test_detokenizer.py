from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tessera.messages.finish import FinishReason
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
    """Streams `text` as the scheduler would: the output ends at the chunk where a stop string is
    complete (reported as matched), else at the end of the text."""
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for i in range(0, len(ids), step):
        chunk = ids[i : i + step]
        seen = tok.decode(ids[: i + step])
        matched = next((s for s in stop or [] if s in seen), None)
        last = matched is not None or i + step >= len(ids)
        reason = (FinishReason.stop(matched) if matched is not None else FinishReason.of_length(0)) if last else None
        deltas.append(d.add(chunk, reason))
        if last:
            break
    return deltas, d


@pytest.mark.parametrize("text", ["hello world", "héllo wörld ✓ 日本語 🎉!", "🎉🎉🎉"])
def test_stream_never_splits_characters(tok, text: str) -> None:
    assert len(tok.encode("🎉")) == 4  # the fixture really splits characters
    deltas, d = _stream(tok, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert d.output_text == text


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_is_cut_and_held_back(tok, step: int) -> None:
    deltas, d = _stream(tok, "the answer is red. STOP and more", stop=["STOP"], step=step)
    assert "".join(deltas) == d.output_text == "the answer is red. "
    assert d.stopped
    # Nothing that later turned out to be part of the stop string was ever released.
    assert all("S" not in x for x in deltas)


def test_partial_stop_released_when_not_matched(tok) -> None:
    deltas, _ = _stream(tok, "a STO b", stop=["STOP"])
    assert "".join(deltas) == "a STO b"


def test_keep_stop_leaves_the_matched_stop_string(tok) -> None:
    ids = tok.encode("the answer is red. STOP and more")
    d = IncrementalDetokenizer(tok, stop=["STOP", "red"], keep_stop=True)
    end = len(tok.encode("the answer is red"))
    text = "".join(d.add([i]) for i in ids[: end - 1]) + d.add(ids[end - 1 : end + 3], FinishReason.stop("red"))
    assert text == d.output_text == "the answer is red" and d.stopped


def test_the_detokenizer_does_not_match_stop_strings_itself(tok) -> None:
    """The scheduler matches stop strings (it has to stop generating): a stop string in text the
    scheduler did not report (here: a length finish) is not cut, and one that is reported is cut
    even when this decoding shows it only at the end."""
    ids = tok.encode("a STOP b")
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    released = "".join(d.add([i]) for i in ids[:-1]) + d.add(ids[-1:], FinishReason.of_length(0))
    assert released == d.output_text == "a STOP b" and not d.stopped
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    assert d.add(ids, FinishReason.stop("STOP")) == "a " and d.stopped
    # A stop token id (not a string) cuts nothing.
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    assert d.add(ids, FinishReason.stop(7)) == "a STOP b"


def test_stray_bytes_are_released_before_the_end(tok) -> None:
    """A model that emits lone UTF-8 continuation bytes (a random checkpoint's greedy output, or a broken one's)
    used to send nothing until it finished: every window ended in a replacement char. Text goes out once more
    tokens are held than a forming character can span, and a real character after the garbage stays whole."""
    stray = tok.encode("é")[1]  # 0xA9 alone: a continuation byte without its lead
    ids = [stray] * 10 + tok.encode("ok 日本🎉") + [stray] * 2
    d = IncrementalDetokenizer(tok)
    deltas = [d.add([i]) for i in ids[:-1]] + [d.add(ids[-1:], FinishReason.of_length(0))]
    assert "".join(deltas[:10]).count("\ufffd") >= 6  # the garbage streamed while it was generated
    assert "".join(deltas) == d.output_text == tok.decode(ids)
    assert "日本🎉" in "".join(deltas)
    # each character went out whole: no delta holds a replacement char where the text has none
    sent = ""
    for x in deltas:
        sent += x
        assert tok.decode(ids).startswith(sent)


def test_forming_character_is_still_held(tok) -> None:
    """Three bytes of a four-byte character are held (not sent as replacement chars), even after garbage."""
    stray = tok.encode("é")[1]
    party = tok.encode("🎉")
    d = IncrementalDetokenizer(tok)
    out = "".join(d.add([i]) for i in [stray] * 5 + party[:3])
    assert out == "\ufffd" * 5
    assert d.add(party[3:]) == "🎉"
