"""The OpenAI-compatible routes: /v1/models, chat completions, responses, completions, embeddings and the
audio transcriptions and translations. Each parses its body once (server_state.body_of) and answers 503
until the model is loaded."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tessera.entrypoints.lora_routes import adapter_cards
from tessera.entrypoints.openai.chat import create_chat_completion
from tessera.entrypoints.openai.completions import create_completion
from tessera.entrypoints.openai.embeddings import create_embedding
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.request_models import route_docs
from tessera.entrypoints.openai.responses import create_response, get_response
from tessera.entrypoints.server_state import ServerState, body_of


def openai_router(state: ServerState) -> APIRouter:
    router, args, serving = APIRouter(), state.args, state.serving_or_503

    def model_card() -> dict:
        # root: the model as the user named it (a served name's base), as vLLM reports it; not the resolved path
        return {"id": args.model_name, "object": "model", "created": int(state.started), "owned_by": "tessera",
                "root": args.model_name, "parent": None, "max_model_len": serving().tm.context_length}

    @router.get("/v1/models", **route_docs("/v1/models"))
    async def models():
        return {"object": "list", "data": [model_card(), *adapter_cards(serving(), int(state.started))]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = {c["id"]: c for c in adapter_cards(serving(), int(state.started))}.get(model_id) or model_card()
        if model_id != card["id"]:
            raise APIError(f"model: the model {model_id!r} does not exist; this server serves {card['id']!r}",
                           status=404, param="model")
        return card

    @router.post("/v1/chat/completions", **route_docs("/v1/chat/completions"))
    async def chat(request: Request):
        return await create_chat_completion(serving(), request, await body_of(request, "/v1/chat/completions"))

    @router.post("/v1/responses", **route_docs("/v1/responses"))
    async def responses(request: Request):
        return await create_response(serving(), request, await body_of(request, "/v1/responses"))

    @router.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return get_response(response_id)

    @router.post("/v1/completions", **route_docs("/v1/completions"))
    async def completions(request: Request):
        return await create_completion(serving(), request, await body_of(request, "/v1/completions"))

    @router.post("/v1/embeddings", **route_docs("/v1/embeddings"))
    async def embeddings(request: Request):
        return await create_embedding(serving(), request, await body_of(request, "/v1/embeddings"))

    @router.post("/v1/audio/transcriptions", **route_docs("/v1/audio/transcriptions"))
    async def transcriptions(request: Request):
        serving()  # 503 until the model is loaded
        assert state.transcriptions is not None  # set together with state.serving
        return await state.transcriptions.create(request)

    @router.post("/v1/audio/translations", **route_docs("/v1/audio/translations"))
    async def translations(request: Request):
        serving()
        assert state.transcriptions is not None
        return await state.transcriptions.create(request, task="translate")

    return router
