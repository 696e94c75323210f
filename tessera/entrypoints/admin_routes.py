"""The operators' and routers' routes: /health, /version, /metrics, and SGLang's worker routes that routers
poll: /server_info (with its older name), /get_load and /flush_cache. sglang-router registers a worker from
/server_info (the served model's name, the capacity figures) and its load-aware policies poll /get_load."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

from tessera.entrypoints.openai.errors import error_response
from tessera.entrypoints.server_state import ServerState
from tessera.version import __version__ as tessera_version


def admin_router(state: ServerState) -> APIRouter:
    router, args, serving = APIRouter(), state.args, state.serving_or_503

    @router.get("/health")
    async def health():
        if state.ready and not state.warming_up:
            return {"status": "ok"}
        return error_response(f"not ready: {state.not_ready_reason()}", 503)

    @router.get("/version")
    async def version():
        return {"version": tessera_version}

    @router.get("/metrics")
    async def metrics():
        if not args.enable_metrics:
            return error_response("metrics are disabled; start the server with --enable-metrics", 404)
        stats = None
        if state.ready:
            try:
                stats = await state.tm.get_stats(timeout=2.0)
            except asyncio.TimeoutError:
                stats = None
        frontend = state.tm.frontend_stats() if state.ready else None
        replicas = state.tm.replica_stats if stats is not None and state.tm is not None else ()
        in_frontend = len(state.tm.states) if state.tm is not None else None
        return Response(state.metrics.render(stats, frontend, replicas, in_frontend),
                        media_type="text/plain; version=0.0.4")

    @router.get("/server_info")  # SGLang's current name
    @router.get("/get_server_info")
    async def server_info():
        tm = serving().tm
        return {**tm.server_info(), "stats": (await tm.get_stats()).report()}

    @router.get("/get_load")
    async def get_load():
        """SGLang's load report, one entry per data-parallel replica; num_tokens is the KV the replica holds."""
        tm = serving().tm
        await tm.get_stats()
        return [{"dp_rank": s.dp_rank, "num_reqs": s.num_running + s.num_waiting, "num_waiting_reqs": s.num_waiting,
                 "num_tokens": s.kv_used_tokens} for s in tm.replica_stats]

    @router.get("/flush_cache", operation_id="flush_cache_get")  # SGLang's clients use both methods
    @router.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache():
        await serving().tm.flush_cache()
        return {"status": "ok"}

    return router
