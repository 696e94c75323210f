"""`--dtype auto` follows the checkpoint, and the Engine reports what it resolved to."""

from __future__ import annotations

import pytest
import torch

import tessera
from tests.engine.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), num_kv_heads=2)
    Qwen2VLForConditionalGeneration.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    return path


def test_dtype_auto_runs_a_bfloat16_checkpoint_in_bfloat16(bf16_checkpoint, scene_images) -> None:
    with tessera.Engine(model_path=str(bf16_checkpoint), max_total_tokens=2048, show_progress=False) as engine:
        info = engine.get_server_info()
        assert info["server_args"]["dtype"] == "auto"
        assert info["dtype"] == info["effective"]["dtype"] == "bfloat16"
        assert info["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
        assert info["server_args"]["attention_backend"] == "auto"
        assert info["attention_backend"] == ("triton" if torch.cuda.is_available() else "torch_native")
        # Decode CUDA graphs: buckets up to max_running_requests on CUDA, none elsewhere.
        assert list(info["effective"]["cuda_graph_batch_sizes"]) == ([1, 2, 4, 8] + list(range(16, 65, 8))
                                                               if torch.cuda.is_available() else [])
        assert info["max_total_tokens"] == 2048 and info["stats"]["kv_total_tokens"] == 2048
        # The KV pool is bfloat16 too: 2 (K, V) x layers x KV heads x head dim x 2 bytes per token.
        assert info["effective"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
        prompt = engine.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "Hi"}]}])
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                              image_data=scene_images[0])
        assert out["meta_info"]["completion_tokens"] == 4


def test_explicit_float32_overrides_the_checkpoint(bf16_checkpoint) -> None:
    with tessera.Engine(model_path=str(bf16_checkpoint), dtype="float32", max_total_tokens=1024,
                        show_progress=False) as engine:
        assert engine.get_server_info()["dtype"] == "float32"
