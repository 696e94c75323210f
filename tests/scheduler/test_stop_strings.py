"""Stop strings are matched in the scheduler, once per sampled token; the frontend only cuts the text."""

from __future__ import annotations

from types import SimpleNamespace

from tessera.messages.sampling import SamplingParams
from tessera.scheduler.req import Req
from tessera.messages.finish import FinishReason
from tessera.scheduler.scheduler import Scheduler
from tessera.scheduler.stops import find_stop_string


class CharTokenizer:
    """One token per character; id 0 is a special token decoded as <eos>."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i == 0 and skip_special_tokens else "<eos>" if i == 0 else chr(i) for i in ids)


def test_the_earliest_stop_string_in_the_tail_is_reported() -> None:
    tok = CharTokenizer()
    assert find_stop_string(tok, tok.encode("the answer is red"), ["answer", "red"]) == "answer"
    assert find_stop_string(tok, tok.encode("xx red"), ["ed", "red"]) == "red"
    assert find_stop_string(tok, tok.encode("xx red"), ["blue"]) is None
    assert find_stop_string(tok, tok.encode("xx red"), []) is None
    # Special tokens are decoded for matching.
    assert find_stop_string(tok, tok.encode("ok") + [0], ["<eos>"]) == "<eos>"


def _finish(text: str, **params) -> FinishReason | None:
    tok = CharTokenizer()
    sp = SamplingParams(**params).normalize()
    req = Req("r", [1, 2, 3], sp, None)
    req.output_ids = tok.encode(text)
    req.stop_token_ids = sp.stop_ids(eos_ids=())
    return Scheduler._check_finished(SimpleNamespace(tokenizer=tok, context_length=1000), req)


def test_a_stop_string_on_the_last_allowed_token_is_a_stop() -> None:
    # The frontend cuts the text only at a reported match, so the match wins over the length limit.
    assert _finish("say STOP", max_new_tokens=8, stop=["STOP"]) == FinishReason.stop("STOP")
    assert _finish("say STO", max_new_tokens=7, stop=["STOP"]) == FinishReason.of_length(7)
    assert _finish("say", max_new_tokens=8, stop=["STOP"]) is None
    # A stop token on the same token is reported as the token (as before).
    assert _finish("say STOP", max_new_tokens=8, stop=["STOP"], stop_token_ids=[ord("P")]) == FinishReason.stop(
        ord("P"))
