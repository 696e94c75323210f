"""An adapter's `adapter_config.json` (PEFT's LoraConfig as saved by `save_pretrained`), read and checked once.

What changes the product and is not implemented is refused here with one line naming the field, never ignored:
DoRA, trained biases, `modules_to_save`, trainable tokens, and PEFT's other inference-time variants.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# Fields that change what the adapter computes at inference, with why each is refused when set.
_REFUSED: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "lora_bias": "LoRA biases are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    "target_parameters": "LoRA on parameters (MoE experts) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "alora_invocation_tokens": "activated LoRA is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "velora_config": "VeLoRA is not supported",
}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message is one line naming the adapter and what is wrong."""


@dataclass(frozen=True)
class LoraAdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """The rank and alpha PEFT gives `module` (a dotted module path): the first matching pattern key, as
        PEFT matches them (the key is the path's tail at a dot boundary, or a regex over it)."""
        return (int(_pattern_value(self.rank_pattern, module, self.r)),
                float(_pattern_value(self.alpha_pattern, module, self.lora_alpha)))

    def scaling(self, module: str, rank: int) -> float:
        """The factor on B @ A: alpha / r (rsLoRA: alpha / sqrt(r)), with this module's alpha."""
        _, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: str | Path, name: str = "") -> LoraAdapterConfig:
    """The adapter directory's config; AdapterError (naming `name` or the path) when it is missing, not a LoRA
    adapter, or uses something refused above."""
    label = name or str(path)
    root = Path(path)
    file = root / ADAPTER_CONFIG
    if not root.is_dir():
        raise AdapterError(f"adapter {label!r}: {root} is not a directory")
    if not file.is_file():
        raise AdapterError(f"adapter {label!r}: no {ADAPTER_CONFIG} in {root}")
    if not (root / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"adapter {label!r}: no {ADAPTER_WEIGHTS} in {root} (only safetensors adapters load)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {label!r}: {ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {label!r}: {ADAPTER_CONFIG} is not a JSON object")
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {label!r}: peft_type {kind!r}: only LORA adapters are supported")
    for key, why in _REFUSED.items():
        if raw.get(key):
            raise AdapterError(f"adapter {label!r}: {key}: {why}")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"adapter {label!r}: bias={raw['bias']!r}: trained biases are not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"adapter {label!r}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {label!r}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules") or ()
    return LoraAdapterConfig(r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")),
                             target_modules=targets if isinstance(targets, str) else tuple(targets),
                             rank_pattern=dict(raw.get("rank_pattern") or {}),
                             alpha_pattern=dict(raw.get("alpha_pattern") or {}))
