"""SGLang's native routes: /generate, /tokenize and /detokenize, /model_info (and its older name) and the deep
health check /health_generate."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tessera.entrypoints import native_generate
from tessera.entrypoints.openai import tokenization
from tessera.entrypoints.openai.request_models import route_docs
from tessera.entrypoints.server_state import ServerState, body_of
from tessera.frontend.request import GenerateRequest
from tessera.messages.sampling import SamplingParams


def native_router(state: ServerState) -> APIRouter:
    router, args, serving = APIRouter(), state.args, state.serving_or_503

    @router.post("/generate", **route_docs("/generate"))
    async def generate(request: Request):
        return await native_generate.generate(serving(), request, await body_of(request, "/generate"))

    @router.post("/tokenize", **route_docs("/tokenize"))
    async def tokenize(request: Request):
        return tokenization.tokenize(serving(), await body_of(request, "/tokenize"))

    @router.post("/detokenize", **route_docs("/detokenize"))
    async def detokenize(request: Request):
        return tokenization.detokenize(serving(), await body_of(request, "/detokenize"))

    @router.get("/health_generate")
    async def health_generate():
        """SGLang's deep health check: one token through the whole pipeline."""
        srv = serving()
        req = GenerateRequest(text="ping", sampling_params=SamplingParams(max_new_tokens=1, temperature=0))
        async for _ in srv.tm.generate(req):
            pass
        return {"status": "ok"}

    @router.get("/get_model_info")  # SGLang's older name of /model_info
    @router.get("/model_info")
    async def model_info():
        info = serving().tm.info
        return {"model_path": args.model_path, "served_model_name": args.model_name,
                "architectures": [info.architecture], "context_length": info.context_length,
                "is_generation": not info.is_embedding,
                "has_image_understanding": info.has_image_understanding,
                "has_video_understanding": info.has_video_understanding,
                "has_audio_understanding": info.has_audio_understanding}

    return router
