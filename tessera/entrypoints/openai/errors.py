"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from fastapi.responses import JSONResponse

# Where the server's own code and libraries live: never named in a response (paths are logged, not sent).
_PRIVATE_ROOTS = sorted({str(Path(__file__).resolve().parents[3]), sys.prefix, sys.base_prefix}, key=len,
                        reverse=True)
_TRACEBACK = re.compile(r"\s*Traceback \(most recent call last\):.*", re.S)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.type = type_ or {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def public_message(message: str) -> str:
    """The message with any traceback cut off and the server's install paths hidden."""
    message = _TRACEBACK.sub("", message)
    for root in _PRIVATE_ROOTS:
        if root and root != "/":
            message = message.replace(root, "<server>")
    return message


def _error_dict(message: str, status: int, param: str | None, type_: str | None) -> dict:
    err = APIError(public_message(message), status, param, type_)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None, type_: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(_error_dict(message, status, param, type_), status_code=status, headers=headers)


def error_body(message: str, status: int = 400, param: str | None = None) -> bytes:
    """The same error as JSON bytes, for the ASGI middleware."""
    return json.dumps(_error_dict(message, status, param, None)).encode()


_KNOWN_PARAMS = {"prompt", "input_ids", "messages", "model", "image_data", "video_data", "audio_data", "media",
                 "max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                 "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
                 "top_logprobs", "top_logprobs_num", "min_new_tokens", "sampling_params", "image", "video",
                 "audio", "logit_bias", "no_stop_trim", "ignore_eos", "skip_special_tokens", "min_tokens",
                 "max_completion_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                 "response_format", "regex", "ebnf", "json_schema", "logprob_start_len", "lora_path", "lora_name"}


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the field name ("temperature must be ...", "prompt: ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip()
    return head if head in _KNOWN_PARAMS else None
