"""Tessera: a compact multimodal LLM serving engine (images, video, audio) with an OpenAI-compatible server."""

from __future__ import annotations

from tessera.version import __version__
# The program API (tessera.lang), importable from the top as in SGLang: tessera.function, tessera.gen, ...
_LANG = ("function", "gen", "select", "user", "assistant", "system", "image", "video", "audio", "fork", "run_batch",
         "RuntimeEndpoint", "set_default_backend")
__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__", *_LANG]


def __getattr__(name: str):
    # Lazy: `import tessera` stays cheap (no torch import) for the CLI's --help.
    if name == "Engine":
        from tessera.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from tessera.messages.sampling import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from tessera.config import ServerArgs

        return ServerArgs
    if name in _LANG:
        import tessera.lang

        return getattr(tessera.lang, name)
    raise AttributeError(name)
