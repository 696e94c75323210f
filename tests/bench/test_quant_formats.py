"""`python -m tessera.bench.quant`: what each format name starts, and the environment it sets and restores."""

from __future__ import annotations

import os

from tessera.bench.quant import engine_settings
from tessera.platform.launch import environment


def test_quant_formats_map_to_engine_settings_and_restore_the_environment(monkeypatch) -> None:
    assert engine_settings("fp32") == ({"dtype": "float32"}, {})
    assert engine_settings("bfloat16") == ({"dtype": "bfloat16"}, {})
    assert engine_settings("bfloat16-f32") == ({"dtype": "bfloat16"}, {"TESSERA_BF16_COMPUTE": "0"})
    assert engine_settings("int4wo-32") == ({"torchao_config": "int4wo-32"}, {})
    monkeypatch.setenv("TESSERA_A", "kept")
    monkeypatch.delenv("TESSERA_B", raising=False)
    with environment({"TESSERA_A": "1", "TESSERA_B": "2"}):
        assert (os.environ["TESSERA_A"], os.environ["TESSERA_B"]) == ("1", "2")
    assert os.environ["TESSERA_A"] == "kept" and "TESSERA_B" not in os.environ
