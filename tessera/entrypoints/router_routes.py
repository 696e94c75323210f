"""SGLang's worker routes that routers and operators poll: /server_info (with its older name), /get_load and
/flush_cache. sglang-router registers a worker from /server_info (the served model's name, the capacity
figures) and its load-aware policies poll /get_load."""

from __future__ import annotations

from fastapi import FastAPI


def add_router_routes(app: FastAPI, serving) -> None:
    """serving: () -> OpenAIServing, a 503 until the model is loaded."""

    @app.get("/server_info")  # SGLang's current name
    @app.get("/get_server_info")
    async def server_info():
        tm = serving().tm
        return {**tm.server_info(), "stats": (await tm.get_stats()).report()}

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report, one entry per data-parallel replica; num_tokens is the KV the replica holds."""
        tm = serving().tm
        await tm.get_stats()
        return [{"dp_rank": s.dp_rank, "num_reqs": s.num_running + s.num_waiting, "num_waiting_reqs": s.num_waiting,
                 "num_tokens": s.kv_used_tokens} for s in tm.replica_stats]

    @app.get("/flush_cache", operation_id="flush_cache_get")  # SGLang's clients use both methods
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache():
        await serving().tm.flush_cache()
        return {"status": "ok"}
