"""SGLang's LoRA endpoints: /load_lora_adapter {lora_name, lora_path} and /unload_lora_adapter {lora_name}
(also under vLLM's /v1/ names), and the adapters' cards in /v1/models. A refused adapter is a 4xx in OpenAI's
error shape naming the field and the adapter; the server keeps serving."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tessera.entrypoints.openai.request_models import route_docs
from tessera.entrypoints.openai.serving import OpenAIServing
from tessera.entrypoints.server_state import ServerState, body_of


def adapter_cards(serving: OpenAIServing, created: int) -> list[dict]:
    """/v1/models entries of the loaded adapters, as vLLM lists them (root: the path, parent: the base)."""
    return [{"id": a["name"], "object": "model", "created": created, "owned_by": "tessera", "root": a["path"],
             "parent": serving.model_name, "max_model_len": serving.tm.context_length}
            for a in serving.tm.lora.cards()]


def lora_router(state: ServerState) -> APIRouter:
    router, serving = APIRouter(), state.serving_or_503

    def loaded(s: OpenAIServing) -> dict:
        return {a["name"]: a["path"] for a in s.tm.lora.cards()}

    @router.post("/load_lora_adapter", **route_docs("/load_lora_adapter"))
    @router.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request):
        s = serving()
        req = await body_of(request, "/load_lora_adapter")
        await s.tm.lora.load(req.lora_name, req.lora_path)
        return {"success": True, "error_message": "", "loaded_adapters": loaded(s)}

    @router.post("/unload_lora_adapter", **route_docs("/unload_lora_adapter"))
    @router.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request):
        s = serving()
        req = await body_of(request, "/unload_lora_adapter")
        await s.tm.lora.unload(req.lora_name)
        return {"success": True, "error_message": "", "loaded_adapters": loaded(s)}

    return router
