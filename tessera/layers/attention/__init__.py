"""Attention backends, looked up by name (lazily, so optional kernels load only when chosen)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from tessera.layers.attention.base import BaseAttentionBackend

# name -> "module:Class"
_BACKENDS: dict[str, str] = {
    "torch_native": "tessera.layers.attention.torch_native:TorchNativeAttentionBackend",
    # Paged attention in Triton kernels (CUDA; on a CPU only under TRITON_INTERPRET=1, for tests).
    "triton": "tessera.layers.attention.triton_backend:TritonAttentionBackend",
    # FlashInfer's kernels (CUDA, float16/bfloat16; `pip install 'tessera[cuda]'`).
    "flashinfer": "tessera.layers.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """`auto` on CUDA: triton when triton is installed (its kernels read the paged pool directly, in any dtype,
    and plan decode steps that a CUDA graph can replay; the layers' fused kernels write K/V for it). FlashInfer
    stays opt-in (`--attention-backend flashinfer`) until it has run on a GPU: its backend is tested only
    against a stand-in of its API. torch_native elsewhere (CPU: the Triton kernels would only run in the
    interpreter). Any other name is returned as it is; `dtype` is kept for the callers' sake."""
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "torch_native"
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_native"


def uses_decode_mirror(device: torch.device | str) -> bool:
    """Whether torch_native keeps the decode K/V mirror (contiguous per-request K/V across decode steps): on a
    CPU, where it measured faster than gathering from the pages; elsewhere the paged kernels read the pool."""
    return torch.device(device).type == "cpu"


def get_attention_backend(name: str) -> BaseAttentionBackend:
    """A fresh backend instance (backends hold per-step state, so each model gets its own)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of {available_attention_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    backend = cls()
    backend.name = name
    return backend


__all__ = ["BaseAttentionBackend", "available_attention_backends", "get_attention_backend",
           "resolve_attention_backend", "uses_decode_mirror"]
