"""--torchao-config through the Engine: get_server_info says what runs, and a quantized model serves."""

from __future__ import annotations

import tessera
from tessera.bench.medium import count_parameters
from tessera.layers.quantization import int_linear
from tessera.platform import cpu_kernels


def test_engine_reports_and_runs_int4_weights(tiny_gqa) -> None:
    with tessera.Engine(model_path=str(tiny_gqa), torchao_config="int4wo-32", max_total_tokens=2048,
                        show_progress=False) as engine:
        info = engine.get_server_info()
        assert info["server_args"]["torchao_config"] == "int4wo-32"
        path = ("torch int4pack" if int_linear.prefers_torch_ops() else
                "C int4 gemv + dequantized prefill" if cpu_kernels.available("int4_gemv") else "int4")
        assert info["effective"]["quantization"].startswith(f"int4wo-32 (torchao-config), {path}")
        assert info["effective"]["quantization"].endswith("encoders, embeddings and LM head float")
        # The packed weights are counted as the parameters they stand for.
        assert info["effective"]["num_parameters"] == count_parameters(tiny_gqa)
        out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
