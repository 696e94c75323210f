"""Encoders taken from transformers (vision and audio towers), built empty for our weight loader to fill."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch


def build_transformers_tower(target: str, sub_config: Any) -> torch.nn.Module:
    """transformers' encoder `module:Class` on the current default device/dtype, parameters uninitialised
    (the checkpoint fills them), SDPA attention."""
    from transformers.initialization import no_init_weights

    module_name, class_name = target.split(":")
    tower_cls = getattr(importlib.import_module(module_name), class_name)
    # _from_config writes dtype/attn settings into the config it gets; keep the caller's config untouched.
    cfg = copy.deepcopy(sub_config)
    with no_init_weights():
        tower = tower_cls._from_config(cfg, dtype=torch.get_default_dtype(), attn_implementation="sdpa")
    return tower.eval()
