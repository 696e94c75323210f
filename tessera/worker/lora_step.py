"""The model worker's LoRA side: its adapters at start, the slot writes each step carries, the step's rows.

The scheduler owns which adapter is in which slot (scheduler/lora_slots.py); every rank follows the
ForwardInput's `lora_loads`, so tensor-parallel ranks hold the same adapters in the same slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from tessera.config import ServerArgs
from tessera.layers.lora.manager import LoraManager
from tessera.messages.items import MultimodalDataItem
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
    # The data-parallel encoder path (distributed/encoder_dp.py) encodes without adapters: vision LoRA refused there.
    manager = LoraManager(model, mapping, args.max_loras_per_batch, args.max_lora_rank, dtype, device,
                          args.lora_backend, encoders=not (args.mm_enable_dp_encoder and args.tp_size > 1))
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


def by_adapter(lora: LoraManager | None, names: list[str | None], run: Callable[[list[int]], None]) -> None:
    """`run(indices)` once per adapter among `names` (one per entry; None: the base model) whose adapter targets
    the encoders' linears, under that adapter (the others' entries together, without one); one call over all
    entries when none does."""
    names = [n if lora is not None and lora.targets_encoder(n) else None for n in names]
    if lora is None or not any(names):
        run(list(range(len(names))))
        return
    for name in dict.fromkeys(names):
        with lora.encoding(name):
            run([i for i, n in enumerate(names) if n == name])


def encode_by_adapter(lora: LoraManager | None, items: list[MultimodalDataItem],
                      encode: Callable[[list[MultimodalDataItem]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """One encoder call per adapter on the encoders among `items` (the base model's and other adapters' items
    together), outputs in the items' order. Called under the worker's encoder lock."""
    out: list[torch.Tensor | None] = [None] * len(items)

    def run(idx: list[int]) -> None:
        for i, emb in zip(idx, encode([items[i] for i in idx])):
            out[i] = emb

    by_adapter(lora, [it.lora_name for it in items], run)
    return out  # type: ignore[return-value]
