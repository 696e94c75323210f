"""Incremental detokenization: streamed text never splits a multi-byte character and never
changes text that was already sent. Stop strings are matched once, by the scheduler (which must
stop generating); here a tail that may be a forming stop string is held back, and the text is
cut at the string the scheduler reports as matched.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


def matched_stop_string(finished_reason: dict | None) -> str | None:
    """The stop string a finish reports as matched (None for a stop token, a length limit, ...)."""
    if finished_reason is None or finished_reason.get("type") != "stop":
        return None
    matched = finished_reason.get("matched")
    return matched if isinstance(matched, str) else None


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

    def add(self, new_ids: list[int], finished_reason: dict | None = None) -> str:
        """Feeds tokens and, on the request's last output, its finish reason; returns the newly
        releasable text."""
        finished = finished_reason is not None
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
        matched = matched_stop_string(finished_reason)
        if matched is not None:
            self._cut_at(matched)
        return self._release(finished)

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
