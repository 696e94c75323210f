"""load_model: the family table's model class, built from the ModelConfig and filled from the checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tessera.layers.attention import get_attention_backend, resolve_attention_backend
from tessera.layers.quantization.int_linear import quantize_linears
from tessera.models.base import TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.families import get_family, supported_architectures
from tessera.models.weights import load_weights
from tessera.layers.linear import keep_weights_in
from tessera.platform.device import compute_dtype, default_dtype, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

__all__ = ["get_model_class", "load_model", "supported_architectures"]

logger = logging.getLogger(__name__)


def get_model_class(architecture: str) -> type[TesseraModel]:
    """Our model class for an HF architecture; UnsupportedArchitectureError (a ValueError) naming it."""
    return get_family(architecture).model_class()


def load_model(
    model_path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    language_model_only: bool = False,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch_native",
    config: ModelConfig | None = None,
    torchao_config: str = "",
) -> tuple[TesseraModel, ModelConfig]:
    """Builds our model for the local HF checkpoint dir `model_path` and loads its safetensors.

    Returns (model in eval mode without grads, its ModelConfig). On a CPU a 16-bit dtype keeps the linear
    layers' weights in it and builds the rest in float32 (Platform.computes_16bit). With language_model_only the encoders are
    neither built nor loaded (their checkpoint tensors are skipped). Raises WeightLoadError on mismatch.
    torchao_config (config.TORCHAO_CONFIGS) quantizes the language model's linears once loaded; what runs
    them is then `model.quantization` ("" for float weights).
    """
    config = config or ModelConfig.load(model_path)
    if torchao_config and config.quant is not None:
        raise ValueError(f"torchao_config: {torchao_config!r} quantizes a float checkpoint; {model_path} is already "
                         f"quantized ({config.quant.scheme})")
    cls = config.family.model_class()
    dev = resolve_device(device)
    if config.family.impl == "transformers":
        return _load_transformers(model_path, config, dtype, dev, attention_backend, torchao_config,
                                  language_model_only), config
    weight_dtype = resolve_dtype(dtype, config.dtype, dev)
    torch_dtype = compute_dtype(weight_dtype, dev)  # activations, norms, the KV pool
    attention_backend = resolve_attention_backend(attention_backend, dev, torch_dtype)
    backend = get_attention_backend(attention_backend)
    logger.info("%s runs on its native implementation (%s)", config.architecture, config.family.model)
    if backend.dtypes is not None and torch_dtype not in backend.dtypes:
        raise ValueError(f"attention_backend={attention_backend!r} runs {sorted(str(d) for d in backend.dtypes)}, "
                         f"not dtype {torch_dtype}")
    # Per-layer sliding windows are a config fact too (Qwen2/Mistral may set them without their family needing it).
    needs = config.family.backend_needs | ({"sliding_window"} if any(config.sliding_windows) else set())
    if not needs <= backend.features:
        raise ValueError(f"attention_backend={attention_backend!r} lacks {sorted(needs - backend.features)}, which "
                         f"{config.family.name} needs")
    with torch.device(dev), default_dtype(torch_dtype):
        model = cls.build(config, backend, language_model_only)
        if weight_dtype != torch_dtype:  # 16-bit weights computed in float32 (layers/half_linear.py)
            keep_weights_in(model, weight_dtype)
    placed = load_weights(model, model_path, cls.weight_mapping(config, language_model_only), config.quant)
    if config.quant is not None:
        model.quantization = config.quant.describe(placed.values())
        logger.info("quantized checkpoint: %s (%d linears stored quantized)", model.quantization, len(placed))
    model.eval().requires_grad_(False)
    if torchao_config:
        model.quantization = quantize_linears(model, torchao_config)
        logger.info("quantization: %s", model.quantization)
    return model, config


def _load_transformers(model_path: str | Path, config: ModelConfig, dtype: torch.dtype | str, dev: torch.device,
                       attention_backend: str, torchao_config: str, language_model_only: bool) -> TesseraModel:
    """The Transformers backend's model (models/transformers_backend.py), loaded by transformers in the compute
    dtype; what it cannot run is refused here, naming why."""
    from tessera.models.transformers_backend import TransformersModel, register_attention
    from tessera.models.transformers_layers import fuse_siblings

    if config.quant is not None:
        raise ValueError(f"model_impl: the Transformers backend loads float checkpoints; {config.architecture}'s is "
                         f"pre-quantized ({config.quant.scheme}): serve a float one (--torchao-config quantizes it)")
    torch_dtype = compute_dtype(resolve_dtype(dtype, config.dtype, dev), dev)
    backend = get_attention_backend(resolve_attention_backend(attention_backend, dev, torch_dtype))
    register_attention()
    model = TransformersModel.load(model_path, config, backend, torch_dtype, dev, language_model_only)
    model.eval().requires_grad_(False)
    if torchao_config:  # the text decoder's linears are ours (transformers_layers.adopt_our_layers)
        model.quantization = quantize_linears(model, torchao_config, prefix="hf." + model.language_model_prefix)
        logger.info("quantization: %s", model.quantization)
    else:  # q/k/v and gate/up as one product each (float weights only)
        fuse_siblings(model)
    logger.info("%s runs on the Transformers backend (its transformers modeling code, Tessera's paged attention)",
                config.architecture)
    return model
