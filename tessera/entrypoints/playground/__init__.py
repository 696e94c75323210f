"""The playground: a chat page at GET / for trying the served model in a browser.

Plain HTML, CSS and JavaScript shipped inside the package (static/), so there is no build step and the
page works offline: it talks to this server's own /v1/chat/completions (SSE), /model_info and /health.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from tessera.entrypoints.openai.errors import error_response

STATIC_DIR = Path(__file__).parent / "static"
PREFIX = "/playground/"
# Explicit types: mimetypes' answer for .js depends on the Python version and /etc/mime.types, and a
# browser refuses a script or stylesheet served with the wrong one.
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def is_public(path: str) -> bool:
    """The page and its assets load without the API key: a browser cannot add a header to a page load.
    The page asks for the key and sends it on its API calls, which stay protected."""
    return path == "/" or path.startswith(PREFIX)


def playground_router(*, api_key_required: bool) -> APIRouter:
    router = APIRouter()
    # A fixed table of names, so a request can never name a file outside static/.
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}

    def serve(path: Path) -> FileResponse:
        # no-cache: revalidate (ETag) on each load, so a server upgrade never runs a stale page.
        return FileResponse(path, media_type=CONTENT_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})

    @router.get("/", include_in_schema=False)
    async def playground_page():
        return serve(files["index.html"])

    @router.get(PREFIX + "config.json", include_in_schema=False)
    async def playground_config():
        return {"api_key_required": api_key_required}

    @router.get(PREFIX + "{name}", include_in_schema=False)
    async def playground_asset(name: str):
        path = files.get(name)
        if path is None:
            return error_response(f"no playground file named {name!r}", 404)
        return serve(path)

    return router
