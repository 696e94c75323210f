"""Graph safety without a GPU: every family's padded decode forward (what worker/cuda_graph.py captures) runs
under graph_safe(), which fails on what breaks a CUDA-graph capture; and the mode catches each class of it.

The forward runs with the Triton backend (the one whose decode plan is capturable), so on a CPU it runs in a
second process under TRITON_INTERPRET=1, in bfloat16 (the CPU's own C kernels take only float32: the torch
operators run, as on a GPU). On a CUDA machine the family test runs in this process on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tessera.bench.kernel_census import random_model
from tessera.cache.kv_pool import TokenToKVPool
from tessera.models.config import ModelConfig
from tessera.models.families import FAMILIES
from tessera.worker.cuda_graph import DecodeGraphRunner, DecodeInputs, capture_batch_sizes
from tessera.worker.graph_safety import GraphSafetyError, graph_safe

from tests.kernel_device import DEVICE, IN_INTERPRETER, RUNS_KERNELS, run_interpreted


def _text(**extra: Any) -> dict:
    return dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, **extra)


def _tiny_configs() -> dict[str, Callable[[], Any]]:
    """Family name -> a tiny HF config of it (the model tests' fixtures where they have one)."""
    from transformers import GlmAsrConfig, Qwen2AudioConfig, Qwen2Config, Qwen3ASRConfig, Qwen3Config, WhisperConfig

    from tests.models import mllama_testing as mllama
    from tests.speech_llm_testing import SPEECH_LLMS

    from tests.models import clip_testing as clip
    from tests.models import cosmos3_testing as cosmos3
    from tests.models import gemma3_testing as gemma3
    from tests.models import gemma4_testing as gemma4
    from tests.models import glm4v_testing as glm4v
    from tests.models import internvl_testing as internvl
    from tests.models import kimi_k25_testing as kimi_k25
    from tests.models import llama4_testing as llama4
    from tests.models import llava_testing as llava
    from tests.models import pixtral_testing as pixtral
    from tests.models import qwen2_5_vl_testing as qwen2_5_vl
    from tests.models import qwen2_vl_testing as qwen2_vl
    from tests.models import qwen3_vl_moe_testing as qwen3_vl_moe
    from tests.models import qwen3_vl_testing as qwen3_vl
    from tests.models import qwen3_5_testing as qwen3_5

    return {
        "Qwen2ForCausalLM": lambda: Qwen2Config(**_text(), architectures=["Qwen2ForCausalLM"]),
        "Qwen3ForCausalLM": lambda: Qwen3Config(**_text(head_dim=16), architectures=["Qwen3ForCausalLM"]),
        "Qwen2VLForConditionalGeneration": lambda: qwen2_vl.tiny_vl_config(),
        "Qwen2_5_VLForConditionalGeneration": lambda: qwen2_5_vl.tiny_qwen2_5_vl_config(qwen2_5_vl.SPECS["gqa"]),
        "Qwen3VLForConditionalGeneration": lambda: qwen3_vl.tiny_qwen3_vl_config(qwen3_vl.SPECS["gqa"]),
        "Cosmos3EdgeForConditionalGeneration": lambda: cosmos3.tiny_cosmos3_edge_config(cosmos3.EDGE_SPECS["gqa"]),
        "Cosmos3OmniForConditionalGeneration": lambda: qwen3_vl.tiny_qwen3_vl_config(qwen3_vl.SPECS["gqa"],
                                                                                     architecture=cosmos3.OMNI),
        "Qwen3VLMoeForConditionalGeneration": lambda: qwen3_vl.tiny_qwen3_vl_config(qwen3_vl_moe.SPECS["moe"]),
        "Qwen3NextForCausalLM": qwen3_5.tiny_qwen3_next_config,
        "Qwen3_5ForConditionalGeneration": lambda: qwen3_5.tiny_qwen3_5_config(qwen3_5.SPECS["dense"]),
        "Qwen3_5MoeForConditionalGeneration": lambda: qwen3_5.tiny_qwen3_5_config(qwen3_5.SPECS["moe"]),
        "Qwen3_5ForCausalLM": lambda: qwen3_5.tiny_qwen3_5_text_config(qwen3_5.SPECS["dense"]),
        "Qwen3_5MoeForCausalLM": lambda: qwen3_5.tiny_qwen3_5_text_config(qwen3_5.SPECS["moe"]),
        "Qwen2AudioForConditionalGeneration": lambda: Qwen2AudioConfig(
            text_config=_text(model_type="qwen2"), architectures=["Qwen2AudioForConditionalGeneration"],
            audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                              num_mel_bins=16)),
        "LlavaForConditionalGeneration": lambda: llava.tiny_llava_config(llava.SPECS["llama"]),
        "LlavaNextForConditionalGeneration": lambda: llava.tiny_llava_config(llava.SPECS["next_llama"]),
        "LlavaForConditionalGeneration (pixtral vision)": lambda: pixtral.tiny_pixtral_config(
            pixtral.SPECS["mistral_gqa"]),
        "Gemma3ForConditionalGeneration": lambda: gemma3.tiny_gemma3_config(gemma3.SPECS["gqa"]),
        "Glm4vForConditionalGeneration": lambda: glm4v.tiny_glm4v_config(glm4v.SPECS["gqa"]),
        "Glm4vMoeForConditionalGeneration": lambda: glm4v.tiny_glm4v_config(glm4v.MOE_SPECS["moe"]),
        "Gemma3ForCausalLM": lambda: gemma3.tiny_gemma3_config(gemma3.SPECS["mha_softcap"]).text_config,
        # With MoE layers, whose expert loop reads the routing back (why Gemma 4 opts out of CUDA graphs).
        "Gemma4ForConditionalGeneration": lambda: gemma4.tiny_gemma4_config(gemma4.SPECS["shared_kv"], **gemma4.MOE),
        "Gemma4ForCausalLM": lambda: gemma4.tiny_gemma4_config(gemma4.SPECS["plain"], **gemma4.MOE).text_config,
        "InternVLForConditionalGeneration": lambda: internvl.tiny_internvl_config(internvl.SPECS["qwen2_gqa"]),
        "Kimi_K25ForConditionalGeneration": lambda: kimi_k25.tiny_kimi_config(kimi_k25.SPECS["yarn_qlora"]),
        "Llama4ForConditionalGeneration": lambda: llama4.tiny_llama4_config(llama4.SPECS["gqa_chunked"]),
        "Llama4ForCausalLM": lambda: llama4.tiny_llama4_config(llama4.SPECS["gqa_chunked"]).text_config,
        "WhisperForConditionalGeneration": lambda: WhisperConfig(
            vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
            architectures=["WhisperForConditionalGeneration"]),
        "Qwen3ASRForConditionalGeneration": lambda: Qwen3ASRConfig(
            audio_config=SPEECH_LLMS["qwen3_asr"].audio, text_config={**SPEECH_LLMS["qwen3_asr"].text, "vocab_size": 96},
            audio_token_id=95, architectures=["Qwen3ASRForConditionalGeneration"]),
        "GlmAsrForConditionalGeneration": lambda: GlmAsrConfig(
            audio_config=SPEECH_LLMS["glmasr"].audio, text_config={**SPEECH_LLMS["glmasr"].text, "vocab_size": 96},
            audio_token_id=95, architectures=["GlmAsrForConditionalGeneration"]),
        "MllamaForConditionalGeneration": lambda: mllama.tiny_mllama_config(),
        "CLIPModel": clip.tiny_clip_config,
        "SiglipModel": clip.tiny_siglip_config,
    }


