"""Attention backends, looked up by name (lazily, so optional kernels load only when chosen)."""

from __future__ import annotations

import importlib

from tessera.layers.attention.base import BaseAttentionBackend

# name -> "module:Class"
_BACKENDS: dict[str, str] = {
    "torch_native": "tessera.layers.attention.torch_native:TorchNativeAttentionBackend",
    # Paged attention in Triton kernels (CUDA; on a CPU only under TRITON_INTERPRET=1, for tests).
    "triton": "tessera.layers.attention.triton_backend:TritonAttentionBackend",
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> BaseAttentionBackend:
    """A fresh backend instance (backends hold per-step state, so each model gets its own)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of {available_attention_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls()


__all__ = ["BaseAttentionBackend", "available_attention_backends", "get_attention_backend"]
