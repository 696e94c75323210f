"""Incremental detokenization: streamed text never splits a multi-byte character and never
changes text that was already sent; stop strings are cut out and held back while they may
still be forming.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 spaces_between_special_tokens: bool = True, keep_stop: bool = False):
        self.tokenizer = tokenizer
        self.keep_stop = keep_stop  # a matched stop string stays in the text (SGLang's no_stop_trim)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all stable text decoded so far (may still contain a stop string)
        self.sent = 0  # characters of self.text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], finished: bool = False) -> str:
        """Feeds tokens; returns the newly releasable text."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        # A trailing replacement char means an incomplete UTF-8 sequence: wait for more bytes,
        # unless the request is over.
        if len(full_text) > len(prefix_text) and (finished or not full_text.endswith(REPLACEMENT_CHAR)):
            self.text += full_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        elif finished and full_text != prefix_text:
            self.text += full_text[len(prefix_text) :]
        return self._release(finished)

    def _release(self, finished: bool) -> str:
        end, match = len(self.text), None
        for s in self.stop:
            pos = self.text.find(s, max(0, self.sent - len(s) + 1))
            if pos != -1 and pos < end:
                end, match, self.stopped = pos, s, True
        if match is not None and self.keep_stop:
            end += len(match)
        if self.stopped:
            self.text = self.text[:end]
        elif not finished and self.stop:
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
        return self.text[: self.sent] if not self.stopped else self.text
