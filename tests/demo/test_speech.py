"""The demo-asr speech grammar (tessera.demo.speech): word list, voices, ranges, determinism."""

from __future__ import annotations

import random

import pytest

from tessera.demo import speech


def test_vocabulary_and_voices_are_the_contract() -> None:
    assert speech.WORDS == ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                            "red", "green", "blue", "yellow", "purple", "orange",
                            "circle", "square", "triangle", "left", "right", "up", "down")
    assert len(speech.VOICES) == 24 and len(set(speech.VOICES)) == 24
    for base in ("en", "en-us", "en-gb"):
        assert {f"{base}{v}" for v in ("", "+m1", "+m2", "+m3", "+m4", "+f1", "+f2", "+f3")} <= set(speech.VOICES)


def test_utterances_stay_in_range_and_cover_the_grammar() -> None:
    rng = random.Random(0)
    utts = [speech.utterance(rng) for _ in range(3000)]
    lengths = {len(u.words) for u in utts}
    assert lengths == set(range(1, 7))
    assert {w for u in utts for w in u.words} == set(speech.WORDS)
    assert {u.voice for u in utts} == set(speech.VOICES)
    assert min(u.wpm for u in utts) == 120 and max(u.wpm for u in utts) == 200
    assert min(u.pitch for u in utts) == 30 and max(u.pitch for u in utts) == 70
    u = utts[0]
    assert u.transcript == " ".join(u.words) and u.transcript == u.transcript.lower()


def test_utterance_for_is_a_pure_function_of_seed_and_index() -> None:
    assert speech.utterance_for(7, 3) == speech.utterance_for(7, 3)
    assert [speech.utterance_for(7, i) for i in range(50)] != [speech.utterance_for(8, i) for i in range(50)]


@pytest.mark.skipif(not speech.espeak_available(), reason="espeak-ng makes data only; not installed here")
def test_synthesize_gives_16k_mono_speech() -> None:
    x = speech.synthesize(speech.Utterance(("one", "red"), "en-us", 160, 50))
    assert x.ndim == 1 and x.dtype.name == "float32"
    assert 0.3 < len(x) / speech.RATE < 3.0 and 0.05 < abs(x).max() <= 1.0
