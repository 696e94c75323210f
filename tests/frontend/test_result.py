"""The typed answer and its wire shapes: FinishReason serialised as SGLang's meta_info finish_reason and OpenAI's
finish_reason / matched_stop, and GenerateResult.meta_info with its keys in SGLang's order, each optional one
present only when the request asked for it (or had it)."""

from __future__ import annotations

from tessera.frontend.result import GenerateResult
from tessera.messages.finish import FinishKind, FinishReason


def test_finish_reasons_have_sglangs_and_openais_shapes() -> None:
    assert FinishReason.stop(7).to_meta() == {"type": "stop", "matched": 7}
    assert FinishReason.stop("END").to_meta() == {"type": "stop", "matched": "END"}
    assert FinishReason.stop().to_meta() == {"type": "stop", "matched": None}  # grammar end, an embedding
    assert FinishReason.of_length(5).to_meta() == {"type": "length", "length": 5}
    assert FinishReason.abort().to_meta() == {"type": "abort", "message": "aborted by client"}
    assert [r.openai for r in (FinishReason.stop(7), FinishReason.of_length(1), FinishReason.abort())] == \
        ["stop", "length", "abort"]
    assert FinishReason.stop(7).matched_stop == 7 and FinishReason.stop(7).stop_string is None
    assert FinishReason.stop("END").stop_string == "END" and FinishReason.of_length(3).matched_stop is None
    failed = FinishReason.error("boom", unavailable=True)
    assert failed.is_error and failed.kind is FinishKind.ERROR and failed.unavailable


def test_meta_info_keys_in_order_and_only_when_asked() -> None:
    plain = GenerateResult("r", "hi", "hi", [5, 6], FinishReason.of_length(2), prompt_tokens=3, completion_tokens=2,
                           cached_tokens=1, e2e_latency=0.5, ttft=0.1)
    assert list(plain.meta_info()) == ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                                       "e2e_latency", "ttft"]
    assert plain.meta_info()["finish_reason"] == {"type": "length", "length": 2}
    assert plain.to_dict() == {"text": "hi", "delta": "hi", "output_ids": [5, 6], "meta_info": plain.meta_info()}
    full = GenerateResult("r", "hi", "", [5, 6], None, 3, 2, 0, 0.5, None,
                          output_token_logprobs=[(-0.1, 5), (-0.2, 6)], output_top_logprobs=[],
                          input_token_logprobs=[(None, 1), (-1.0, 2)], input_top_logprobs=None,
                          input_token_ranks=[None, 1], spec_verify_ct=2, spec_accepted_tokens=3)
    meta = full.meta_info()
    assert list(meta)[7:] == ["output_token_logprobs", "spec_verify_ct", "spec_accept_length",
                              "input_token_logprobs", "input_top_logprobs", "input_token_ranks"]
    assert meta["finish_reason"] is None and meta["spec_accept_length"] == 2.5  # (2 + 3) / 2
    assert full.with_alternatives_cut(1).output_top_logprobs == [] and full.openai_finish_reason is None
