"""Tessera: a compact multimodal LLM serving engine (images, video, audio) with an OpenAI-compatible server."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]


def __getattr__(name: str):
    # Lazy: `import tessera` stays cheap (no torch import) for the CLI's --help.
    if name == "Engine":
        from tessera.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from tessera.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from tessera.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)
