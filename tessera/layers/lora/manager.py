"""LoraManager: a model's adapters (on the host), its slots (on the device), and the step's rows per slot.

The scheduler decides which adapter sits in which slot (scheduler/lora_slots.py, least recently used out) and
says so in each ForwardInput; this class only follows: `place` copies an adapter's host tensors into a slot of
every layer with LoRA stacks (zeros where it targets nothing), `rows` scopes a forward's rows per slot. A layer
gets its stacks the first time an adapter targets it, or, before decode graphs are captured, every language
model linear gets them at once at a fixed rank (`fix_stacks`): a graph replays the addresses it captured.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tessera.layers.linear import Linear, MergedLinear
from tessera.layers.lora.adapter import LoraAdapter, load_adapter, on_token_rows
from tessera.layers.lora.config import AdapterError
from tessera.layers.lora.slots import EncoderAdapter, EncoderLora, LoraSlots, LoraStep, attach_encoder_lora
from tessera.platform.device import platform_of


def kernels_for(backend: str, device: torch.device) -> bool:
    """Whether `--lora-backend` means the Triton kernels on `device`."""
    if backend == "torch":
        return False
    runs = platform_of(device).runs_triton
    if backend in ("triton", "csgmv") and not runs and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"lora_backend: {backend} needs a device that runs Triton (CUDA), not {device}")
    return runs or backend in ("triton", "csgmv")


class LoraManager:
    def __init__(self, model: nn.Module, mapping, num_slots: int, max_rank: int | None, dtype: torch.dtype,
                 device: torch.device, backend: str = "auto", encoders: bool = True):
        self.model, self.mapping = model, mapping
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.adapters: dict[str, LoraAdapter] = {}
        self.encoders = encoders  # whether adapters may target the encoders' linears (see load_adapter)
        self.encoder_adapter = EncoderAdapter()  # the adapter of the encoder call in progress
        self.slot_names: list[str | None] = [None] * num_slots
        # The Triton kernels (layers/lora/triton_lora.py) where the platform runs Triton (`auto`, `triton` and
        # SGLang's `csgmv`), or under the interpreter when asked by name; grouped / stacked torch products else.
        self.step = LoraStep(dtype=dtype, kernels=kernels_for(backend, device))
        self.fixed_rank: int | None = None  # set by fix_stacks: the stacks no longer move or grow

    # ---- adapters ----------------------------------------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Loads the adapter onto the host under `name`; AdapterError leaves everything as it was."""
        if not name or not isinstance(name, str):
            raise AdapterError("lora_name: must be a non-empty string")
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is already loaded (unload it first)")
        adapter = load_adapter(name, path, self.model, self.mapping, self.max_rank, self.encoders)
        if self.fixed_rank is not None and adapter.rank > self.fixed_rank:
            raise AdapterError(f"adapter {name!r}: rank {adapter.rank} is above {self.fixed_rank}, the rank the "
                               "decode CUDA graphs were captured for (start the server with --max-lora-rank)")
        for target, shards in adapter.modules.items():  # stacks for the layers it targets, deep enough for its rank
            if on_token_rows(self.model, target):
                self._stacks(target).ensure_rank(adapter.rank)
            else:  # an encoder's linear: the adapter's own pair, on the device
                (a, b), = shards
                self._encoder_lora(target).adapters[name] = (a.to(self.device, self.dtype),
                                                             b.T.contiguous().to(self.device, self.dtype))
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} is not loaded")
        del self.adapters[name]
        for _, module in self.model.named_modules():
            if isinstance(getattr(module, "lora", None), EncoderLora):
                module.lora.adapters.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.place(slot, None)

    @property
    def backend(self) -> str:
        return ("Triton BGMV kernels (layers/lora/triton_lora.py)" if self.step.kernels else
                "torch products: grouped by adapter, or stacked for a few rows over several adapters")

    def loaded(self) -> list[dict]:
        return [{"name": a.name, "path": a.path, "rank": a.rank, "bytes": a.nbytes,
                 "slot": self.slot_names.index(a.name) if a.name in self.slot_names else None}
                for a in self.adapters.values()]

    # ---- slots -------------------------------------------------------------------------------------------
    def place(self, slot: int, name: str | None) -> None:
        """Slot `slot` of every layer's stacks now holds adapter `name` (None: nothing)."""
        adapter = self.adapters[name] if name is not None else None
        for target, module in self._adapted():
            assert isinstance(module.lora, LoraSlots)
            module.lora.place(slot, adapter.modules.get(target, []) if adapter is not None else [])
        self.slot_names[slot] = name

    def _adapted(self) -> Iterator[tuple[str, Linear]]:
        for target, module in self.model.named_modules():
            if isinstance(module, Linear) and isinstance(module.lora, LoraSlots):
                yield target, module

    def _encoder_lora(self, target: str) -> EncoderLora:
        return attach_encoder_lora(self.model.get_submodule(target), self.encoder_adapter)

    def targets_encoder(self, name: str | None) -> bool:
        adapter = self.adapters.get(name) if name is not None else None
        return adapter is not None and any(not on_token_rows(self.model, t) for t in adapter.modules)

    @contextmanager
    def encoding(self, name: str | None) -> Iterator[None]:
        """Within: the encoders' linears add adapter `name`'s products (None: none)."""
        self.encoder_adapter.name = name
        try:
            yield
        finally:
            self.encoder_adapter.name = None

    def fix_stacks(self, rank: int) -> None:
        """Gives every language model linear its stacks at `rank` (at least the loaded adapters' ranks), placed
        where they stay: decode CUDA graphs are captured over these addresses. Adapters of a higher rank are
        refused from then on."""
        rank = max([rank, *(a.rank for a in self.adapters.values())])
        for target, module in self.model.named_modules():
            if isinstance(module, Linear) and on_token_rows(self.model, target):
                self._stacks(target).ensure_rank(rank)
        self.fixed_rank = rank

    def _stacks(self, target: str) -> LoraSlots:
        module = self.model.get_submodule(target)
        assert isinstance(module, Linear)
        if module.lora is None:
            sizes = list(module.output_sizes.values()) if isinstance(module, MergedLinear) else [module.out_features]
            module.lora = LoraSlots(self.step, self.num_slots, module.in_features, sizes, self.dtype, self.device)
        return module.lora

    # ---- the step ----------------------------------------------------------------------------------------
    @contextmanager
    def rows(self, req_slots: list[int] | None, extend_lens: list[int]) -> Iterator[bool]:
        """Within: each layer adds its rows' adapters (req_slots: per request, its slot or -1). Yields whether
        any row has an adapter (the CUDA graphs, which know no LoRA, run only when none has)."""
        if req_slots:
            self.step.set_rows(req_slots, extend_lens, self.device)
        try:
            yield self.step.groups is not None
        finally:
            self.step.clear()
