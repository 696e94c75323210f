"""GLM-4.1V checkpoints that do not fit are refused by name before any weight loads (the family's parity with HF
is in test_family_parity.py, its fixture in glm4v_testing.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.models.config import ModelConfig
from tessera.models.registry import load_model
from tests.models.glm4v_testing import SPECS, tiny_glm4v_config


def _write_config(path, drop: str | None = None, **changes) -> None:
    config = tiny_glm4v_config(SPECS["gqa"]).to_dict()
    config.pop(drop, None)
    for key, value in changes.items():
        section, field = key.split("__")
        config[section][field] = value
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_vision_config_is_refused_by_name(tmp_path):
    """transformers would fill in GLM-4.1V-9B's vision tower; no weights exist here, so the error comes first."""
    _write_config(tmp_path, drop="vision_config")
    with pytest.raises(ValueError, match="lacks vision_config"):
        ModelConfig.load(tmp_path)
    with pytest.raises(ValueError, match="lacks vision_config"):
        load_model(tmp_path, torch.float32)


def test_tower_width_must_match_the_language_model(tmp_path):
    _write_config(tmp_path, vision_config__out_hidden_size=64)
    with pytest.raises(ValueError, match=r"vision_config.out_hidden_size=64 differs .* hidden_size=96"):
        load_model(tmp_path, torch.float32)
