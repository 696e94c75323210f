"""The real ASGI app over demo-vl's real frontend (tokenizer, processors, limits, validation) with a stand-in for
the scheduler: every request that passes validation finishes at once with one token ("ok", id 11), or with a
scripted reply streamed piece by piece (`reply`). For tests of the request paths that need no model run
(tests/server/test_fuzz.py, test_request_models.py) and of the parsers over a model's text (test_tool_formats.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stub_client(reply: list[str] | None = None, **server_args) -> Iterator:
    """reply: the pieces (tokens) of every answer, each one output step; server_args: ServerArgs fields."""
    from fastapi.testclient import TestClient

    from tessera.config import ServerArgs
    from tessera.entrypoints.http_server import create_app
    from tessera.entrypoints.openai.serving import OpenAIServing
    from tessera.entrypoints.openai.transcriptions import TranscriptionServing
    from tessera.frontend.result import GenerateResult
    from tessera.frontend.tokenizer_manager import TokenizerManager
    from tessera.messages.finish import FinishReason

    class NoScheduler(TokenizerManager):
        scheduler_alive = True

        async def generate(self, req, tokenized=None):
            if tokenized is None:
                tokenized = await self.tokenize(req)
            n = len(tokenized.input_ids)
            logprobs = dict(output_token_logprobs=[(-0.5, 11)], output_top_logprobs=[[(-0.5, 11)]]) \
                if req.return_logprob else {}
            if reply is None:
                yield GenerateResult(req.rid, "ok", "ok", [11], FinishReason.of_length(1), n, 1, 0, 0.0, 0.0,
                                     **logprobs)
                return
            text = ""
            for k, piece in enumerate(reply):
                text += piece
                last = k == len(reply) - 1
                if last or req.stream:
                    yield GenerateResult(req.rid, text, piece, [11] * (k + 1), FinishReason.stop() if last else None,
                                         n, len(reply) if last else 1, 0, 0.0, 0.0, **logprobs)

    args = ServerArgs(model_path="demo-vl", max_total_tokens=65536, **server_args)
    app = create_app(args)
    state = app.state.tessera
    tm = NoScheduler(args)
    tm.ready, tm.max_total_tokens = True, 65536
    state.tm, state.serving = tm, OpenAIServing(tm, args.model_name)
    state.transcriptions = TranscriptionServing(state.serving)
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c
    finally:
        tm.shutdown()
