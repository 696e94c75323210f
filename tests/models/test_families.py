"""The family table is the one source: registries, capabilities and startup errors all derive from it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tessera.models.base import TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.families import FAMILIES, UnsupportedArchitectureError, get_family
from tessera.models.registry import get_model_class, load_model
from tessera.layers.linear import Linear
from tessera.platform.device import resolve_dtype
from tessera.messages.items import Modality
from tests.multimodal import processor_registry as processors


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_row_resolves(name: str) -> None:
    family = FAMILIES[name]
    arch = family.architecture
    assert issubclass(family.model_class(), TesseraModel)
    assert family.positions in ("rope", "mrope", "learned")
    # An encoder-decoder row's model declares its cross-attention state (so does Mllama's, whose images salt the
    # prefix-cache key instead), and its prefix cache is off (as an embedding-only dual encoder's, whose towers
    # do not use the paged KV).
    has_state = family.model_class().request_state is not None
    assert has_state == (family.encoder_decoder or arch == "MllamaForConditionalGeneration")
    assert family.prefix_cache == (not family.encoder_decoder and not family.embedding_only)
    # A hybrid linear-attention row's model declares its per-request state (the state pool's layout).
    assert family.linear_attention == (getattr(family.model_class(), "state_layout", None) is not
                                       TesseraModel.state_layout)
    if family.modalities:
        assert family.processor_class() is not None
        assert processors.get_processor_class(arch) is not None
    else:
        assert family.processor is None
        with pytest.raises(ValueError, match="no multimodal processor"):
            processors.get_processor_class(arch)
    assert family.served_modalities(language_model_only=True) == frozenset()


def test_processor_registry_lists_exactly_the_multimodal_families() -> None:
    assert processors.supported_architectures() == sorted({f.architecture for f in FAMILIES.values() if f.modalities})


def test_unsupported_architecture_names_it_and_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as e:
        get_model_class("LlamaForCausalLM")
    assert "LlamaForCausalLM" in str(e.value)
    for family in FAMILIES.values():
        assert family.architecture in str(e.value)


def _tiny_qwen2(path, dtype: torch.dtype, arch: str | None = None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(path)
    if arch is not None:  # rewrite the architecture as an unsupported checkpoint would carry it
        import json

        data = json.loads((path / "config.json").read_text())
        data["architectures"] = [arch]
        (path / "config.json").write_text(json.dumps(data))
    return path


def test_model_config_reads_layout_and_dtype(tmp_path) -> None:
    config = ModelConfig.load(_tiny_qwen2(tmp_path, torch.bfloat16))
    assert config.family is get_family("Qwen2ForCausalLM")
    assert (config.kv_layout.num_layers, config.kv_layout.num_kv_heads, config.kv_layout.head_dim) == (1, 2, 8)
    assert config.dtype == "bfloat16" and config.positions == "rope"
    assert config.sliding_windows == (None,)


def test_dtype_auto_follows_the_checkpoint(tmp_path) -> None:
    path = _tiny_qwen2(tmp_path, torch.bfloat16)
    model, config = load_model(path, "auto")
    # On a CPU the linear layers and the table keep the checkpoint's bfloat16; norms and activations are float32.
    linears = {p.dtype for m in model.modules() if isinstance(m, Linear) for p in m.parameters(recurse=False)
               if p.dim() == 2}
    assert linears == {model.model.embed_tokens.weight.dtype} == {torch.bfloat16}
    assert model.model.norm.weight.dtype == model.model.embed_tokens.like.dtype == torch.float32
    assert resolve_dtype("auto", config.dtype, "cpu") == torch.bfloat16
    f16 = ModelConfig.load(path).__class__(**{**ModelConfig.load(path).__dict__, "dtype": "float16"})
    assert resolve_dtype("auto", f16.dtype, "cpu") == torch.float16  # kept: widened in registers on a CPU
    assert resolve_dtype("auto", f16.dtype, "cuda") == torch.float16
    assert resolve_dtype("float32", config.dtype, "cpu") == torch.float32


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True, timeout=240)


def test_unsupported_architecture_fails_serve_at_startup(tmp_path) -> None:
    path = _tiny_qwen2(tmp_path, torch.float32, arch="FancyNewForCausalLM")
    out = _cli("serve", "--model-path", str(path), "--port", "30999")
    assert out.returncode == 2, out.stderr
    assert "FancyNewForCausalLM" in out.stderr and "Qwen2VLForConditionalGeneration" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line() -> None:
    out = _cli("generate", "--device", "cuda", "--max-new-tokens", "2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "device" in lines[0] and "CUDA" in lines[0], out.stderr


def test_language_model_only_serves_no_media() -> None:
    from tessera.config import ServerArgs
    from tessera.frontend.model_info import ModelInfo

    info = ModelInfo.load(ServerArgs(model_path="demo-vl", language_model_only=True))
    assert info.modalities == frozenset() and not info.has_image_understanding
    info = ModelInfo.load(ServerArgs(model_path="demo-vl"))
    assert info.modalities == {Modality.IMAGE, Modality.VIDEO}


def test_readme_support_table_is_the_family_table() -> None:
    from pathlib import Path

    from tessera.models.families import BACKEND_TESTED, support_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert support_table() in readme, "README's support table differs: paste families.support_table() into it"
    assert support_table().count("\n| `") == len(FAMILIES) + len(BACKEND_TESTED)


def test_a_backend_without_what_the_family_needs_is_refused(tmp_path, monkeypatch) -> None:
    from tessera.layers.attention.torch_native import TorchNativeAttentionBackend

    path = _tiny_qwen2(tmp_path, torch.float32)
    config = ModelConfig.load(path)
    family = config.family.__class__(**{**config.family.__dict__, "backend_needs": frozenset({"custom_mask"})})
    config = config.__class__(**{**config.__dict__, "family": family})
    monkeypatch.setattr(TorchNativeAttentionBackend, "features", frozenset(), raising=False)
    with pytest.raises(ValueError, match=r"lacks \['custom_mask'\]"):
        load_model(path, "float32", config=config)
    monkeypatch.undo()
    load_model(path, "float32", config=config)  # torch_native has it


@pytest.mark.parametrize(("architecture", "model_type", "family"), [
    ("Qwen2Model", "qwen2", "Qwen2ForCausalLM"), ("Qwen3ForEmbedding", "qwen3", "Qwen3ForCausalLM"),
    ("Gemma3TextModel", "gemma3_text", "Gemma3ForCausalLM"), ("Gemma3Model", "gemma3", None),
    ("Qwen2VLModel", "qwen2_vl", None), ("Qwen2ForCausalLM", "qwen2", None), ("LlamaModel", "llama", None)])
def test_a_text_family_base_model_is_served_headless(architecture, model_type, family) -> None:
    """A text family's base model (no LM head) maps to its row, headless; multimodal base models, other model
    types and architectures with rows of their own do not."""
    from tessera.models.families import headless_family

    row = headless_family(architecture, model_type)
    if family is None:
        assert row is None
        return
    assert row is not None and row.headless and row.architecture == architecture
    assert row.model == FAMILIES[family].model and row.prefix_cache and not row.embedding_only
