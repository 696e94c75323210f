"""LoRA adapters over the base model's linear layers (PEFT's format), many at once in one batch.

config.py reads and checks an adapter's `adapter_config.json`; adapter.py maps its tensors onto our modules
(merged QKV / gate-up shards, tensor-parallel slices); slots.py holds the per-module A/B stacks, one slot per
adapter the step may use, and the batched product each Linear adds to its output.
"""

from tessera.layers.lora.adapter import LoraAdapter, load_adapter
from tessera.layers.lora.config import AdapterError, LoraAdapterConfig, read_adapter_config
from tessera.layers.lora.slots import LoraSlots, LoraStep

__all__ = ["AdapterError", "LoraAdapter", "LoraAdapterConfig", "LoraSlots", "LoraStep", "load_adapter", "read_adapter_config"]
