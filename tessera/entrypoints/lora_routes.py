"""SGLang's LoRA endpoints: /load_lora_adapter {lora_name, lora_path} and /unload_lora_adapter {lora_name}
(also under vLLM's /v1/ names), and the adapters' cards in /v1/models. A refused adapter is a 4xx in OpenAI's
error shape naming the field and the adapter; the server keeps serving."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.request_models import (LoadLoraAdapterRequest, UnloadLoraAdapterRequest,
                                                      openapi_body)
from tessera.entrypoints.openai.serving import OpenAIServing


def _fields(body: dict, model: type[BaseModel]) -> dict:
    for name in body:
        if name not in model.model_fields:
            raise APIError(f"{name}: unknown field (accepted: {', '.join(model.model_fields)})", param=name)
    for name, info in model.model_fields.items():
        if info.is_required() and not isinstance(body.get(name), str):
            raise APIError(f"{name}: required, a string", param=name)
    return body


def adapter_cards(serving: OpenAIServing, created: int) -> list[dict]:
    """/v1/models entries of the loaded adapters, as vLLM lists them (root: the path, parent: the base)."""
    return [{"id": a["name"], "object": "model", "created": created, "owned_by": "tessera", "root": a["path"],
             "parent": serving.model_name, "max_model_len": serving.tm.context_length}
            for a in serving.tm.lora.cards()]


def add_lora_routes(app: FastAPI, serving: Callable[[], OpenAIServing],
                    body_of: Callable[[Request], Awaitable[dict]]) -> None:
    def loaded(s: OpenAIServing) -> dict:
        return {a["name"]: a["path"] for a in s.tm.lora.cards()}

    @app.post("/load_lora_adapter", openapi_extra=openapi_body("/load_lora_adapter"))
    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request):
        s = serving()
        body = _fields(await body_of(request), LoadLoraAdapterRequest)
        await s.tm.lora.load(body["lora_name"], body["lora_path"])
        return {"success": True, "error_message": "", "loaded_adapters": loaded(s)}

    @app.post("/unload_lora_adapter", openapi_extra=openapi_body("/unload_lora_adapter"))
    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request):
        s = serving()
        body = _fields(await body_of(request), UnloadLoraAdapterRequest)
        await s.tm.lora.unload(body["lora_name"])
        return {"success": True, "error_message": "", "loaded_adapters": loaded(s)}

