"""Deterministic generator of the demo-asr speech grammar (synthesised with espeak-ng).

The grammar is a contract that tests and outside checks rely on word for word:
utterances of 1 to 6 words drawn from the digits `zero`..`nine`, the colors, the shapes and
the directions of the scene grammar; espeak-ng English voices `en`, `en-us`, `en-gb` and their
`+m1..m4` / `+f1..f3` variants; 120-200 words per minute; pitch 30-70; 16 kHz mono. The
transcript is the words in lowercase separated by single spaces.

espeak-ng (Debian package `espeak-ng`) is needed only to make data: training, the held-out
evaluation and the committed test fixtures. Nothing at run time or in the tests calls it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import numpy as np

from tessera.demo.scenes import COLORS, DIRECTIONS, SHAPES

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS: tuple[str, ...] = DIGITS + tuple(COLORS) + SHAPES + DIRECTIONS
BASE_VOICES = ("en", "en-us", "en-gb")
VOICES: tuple[str, ...] = tuple(
    v + suffix for v in BASE_VOICES for suffix in ("", "+m1", "+m2", "+m3", "+m4", "+f1", "+f2", "+f3")
)
MIN_WORDS, MAX_WORDS = 1, 6
MIN_WPM, MAX_WPM = 120, 200
MIN_PITCH, MAX_PITCH = 30, 70
RATE = 16_000
INSTRUCTION = "Transcribe the audio."


@dataclass(frozen=True)
class Utterance:
    words: tuple[str, ...]
    voice: str
    wpm: int
    pitch: int

    @property
    def transcript(self) -> str:
        return " ".join(self.words)


def utterance(rng: random.Random) -> Utterance:
    n = rng.randint(MIN_WORDS, MAX_WORDS)
    return Utterance(
        words=tuple(rng.choice(WORDS) for _ in range(n)),
        voice=rng.choice(VOICES),
        wpm=rng.randint(MIN_WPM, MAX_WPM),
        pitch=rng.randint(MIN_PITCH, MAX_PITCH),
    )


def utterance_for(seed: int, index: int) -> Utterance:
    """The index-th utterance of a seed: a pure function, so data sets can be made in any order."""
    return utterance(random.Random(seed * 1_000_003 + index))


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesize(u: Utterance) -> np.ndarray:
    """float32 mono waveform at RATE Hz."""
    import soundfile as sf

    from tessera.multimodal.media import resample_audio

    if not espeak_available():
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng); it is needed only to make data")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "u.wav")
        subprocess.run(
            ["espeak-ng", "-v", u.voice, "-s", str(u.wpm), "-p", str(u.pitch), "-w", path, u.transcript],
            check=True, capture_output=True, timeout=30,
        )
        x, rate = sf.read(path, dtype="float32", always_2d=True)
    return resample_audio(x.mean(axis=1), int(rate), RATE)


def write_wav(path: str | os.PathLike, x: np.ndarray) -> None:
    import soundfile as sf  # imported here, as in synthesize, so `INSTRUCTION` and the grammar need no soundfile

    sf.write(path, x, RATE, subtype="PCM_16")


# Utterances for the committed files (made once with espeak-ng, so tests and the README need no espeak).
FIXTURE_SEED = 4242
EXAMPLE = Utterance(("seven", "red", "triangle", "left"), "en-us", 150, 50)


def write_fixtures(out_dir: str | os.PathLike, count: int = 6) -> None:
    """`count` grammar utterances as 16-bit WAV files plus transcripts.json (name -> transcript)."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    transcripts = {}
    for i in range(count):
        u = utterance_for(FIXTURE_SEED, i)
        name = f"utt{i}.wav"
        write_wav(out / name, synthesize(u))
        transcripts[name] = {"transcript": u.transcript, "voice": u.voice, "wpm": u.wpm, "pitch": u.pitch}
    (out / "transcripts.json").write_text(json.dumps(transcripts, indent=2) + "\n")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write the committed speech files (needs espeak-ng).")
    ap.add_argument("--fixtures", default="tests/fixtures/speech", help="test fixtures directory")
    ap.add_argument("--example", default="tessera/assets/examples/speech.wav", help="the README's example clip")
    args = ap.parse_args()
    write_fixtures(args.fixtures)
    write_wav(args.example, synthesize(EXAMPLE))


if __name__ == "__main__":
    main()
