"""A bfloat16 / float16 checkpoint of a decoder-only family (Qwen3: qk-norm, biases) loaded on a CPU
keeps its linear weights and embedding table (the LM head, tied or not) in 16 bits and computes in float32
(layers/half_linear.py).

The reference is transformers in float32 over the same 16-bit weights, upcast: that is exactly the arithmetic we
claim (float32 products of the upcast weights), so prefill logits must agree to float32 rounding (1e-4, as every
float32 parity test) and greedy tokens exactly; HF in bf16/fp16 would round its activations where we do not.
The 60-token prompt's prefill runs the widened-block sgemm path, its decode steps the C kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from paged_driver import check_text_prefill_and_decode

from tessera.layers import half_linear
from tessera.layers.linear import Linear
from tessera.models.registry import load_model
from tessera.platform import cpu_kernels


@pytest.mark.parametrize(("dtype", "tied"), [(torch.bfloat16, False), (torch.float16, True)])
def test_16bit_checkpoint_matches_hf_over_the_upcast_weights(dtype, tied, tmp_path, monkeypatch) -> None:
    """Float32 compute over 16-bit weights (TESSERA_BF16_COMPUTE=0 on a CPU with bf16 products) is HF in float32
    over the upcast weights."""
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                      rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=tied,
                      max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            p.copy_(p.to(dtype))  # every value representable in the checkpoint's dtype: the upcast is exact
    # A copy: .to(dtype) rounds the rotary inv_freq buffer as well, which a float32 HF must keep exact.
    copy.deepcopy(hf).to(dtype).save_pretrained(tmp_path)
    ours, config = load_model(tmp_path, "auto")
    assert config.dtype == str(dtype).removeprefix("torch.")
    projections = [m for m in ours.modules() if isinstance(m, Linear)]
    assert projections and {m.weight.dtype for m in projections} == {dtype}
    assert ours.lm_head.weight.dtype == ours.model.embed_tokens.weight.dtype == dtype
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.model.norm.weight.dtype == torch.float32
    calls = []
    real = cpu_kernels.call
    ours_calls = lambda name, *a: calls.append(name) or real(name, *a)  # noqa: E731
    ids = torch.randint(1, 96, (60,), generator=torch.Generator().manual_seed(1))
    try:
        cpu_kernels.call = ours_calls
        _, want = check_text_prefill_and_decode(hf, ours, ids, 10)
    finally:
        cpu_kernels.call = real
    assert len(set(want)) >= 3, f"greedy output {want} is (nearly) one repeated token"
    kernel = {torch.bfloat16: "gemv_bf16", torch.float16: "gemv_f16"}[dtype]
    assert kernel in calls or not cpu_kernels.available(kernel)
    # the decode steps ran as one C call each (layers/decode_stack.py), over the 16-bit weights as they are
    assert calls.count("decode_stack") >= 9 or not cpu_kernels.available("decode_stack")
