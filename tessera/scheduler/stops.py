"""When a request is finished: its stop tokens, stop strings, grammar and length limits after each output
token (the scheduler checks every token it appends, one by one for a verify step's)."""

from __future__ import annotations

from tessera.messages.finish import FinishReason
from tessera.scheduler.req import Req


def find_stop_string(tokenizer, output_ids: list[int], stop: list[str]) -> str | None:
    """The stop string that starts first in the tail of the output, if any (ties: the first listed).
    Special tokens are decoded, so a stop string may name one."""
    if not stop:
        return None
    # Decode only the tail that can contain a new match (every earlier token was checked).
    text = tokenizer.decode(output_ids[-(max(len(s) for s in stop) + 8):], skip_special_tokens=False)
    found = [(pos, s) for s in stop if (pos := text.find(s)) != -1]
    return min(found, key=lambda f: f[0])[1] if found else None


def check_finished(req: Req, tokenizer, context_length: int) -> FinishReason | None:
    """Why the request is finished after its last output token (None: it goes on)."""
    sp, tok = req.sampling_params, req.output_ids[-1]
    if tok in req.stop_token_ids and (len(req.output_ids) > sp.min_new_tokens or req.grammar is not None):
        return FinishReason.stop(tok)
    # Stop strings are matched here only; the frontend's detokenizer cuts the text at the string
    # reported. Checked before the grammar and the length limits, so a stop string completed by
    # the last allowed token still ends the text.
    matched = find_stop_string(tokenizer, req.output_ids, sp.stop)
    if matched is not None:
        return FinishReason.stop(matched)
    if req.grammar is not None and req.grammar.is_terminated:  # the grammar admits nothing more
        return FinishReason.stop()
    if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= context_length:
        return FinishReason.of_length(len(req.output_ids))
    return None
