"""Incremental detokenization: streamed text never splits a multi-byte character and never
changes text that was already sent. Stop strings are matched once, by the scheduler (which must
stop generating); here a tail that may be a forming stop string is held back, and the text is
cut at the string the scheduler reports as matched.
"""

from __future__ import annotations

from tessera.messages.finish import FinishReason

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes and every byte-level or byte-fallback token carries at least one: a
# character still forming (at most 3 of its bytes seen) lies within the last 3 tokens.
MAX_PENDING_TOKENS = 3


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 spaces_between_special_tokens: bool = True, keep_stop: bool = False):
        self.tokenizer = tokenizer
        self.keep_stop = keep_stop  # a matched stop string stays in the text (SGLang's no_stop_trim)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]  # only to hold back their prefixes while streaming
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all stable text decoded so far
        self.sent = 0  # characters of self.text already handed out
        self.stopped = False  # the scheduler reported a matched stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], finished_reason: FinishReason | None = None) -> str:
        """Feeds tokens and, on the request's last output, its finish reason; returns the newly
        releasable text."""
        finished = finished_reason is not None
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        # A trailing replacement char means an incomplete UTF-8 sequence: wait for more bytes,
        # unless the request is over.
        if len(full_text) > len(prefix_text) and (finished or not full_text.endswith(REPLACEMENT_CHAR)):
            self._take(full_text, prefix_text, len(self.ids))
        elif finished and full_text != prefix_text:
            self.text += full_text[len(prefix_text) :]
        elif len(self.ids) - self.read_offset > MAX_PENDING_TOKENS:
            self._release_invalid_bytes(prefix_text)
        matched = finished_reason.stop_string if finished_reason is not None else None
        if matched is not None:
            self._cut_at(matched)
        return self._release(finished)

    def _take(self, text: str, prefix_text: str, end: int) -> None:
        """Makes the decoded window up to token `end` stable text."""
        self.text += text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, end

    def _release_invalid_bytes(self, prefix_text: str) -> None:
        """More than MAX_PENDING_TOKENS tokens are held and their text still ends in a replacement char. A
        character still forming has its bytes in the last MAX_PENDING_TOKENS tokens, so releases the text up to
        the latest of those tokens where it ends cleanly, or else up to the first of them: the replacement
        chars before it stand for invalid bytes (a model emitting stray byte tokens) that no later byte can
        complete. Without this, such a stream sent nothing until it finished."""
        n = len(self.ids)
        for end in range(n - 1, n - MAX_PENDING_TOKENS - 1, -1):
            text = self._decode(self.ids[self.prefix_offset : end])
            if len(text) > len(prefix_text) and (end == n - MAX_PENDING_TOKENS or not text.endswith(REPLACEMENT_CHAR)):
                self._take(text, prefix_text, end)
                return

    def _cut_at(self, matched: str) -> None:
        # Released text never holds the start of a stop string (see _release), so the match lies in
        # the unreleased tail. Not found: the scheduler matched text this decoding skips (special tokens).
        pos = self.text.find(matched, max(0, self.sent - len(matched) + 1))
        if pos != -1:
            self.text = self.text[: pos + (len(matched) if self.keep_stop else 0)]
            self.stopped = True

    def _release(self, finished: bool) -> str:
        end = len(self.text)
        if not finished and self.stop:
            # Hold back a tail that could be the beginning of a stop string.
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            end = len(self.text) - hold
        end = max(end, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    @property
    def output_text(self) -> str:
        return self.text[: self.sent]
