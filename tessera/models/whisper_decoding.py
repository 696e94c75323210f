"""Whisper's decoding rules: its special tokens, decoder prompts and the logits rules of HF `generate`.

Whisper is steered by its decoder prompt, `<|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]`
(optionally preceded by `<|startofprev|>` and previous text), and HF's generate constrains its logits with
three processors, applied here in the same order to the same effect:
  1. begin_suppress_tokens: banned at the first generated token (SuppressTokensAtBeginLogitsProcessor);
  2. suppress_tokens: always banned (SuppressTokensLogitsProcessor);
  3. when the prompt asks for timestamps (no `<|notimestamps|>`), WhisperTimeStampLogitsProcessor: timestamps
     come in pairs, never decrease, the first token is a timestamp no later than max_initial_timestamp_index,
     and when the timestamps together are likelier than any text token, a timestamp is taken.
A prompt that ends with `<|startoftranscript|>` asks for the language: only language tokens are allowed
(HF's detect_language). The rules are read from generation_config.json, as HF reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# HF generate's default time per timestamp token (input stride 2 x 10 ms mel hop).
TIME_PRECISION = 0.02
TASKS = ("transcribe", "translate")
# GenerationConfig's max_length when the checkpoint's generation config sets none.
DEFAULT_MAX_LENGTH = 20


@dataclass(frozen=True)
class WhisperTokens:
    vocab_size: int
    sot: int  # <|startoftranscript|> (decoder_start_token_id)
    eot: int  # <|endoftext|>
    lang_to_id: Mapping[str, int]  # "en" -> id of <|en|>
    task_to_id: Mapping[str, int]  # "transcribe" / "translate" -> id
    no_timestamps: int | None  # <|notimestamps|>; timestamps start right after it
    prev_sot: int | None  # <|startofprev|>
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: int | None
    max_length: int | None = None  # generation_config's (HF counts it from the first generated token)
    max_new_tokens: int | None = None

    @property
    def timestamp_begin(self) -> int | None:
        return None if self.no_timestamps is None else self.no_timestamps + 1

    @property
    def supports_timestamps(self) -> bool:
        return self.no_timestamps is not None and self.no_timestamps + 1 < self.vocab_size

    @classmethod
    def from_generation_config(cls, gen: Mapping[str, Any], hf_config: Any) -> WhisperTokens:
        """From generation_config.json as HF loads it: a field it lacks is unset (HF does not fall back to the
        model config then); without the file ({}), from the model config, as HF builds one from it."""
        def pick(name: str, default: Any = None) -> Any:
            return gen.get(name) if gen else getattr(hf_config, name, default)

        def token(name: str) -> Any:  # special ids: the model config's when the generation config lacks them
            return gen.get(name) if gen.get(name) is not None else getattr(hf_config, name, None)

        eot = token("eos_token_id")
        eot = eot[0] if isinstance(eot, list) else eot
        lang_to_id = {k.strip("<|>"): int(v) for k, v in (gen.get("lang_to_id") or {}).items()}
        prev_sot = gen.get("prev_sot_token_id")
        suppress = tuple(int(t) for t in pick("suppress_tokens") or ())
        if prev_sot is None and len(suppress) >= 2:  # where HF's long-form code looks for it
            prev_sot = suppress[-2]
        return cls(
            vocab_size=int(hf_config.vocab_size), sot=int(token("decoder_start_token_id")), eot=int(eot),
            lang_to_id=lang_to_id, task_to_id={k: int(v) for k, v in (gen.get("task_to_id") or {}).items()},
            no_timestamps=gen.get("no_timestamps_token_id"), prev_sot=prev_sot, suppress=suppress,
            begin_suppress=tuple(int(t) for t in pick("begin_suppress_tokens") or ()),
            max_initial_timestamp_index=gen.get("max_initial_timestamp_index"),
            max_length=gen.get("max_length"), max_new_tokens=gen.get("max_new_tokens"),
        )

    def output_budget(self, prompt_len: int, max_target_positions: int) -> int:
        """New tokens HF's generate allows after a decoder prompt of prompt_len tokens (its
        _set_max_new_tokens_and_length): max_new_tokens when set; else max_length counted from after the first
        min(max_target_positions // 2 - 1, prompt_len) prompt tokens (20 when unset); never past the decoder's
        positions."""
        room = max_target_positions - prompt_len
        if self.max_new_tokens is not None:
            return max(0, min(int(self.max_new_tokens), room))
        initial = min(max_target_positions // 2 - 1, prompt_len)
        max_length = int(self.max_length) if self.max_length is not None else DEFAULT_MAX_LENGTH
        return max(0, min(max_length + initial, max_target_positions) - prompt_len)

    # ---- prompts ----------------------------------------------------------------------------------------

    def decoder_prompt(self, language: str | None, task: str | None, timestamps: bool,
                       previous: Sequence[int] = ()) -> list[int]:
        """`[<|startofprev|> previous...] <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]`, as HF's
        generate(language=..., task=..., return_timestamps=...) builds it. ValueError naming an unknown
        language or task, or timestamps on a checkpoint without timestamp tokens."""
        ids: list[int] = []
        if previous:
            if self.prev_sot is None:
                raise ValueError("prompt: this checkpoint has no <|startofprev|> token for a text prompt")
            ids += [self.prev_sot, *previous]
        ids.append(self.sot)
        if language is not None:
            if language not in self.lang_to_id:
                raise ValueError(f"language: {language!r} is not a language of this checkpoint (it knows "
                                 f"{', '.join(sorted(self.lang_to_id)) or 'none'})")
            ids.append(self.lang_to_id[language])
        if task is not None:
            if task not in self.task_to_id:
                raise ValueError(f"task: this checkpoint has no {task!r} task (it has "
                                 f"{', '.join(sorted(self.task_to_id)) or 'none'})")
            ids.append(self.task_to_id[task])
        if timestamps and not self.supports_timestamps:
            raise ValueError("timestamps: this checkpoint has no timestamp tokens")
        if not timestamps and self.no_timestamps is not None:
            ids.append(self.no_timestamps)
        return ids

    def language_prompt(self) -> list[int]:
        """The prompt whose next token is the detected language."""
        return [self.sot]

    def language_of(self, token_id: int) -> str | None:
        return next((code for code, i in self.lang_to_id.items() if i == token_id), None)

    def is_timestamp(self, token_id: int) -> bool:
        begin = self.timestamp_begin
        return begin is not None and token_id >= begin

    def timestamp_seconds(self, token_id: int) -> float:
        assert self.timestamp_begin is not None
        return (token_id - self.timestamp_begin) * TIME_PRECISION

    # ---- logits -----------------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """The constrained logits [B, V] of rows whose decoder prompts and generated tokens are given."""
        neg = float("-inf")
        scores = logits.clone()
        vocab = scores.shape[-1]
        lang_ids = torch.tensor(sorted(self.lang_to_id.values()), dtype=torch.long, device=scores.device)
        suppress = torch.tensor([t for t in self.suppress if t < vocab], dtype=torch.long, device=scores.device)
        begin_suppress = torch.tensor([t for t in self.begin_suppress if t < vocab], dtype=torch.long,
                                      device=scores.device)
        ts_rows: list[int] = []
        for k, (prompt, out) in enumerate(zip(prompts, outputs)):
            if not out and prompt and prompt[-1] == self.sot and len(lang_ids):  # detect_language
                allowed = scores[k, lang_ids].clone()
                scores[k] = neg
                scores[k, lang_ids] = allowed
                continue
            if not out and len(begin_suppress):
                scores[k, begin_suppress] = neg
            if len(suppress):
                scores[k, suppress] = neg
            if self.supports_timestamps and self.no_timestamps not in prompt:
                self._timestamp_rules(scores, k, out)
                ts_rows.append(k)
        if ts_rows:  # a timestamp wins when all of them together outweigh the best text token
            begin = self.timestamp_begin
            rows = torch.tensor(ts_rows, dtype=torch.long, device=scores.device)
            logprobs = torch.log_softmax(scores[rows].float(), dim=-1)
            take_ts = logprobs[:, begin:].logsumexp(dim=-1) > logprobs[:, :begin].max(dim=-1).values
            sub = scores[rows]
            sub[:, :begin] = sub[:, :begin].masked_fill(take_ts.unsqueeze(-1), neg)
            scores[rows] = sub
        return scores

    def _timestamp_rules(self, scores: torch.Tensor, k: int, out: Sequence[int]) -> None:
        """WhisperTimeStampLogitsProcessor for row k (everything but the logprob rule)."""
        neg = float("-inf")
        begin = self.timestamp_begin
        assert begin is not None
        scores[k, self.no_timestamps] = neg
        last = len(out) >= 1 and out[-1] >= begin
        penultimate = len(out) < 2 or out[-2] >= begin
        if last:
            if penultimate:  # a pair just closed: text (or eot) next
                scores[k, begin:] = neg
            else:  # a segment's end: another timestamp or eot, no text
                scores[k, :self.eot] = neg
        stamps = [t for t in out if t >= begin]
        lowest = begin
        if stamps:
            lowest = stamps[-1] if last and not penultimate else stamps[-1] + 1
        scores[k, begin:lowest] = neg
        if not out:
            scores[k, :begin] = neg
            if self.max_initial_timestamp_index is not None:
                scores[k, begin + self.max_initial_timestamp_index + 1:] = neg


@dataclass(frozen=True)
class TimedSegment:
    """A stretch of output between timestamp tokens: [start, end) in seconds of the window, its text tokens,
    and the range of output positions it covers (timestamps included), for per-token data such as logprobs."""

    start: float
    end: float
    tokens: list[int]
    span: tuple[int, int]


def timed_segments(tokens: WhisperTokens, output_ids: Sequence[int], window_s: float) -> list[TimedSegment]:
    """Segments of one window's output, cut at its timestamp tokens as HF's _retrieve_segment cuts them.

    `<|a|> text <|b|>` is a segment [a, b). Text after the last closed pair (the model stopped mid-segment or
    at eot after a single timestamp) becomes a last segment that ends at its last timestamp, or at the
    window's end. Output without timestamps is one segment over the whole window."""
    segments: list[TimedSegment] = []
    start: float | None = None
    first = 0
    text: list[int] = []
    for i, t in enumerate(output_ids):
        if t == tokens.eot:
            break
        if tokens.is_timestamp(t):
            sec = tokens.timestamp_seconds(t)
            if start is None:
                start, first = sec, i
            else:
                segments.append(TimedSegment(start, max(sec, start), text, (first, i + 1)))
                start, text = None, []
        else:
            if start is None:  # text without an opening timestamp starts where the last segment ended
                start, first = (segments[-1].end if segments else 0.0), i
            text.append(t)
    if text:
        start = start or 0.0
        end = len(output_ids) if tokens.eot not in output_ids else output_ids.index(tokens.eot)
        segments.append(TimedSegment(start, max(window_s, start), text, (first, end)))
    return segments
