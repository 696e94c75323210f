"""Whether the layers run their fused Triton kernels (layers/triton_ops.py) for a tensor, without importing
triton where none runs (a CPU-only torch install has no triton).

They run on devices whose platform runs Triton (CUDA), and on every tensor under Triton's interpreter
(TRITON_INTERPRET=1): there the tests compare the kernels with torch's operators and the kernel census counts
the GPU's launches on a CPU.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from tessera.platform.device import platform_of

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# TESSERA_TRITON_OPS=0: torch's operators instead (the escape hatch while the kernels are new on GPUs, and the
# census's "before"). Read when the layers are imported: a scheduler process reads it at start.
_SWITCH = os.environ.get("TESSERA_TRITON_OPS", "1")
if _SWITCH not in ("0", "1"):
    raise ValueError(f"TESSERA_TRITON_OPS: expected 0 or 1, got {_SWITCH!r}")
_ENABLED = _SWITCH == "1"


def active(x: torch.Tensor) -> bool:
    return _ENABLED and (_INTERPRETED or platform_of(x.device).runs_triton)


def ops() -> ModuleType:
    """layers/triton_ops.py, imported on first use."""
    from tessera.layers import triton_ops

    return triton_ops
