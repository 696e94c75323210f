"""load_model: the family table's model class, built from the ModelConfig and filled from the checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tessera.layers.attention import get_attention_backend, resolve_attention_backend
from tessera.models.base import TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.families import get_family, supported_architectures
from tessera.models.weights import load_weights

__all__ = ["get_model_class", "load_model", "resolve_dtype", "resolve_device", "supported_architectures"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def get_model_class(architecture: str) -> type[TesseraModel]:
    """Our model class for an HF architecture; UnsupportedArchitectureError (a ValueError) naming it."""
    return get_family(architecture).model_class()


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; "cuda" without CUDA -> ValueError in one line."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"device: expected auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ValueError(f"device: {name!r} requested but no CUDA device is available ({build}); "
                         "use --device cpu or --device auto")
    return torch.device(name)


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig | None = None,
                  device: torch.device | str = "cpu") -> torch.dtype:
    """torch dtype, or "float32"/"float16"/"bfloat16", or "auto": the checkpoint's dtype (float32 when the
    checkpoint records none). On CPU, auto turns a float16 checkpoint into bfloat16: CPU float16 matmuls
    are emulated and slow, bfloat16 has the same size and native kernels."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = config.dtype if config is not None else None
        resolved = _DTYPES.get(name or "float32", torch.float32)
        if resolved == torch.float16 and torch.device(device).type == "cpu":
            return torch.bfloat16
        return resolved
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
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
    config: ModelConfig | None = None,
) -> tuple[TesseraModel, ModelConfig]:
    """Builds our model for the local HF checkpoint dir `model_path` and loads its safetensors.

    Returns (model in eval mode without grads, its ModelConfig). With language_model_only the encoders are
    neither built nor loaded (their checkpoint tensors are skipped). Raises WeightLoadError on mismatch.
    """
    config = config or ModelConfig.load(model_path)
    cls = config.family.model_class()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, dev)
    attention_backend = resolve_attention_backend(attention_backend, dev, torch_dtype)
    backend = get_attention_backend(attention_backend)
    if backend.dtypes is not None and torch_dtype not in backend.dtypes:
        raise ValueError(f"attention_backend={attention_backend!r} runs {sorted(str(d) for d in backend.dtypes)}, "
                         f"not dtype {torch_dtype}")
    # Per-layer sliding windows are a config fact too (Qwen2/Mistral may set them without their family needing it).
    needs = config.family.backend_needs | ({"sliding_window"} if any(config.sliding_windows) else set())
    if not needs <= backend.features:
        raise ValueError(f"attention_backend={attention_backend!r} lacks {sorted(needs - backend.features)}, which "
                         f"{config.family.name} needs")
    with torch.device(dev), _default_dtype(torch_dtype):
        model = cls.build(config, backend, language_model_only)
    load_weights(model, model_path, cls.weight_mapping(config, language_model_only))
    model.eval().requires_grad_(False)
    return model, config
