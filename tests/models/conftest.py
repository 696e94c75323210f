"""Session fixture: tiny random Qwen2-VL checkpoints (HF reference + ours loaded from the saved safetensors)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from qwen2_vl_testing import tiny_vl_config

from tessera.models.registry import load_model


@dataclass
class VLCase:
    name: str
    hf: torch.nn.Module
    ours: torch.nn.Module
    path: str


@pytest.fixture(scope="session", params=["gqa", "mha_tied"])
def vl_case(request, tmp_path_factory) -> VLCase:
    from transformers import Qwen2VLForConditionalGeneration

    cfg = tiny_vl_config(num_kv_heads=2, tie=False) if request.param == "gqa" else tiny_vl_config(4, tie=True)
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(f"qwen2vl_{request.param}")
    hf.save_pretrained(path)
    ours, _ = load_model(path, torch.float32)
    return VLCase(request.param, hf, ours, str(path))
