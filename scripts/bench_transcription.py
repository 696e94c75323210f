"""Transcription throughput of a Qwen3-ASR-shaped random model: Tessera's Engine beside transformers' `generate`.

Both sides get the prompt Qwen3ASRProcessor.apply_transcription_request builds (language forced to English, as a
/v1/audio/transcriptions request with `language=en` sends it) for clips of `--seconds` of synthetic speech-like
audio, greedy, exactly the endpoint's token budget per clip (10 per second of audio, EOS ignored so both do the
same work). Concurrency 1: the clips one after another; concurrency 16: 16 clips submitted together (Tessera's
scheduler batches them; HF: one left-padded batch). Figure: audio seconds transcribed per wall second, median of
`--reps`.

    PYTHONPATH=. .venv/bin/python scripts/bench_transcription.py [--reps 3] [--seconds 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tests.audio_testing import RATE, speechlike
from tests.speech_llm_testing import build_speech_llm

# Qwen3-ASR's layout at a size this CPU runs in seconds: Qwen3 text model, the encoder's real chunking
# (1 s chunks, 8 s attention windows, 128 mel bins).
TEXT = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)
AUDIO = dict(num_mel_bins=128, d_model=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=512,
             output_dim=256, n_window=50, n_window_infer=800, downsample_hidden_size=64)


def _budget(seconds: float) -> int:
    return max(16, int(np.ceil(seconds * 10)))


def tessera_rate(path: Path, clips: list[np.ndarray], prompt: str, concurrency: int, reps: int) -> list[float]:
    from tessera import Engine

    sp = {"temperature": 0, "max_new_tokens": _budget(len(clips[0]) / RATE), "ignore_eos": True}
    rates = []
    with Engine(str(path), show_progress=False) as engine:
        engine.generate(prompt, sp, audio_data=[clips[0]])  # first-call setup outside the timing
        for _ in range(reps):
            todo = clips[:concurrency] if concurrency > 1 else clips[:4]
            start = time.perf_counter()
            if concurrency > 1:
                engine.generate([prompt] * len(todo), sp, audio_data=[[c] for c in todo])
            else:
                for c in todo:
                    engine.generate(prompt, sp, audio_data=[c])
            rates.append(sum(len(c) for c in todo) / RATE / (time.perf_counter() - start))
    return rates


def hf_rate(path: Path, clips: list[np.ndarray], concurrency: int, reps: int) -> list[float]:
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(path).eval()
    budget = _budget(len(clips[0]) / RATE)

    def run(batch: list[np.ndarray]) -> None:
        inputs = processor.apply_transcription_request(batch, language="en", sampling_rate=RATE)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=budget, min_new_tokens=budget, do_sample=False,
                           eos_token_id=None, pad_token_id=0)

    run(clips[:1])
    rates = []
    for _ in range(reps):
        todo = clips[:concurrency] if concurrency > 1 else clips[:4]
        start = time.perf_counter()
        if concurrency > 1:
            run(todo)
        else:
            for c in todo:
                run([c])
        rates.append(sum(len(c) for c in todo) / RATE / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_speech_llm("qwen3_asr", Path(tmp) / "qwen3-asr-bench", text=TEXT, audio=AUDIO)
        from transformers import AutoProcessor

        prompt = AutoProcessor.from_pretrained(path).apply_transcription_request(
            np.zeros(1, np.float32), language="en", tokenize=False)[0]
        clips = [speechlike(args.seconds, seed=i) for i in range(16)]
        for concurrency in (1, 16):
            ours = tessera_rate(path, clips, prompt, concurrency, args.reps)
            ref = hf_rate(path, clips, concurrency, args.reps)
            print(f"concurrency {concurrency:2d}: Tessera {statistics.median(ours):7.2f} audio s / s "
                  f"(runs {', '.join(f'{r:.2f}' for r in ours)}); HF {statistics.median(ref):7.2f} "
                  f"(runs {', '.join(f'{r:.2f}' for r in ref)}); "
                  f"x{statistics.median(ours) / statistics.median(ref):.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
