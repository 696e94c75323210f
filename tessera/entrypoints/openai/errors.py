"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              422: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")


def error_response(message: str, status: int = 400, param: str | None = None, type_: str | None = None) -> JSONResponse:
    err = APIError(message, status, param, type_)
    return JSONResponse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}},
                        status_code=status)


_KNOWN_PARAMS = {"prompt", "input_ids", "messages", "model", "image_data", "video_data", "audio_data", "media",
                 "max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                 "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
                 "top_logprobs", "top_logprobs_num", "min_new_tokens", "sampling_params", "image", "video",
                 "audio"}


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the field name ("temperature must be ...", "prompt: ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip()
    return head if head in _KNOWN_PARAMS else None
