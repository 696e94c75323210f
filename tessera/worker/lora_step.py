"""The model worker's LoRA side: its adapters at start, the slot writes each step carries, the step's rows.

The scheduler owns which adapter is in which slot (scheduler/lora_slots.py); every rank follows the
ForwardInput's `lora_loads`, so tensor-parallel ranks hold the same adapters in the same slots.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from tessera.config import ServerArgs
from tessera.layers.lora.manager import LoraManager
from tessera.messages.worker import ForwardInput
from tessera.models.config import ModelConfig

logger = logging.getLogger("tessera.worker")


def build_lora(args: ServerArgs, model: nn.Module, config: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> LoraManager | None:
    """The worker's LoraManager with --lora-paths loaded (an adapter that fails stops the start-up, naming it);
    None without --enable-lora."""
    if not args.enable_lora:
        return None
    mapping = type(model).weight_mapping(config, args.language_model_only)
    manager = LoraManager(model, mapping, args.max_loras_per_batch, args.max_lora_rank, dtype, device,
                          args.lora_backend)
    for name, path in args.lora_adapters:
        adapter = manager.add(name, path)
        logger.info("LoRA adapter %r loaded from %s: rank %d, %d modules", name, path, adapter.rank,
                    len(adapter.modules))
    return manager


def lora_backend(lora: LoraManager | None) -> str:
    return "" if lora is None else lora.backend


def lora_active(lora: LoraManager | None) -> bool:
    """Whether the step in progress has rows with an adapter."""
    return lora is not None and lora.step.groups is not None


@contextmanager
def lora_rows(lora: LoraManager | None, fi: ForwardInput) -> Iterator[bool]:
    """Places the step's adapters in their slots, then scopes the forward's rows per slot; yields whether any
    row has an adapter."""
    if lora is None:
        with nullcontext():
            yield False
        return
    for slot, name in fi.lora_loads:
        lora.place(slot, name)
    with lora.rows(fi.lora_slots, fi.extend_lens) as active:
        yield active