def test_every_family_has_a_tiny_config() -> None:
    """A new row in the family table needs a config here, or its decode is never checked."""
    configs = _tiny_configs()
    assert sorted(configs) == sorted(FAMILIES), "add a tiny config for every family to _tiny_configs"
    for name, make in configs.items():
        assert ModelConfig.from_hf(make()).family is FAMILIES[name]




def _padded_decode(model: torch.nn.Module, mrope: bool) -> torch.Tensor:
    """Three requests (10 slots of KV each, at lengths 5, 8, 10) decoding one token, padded to bucket 4:
    the forward a CUDA graph captures, run eagerly under graph_safe()."""
    layout = model.kv_layout
    pool = TokenToKVPool(64, layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype=torch.bfloat16,
                         device=DEVICE)
    req_to_token = torch.zeros(6, 32, dtype=torch.int64, device=DEVICE)  # row 5: the pad row, all slot 0
    req_to_token[:3, :10] = torch.arange(1, 31, device=DEVICE).view(3, 10)
    runner = DecodeGraphRunner(model, pool, req_to_token, capture_batch_sizes(4), pad_row=5, mrope=mrope)
    rows = torch.arange(3, device=DEVICE)
    lens = torch.tensor([4, 7, 9], device=DEVICE)
    inputs = DecodeInputs(input_ids=torch.tensor([5, 6, 7], device=DEVICE),
                          positions=lens.expand(3, -1).clone() if mrope else lens.clone(),
                          out_cache_loc=req_to_token[rows, lens], req_pool_indices=rows, seq_lens=lens + 1)
    with graph_safe():
        return runner.forward(inputs, bucket=4)


