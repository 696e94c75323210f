"""--torchao-config on tiny Qwen2-VL and Qwen2 checkpoints: our quantized model against transformers running
the same weights dequantized (each HF language-model linear replaced by AffineWeight.dequantize() of the
same round-to-nearest quantization). Greedy tokens must be identical and prefill logits close."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_driver import PagedKV, check_text_prefill_and_decode, make_batch
from qwen2_vl_testing import build_prompt, tiny_vl_config
from test_qwen2_vl import _greedy_prompt, _greedy_tokens, _hf_greedy_tokens, hf_logits, prefill_step

from tessera.layers import half_linear
from tessera.layers.linear import Linear
from tessera.layers.quantization import int_linear
from tessera.layers.quantization.int_linear import fake_quantize_
from tessera.models.registry import load_model

SCHEMES = ["int8wo", "int4wo-32"]


@pytest.fixture(autouse=True)
def float32_products(monkeypatch):
    """HF multiplies the dequantized weights in float32: so do we here, on any CPU (a prefill's products are
    bf16 where the CPU has bf16 dot products; tests/layers/test_int_linear.py covers those)."""
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)


def quantized_pair(path, hf, scheme: str, prefix: str):
    ours, _ = load_model(path, torch.float32, torchao_config=scheme)
    assert fake_quantize_(hf, scheme, prefix) == 7 * 2  # q, k, v, o, gate, up, down x 2 layers
    quantized = [m for m in ours.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert len(quantized) == 4 * 2 and ours.quantization.startswith(f"{scheme} (torchao-config)")
    return ours


@pytest.fixture(scope="module", params=SCHEMES)
def vl_pair(request, tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration._from_config(tiny_vl_config(), attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(f"qwen2vl_{request.param}")
    hf.save_pretrained(path)
    float_logits = hf_logits(hf, _greedy_prompt())
    ours = quantized_pair(path, hf, request.param, "model.language_model.")
    # The quantization changes the model (else the test below would not tell a float path from ours).
    assert (hf_logits(hf, _greedy_prompt()) - float_logits).abs().max() > 1e-3
    return SimpleNamespace(hf=hf, ours=ours)


def test_qwen2_vl_quantized_matches_hf_dequantized(vl_pair):
    prompt = build_prompt([5, ("image", (1, 4, 6)), 4], seed=1)
    kv = PagedKV(vl_pair.ours.lm_config)
    with torch.inference_mode():
        logits = vl_pair.ours(make_batch(kv, [prefill_step(vl_pair, kv.new_request(), prompt, all_logits=True)]),
                              kv.pool)
    torch.testing.assert_close(logits, hf_logits(vl_pair.hf, prompt), atol=1e-4, rtol=0)
    assert _greedy_tokens(vl_pair, 4) == _hf_greedy_tokens(vl_pair)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qwen2_quantized_matches_hf_dequantized(scheme, tmp_path):
    """A 60-token prompt: its prefill runs past the kernel's row limit (the dequantized-weight product),
    decode through the kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    ours = quantized_pair(tmp_path, hf, scheme, "model.layers.")
    ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(1))
    check_text_prefill_and_decode(hf, ours, ids, 12)


def test_qwen2_vl_int4_with_bf16_products_is_hf_over_bf16_activations(tmp_path, monkeypatch):
    """With bf16 products on (the default where the CPU has bf16 dot products), torchao's int4 weights take x
    rounded to bf16, as torchao's int4 kernels take bf16 activations: HF's dequantized linears over inputs rounded
    to bf16 are then the reference (the prompt is shorter than the kernel's row limit, so the prefill is the
    few-row kernel too, not the bf16 matmul over a rounded weight)."""
    from transformers import Qwen2VLForConditionalGeneration

    from tessera.platform import cpu_kernels

    if not cpu_kernels.available("int4_gemv_bf16x"):
        pytest.skip("no C kernels")
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", True)
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration._from_config(tiny_vl_config(), attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    prefix = "model.language_model."
    pair = SimpleNamespace(hf=hf, ours=quantized_pair(tmp_path, hf, "int4wo-32", prefix))
    assert {lin.quantized.kernel for lin in pair.ours.modules()
            if isinstance(lin, Linear) and lin.quantized is not None} == {"int4_gemv_bf16x"}
    prompt = build_prompt([3, ("image", (1, 2, 4)), 2], seed=1)
    assert prompt.input_ids.shape[0] <= int_linear.max_rows()  # 16 on one thread
    exact = hf_logits(hf, prompt)
    for name, module in hf.named_modules():
        if name.startswith(prefix) and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _m, args: (args[0].bfloat16().float(), *args[1:]))
    want = hf_logits(hf, prompt)
    assert (want - exact).abs().max() > 1e-3  # the rounding shows in the logits: the test tells the kernels apart
    kv = PagedKV(pair.ours.lm_config)
    with torch.inference_mode():
        logits = pair.ours(make_batch(kv, [prefill_step(pair, kv.new_request(), prompt, all_logits=True)]), kv.pool)
    # Not element by element: where an activation lies within float32 noise of a bf16 rounding boundary, the two
    # models (which sum in different orders before rounding) round it to neighbouring bf16 values, and that one
    # step spreads to the later positions through attention (an AVX2 EPYC: rows 0-3 within 7e-7, rows 4-8 up to
    # 4e-3, against 1e-2 from the float32 reference). On the mean, ours is HF over rounded activations.
    near, far = (logits - want).abs().mean(), (logits - exact).abs().mean()
    assert near < 0.25 * far, (near, far)
    assert _greedy_tokens(pair, 4) == _hf_greedy_tokens(pair)


def test_qwen3_vl_moe_int8_dense_linears_match_hf_dequantized(tmp_path):
    """Qwen3-VL-MoE: the attention and dense-MLP linears quantized, the router and the stacked experts float (HF's
    router is not an nn.Linear, so the same linears change on both sides); an image prompt's prefill and greedy
    tokens equal HF's over the dequantized weights."""
    from tests.models.family_parity import our_greedy, our_logits
    from tests.models.qwen3_vl_moe_testing import SPECS
    from tests.models.qwen3_vl_testing import DECODE_PROMPT, PROMPTS, Qwen3VLCase, build_tiny_qwen3_vl

    spec = SPECS["moe"]
    hf = build_tiny_qwen3_vl(tmp_path, spec)
    ours, _ = load_model(tmp_path, torch.float32, torchao_config="int8wo")
    # q, k, v, o x 3 layers, gate, up, down of the one dense layer; every other linear is our router (kept float)
    assert fake_quantize_(hf, "int8wo", "model.language_model.") == 4 * 3 + 3
    assert sum(isinstance(m, Linear) and m.quantized is not None for m in ours.modules()) == 2 * 3 + 2
    assert all(layer.mlp.gate.quantized is None for layer in ours.model.layers if hasattr(layer.mlp, "gate"))
    case = Qwen3VLCase(spec, hf, ours, tmp_path)
    prompt = case.prompt(PROMPTS["two_images"], seed=1)
    torch.testing.assert_close(our_logits(case, prompt), case.hf_logits(prompt), atol=1e-4, rtol=0)
    decode = case.prompt(DECODE_PROMPT, seed=0)
    assert our_greedy(case, [decode], 6)[0] == [case.hf_greedy(decode, 6)[0]]
