"""Architecture name (config.architectures[0]) -> our model class, imported lazily; and load_model."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.layers.attention import get_attention_backend
from tessera.models.weights import load_weights

# architecture -> "module:Class"; adding a model is one line here plus its file.
_MODELS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "tessera.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "tessera.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "Qwen2ForCausalLM": "tessera.models.qwen2:Qwen2ForCausalLM",
}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"architectures[0]={architecture!r} is not supported; supported: {supported_architectures()}")
    module_name, cls_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def resolve_dtype(dtype: torch.dtype | str, hf_config: Any) -> torch.dtype:
    """torch dtype, or "float32"/"float16"/"bfloat16", or "auto" (the checkpoint's dtype, float32 if unset)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt, torch.dtype):
            return ckpt
        return _DTYPES.get(str(ckpt), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are allocated in the target dtype directly (no float32 copy of a large model).
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    language_model_only: bool = False,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch_native",
) -> tuple[nn.Module, Any]:
    """Builds our model for the local HF checkpoint dir `model_path` and loads its safetensors.

    Returns (model in eval mode without grads, hf_config). With language_model_only the vision tower is
    neither built nor loaded (its checkpoint tensors are skipped). Raises WeightLoadError on mismatch.
    """
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_path))
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{model_path}/config.json has no 'architectures' entry")
    cls = get_model_class(archs[0])
    torch_dtype = resolve_dtype(dtype, hf_config)
    with torch.device(device), _default_dtype(torch_dtype):
        model = cls.from_hf_config(  # type: ignore[attr-defined]
            hf_config, attn_backend=get_attention_backend(attention_backend), language_model_only=language_model_only
        )
    load_weights(model, model_path, cls.weight_mapping(hf_config, language_model_only))  # type: ignore[attr-defined]
    model.eval().requires_grad_(False)
    return model, hf_config