@pytest.mark.cuda
@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decode_forward_is_graph_safe(name: str) -> None:
    """Families the worker captures must pass; one that opts out (cuda_graph_decode = False) must fail, or its
    opt-out is stale. Steps of families with per-request state (Whisper's and Mllama's cross-attention) are never
    captured (the graph buffers hold no cross-attention slots), so there is no forward to check."""
    family = FAMILIES[name]
    if family.encoder_decoder or family.model_class().request_state is not None:
        pytest.skip("per-request cross-attention state: the worker runs its decode eagerly (no slots in a graph)")
    config = ModelConfig.from_hf(_tiny_configs()[name]())
    model = random_model(config, DEVICE)
    mrope = config.positions == "mrope"
    if not type(model).cuda_graph_decode:
        with pytest.raises(GraphSafetyError):
            _padded_decode(model, mrope)
        return
    logits = _padded_decode(model, mrope)
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.skipif(not IN_INTERPRETER, reason="the kernel is interpreted in this process")
def test_kernel_launches_are_exempt() -> None:
    """The launcher's own host work (here a pre-run hook reading its arguments back) is not the captured code."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))

    host_reads: list[list[float]] = []
    copy_kernel.add_pre_run_hook(lambda src, dst, **kwargs: host_reads.append(src.tolist()))
    src, dst = torch.arange(4.0), torch.zeros(4)
    with graph_safe():
        copy_kernel[(1,)](src, dst, BLOCK=4)
        with pytest.raises(GraphSafetyError, match="Tensor.tolist"):
            dst.tolist()
    assert host_reads == [[0.0, 1.0, 2.0, 3.0]] and dst.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.slow  # a second process running every family in the interpreter: ~20 s of CPU
@pytest.mark.cuda
@pytest.mark.skipif(RUNS_KERNELS, reason="the checks run in this process")
def test_every_family_under_the_triton_interpreter() -> None:
    tests = "test_decode_forward_is_graph_safe or test_kernel_launches_are_exempt"
    out = run_interpreted(__file__, "-n", "0", "-k", tests)
    checked = sum(1 for f in FAMILIES.values()
                  if not f.encoder_decoder and f.model_class().request_state is None) + 1  # + the launch test
    skipped = len(FAMILIES) + 1 - checked
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and f"{checked} passed, {skipped} skipped" in summary, \
        out.stdout[-4000:] + out.stderr[-2000:]


x = torch.arange(6.0)
mask = x > 2
CATCHES = {  # each class of what breaks a capture: (the call, the op the error names)
    "item": (lambda: x[0].item(), "Tensor.item"),
    "tolist": (lambda: x.tolist(), "Tensor.tolist"),
    "python if": (lambda: 1 if x[1] else 0, "Tensor.__bool__"),
    "int()": (lambda: int(x[1]), "Tensor.__int__"),
    "float()": (lambda: float(x[1]), "Tensor.__float__"),
    "cpu": (lambda: x.cpu(), "Tensor.cpu"),
    "to cpu": (lambda: x.to("cpu"), "Tensor.to"),
    "numpy": (lambda: x.numpy(), "Tensor.numpy"),
    "index by a tensor scalar": (lambda: x[torch.ones((), dtype=torch.long, device="cpu")], "aten.item"),
    "torch.tensor": (lambda: torch.tensor([1, 2]), "torch.tensor"),
    "as_tensor": (lambda: torch.as_tensor([1.0, 2.0]), "torch.as_tensor"),
    "from_numpy": (lambda: torch.from_numpy(np.zeros(2)), "aten.lift_fresh"),
    "arange without device": (lambda: torch.arange(4), "torch.arange"),
    "boolean mask": (lambda: x[mask], "aten.index.Tensor"),
    "boolean mask assignment": (lambda: x.clone().__setitem__(mask, 0.5 * x[:3]), "aten.index_put_"),
    "nonzero": (lambda: mask.nonzero(), "Tensor.nonzero"),
    "masked_select": (lambda: torch.masked_select(x, mask), "torch.masked_select"),
    "unique": (lambda: torch.unique(x), "torch.unique"),
    "repeat_interleave": (lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long, device="cpu")),
                          "aten.repeat_interleave"),
    "one-argument where": (lambda: torch.where(mask), "aten.where.default"),
}


@pytest.mark.parametrize("case", sorted(CATCHES))
def test_mode_catches(case: str) -> None:
    call, op = CATCHES[case]
    with torch.inference_mode(), pytest.raises(GraphSafetyError) as e:
        with graph_safe():
            call()
    assert op in str(e.value) and "test_graph_safety.py:" in str(e.value), str(e.value)  # the op and the frame
    call()  # outside the mode it runs


def test_mode_passes_what_a_graph_captures() -> None:
    ones = torch.ones(6, dtype=torch.long, device="cpu")
    with torch.inference_mode(), graph_safe():
        y = torch.where(mask, x, 0.0) + x.masked_fill(mask, 1.0) * 2.0
        y = y + x.repeat_interleave(ones, output_size=6) + x.repeat_interleave(1)
        y = y[torch.arange(3, device=x.device)].to(x.device)
        assert int(y.shape[0]) == 3  # a shape is a host value already
