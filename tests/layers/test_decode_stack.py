"""The decode stack in one C call (layers/decode_stack.py, platform/csrc/cpu_decode_stack.c) against the
layer-by-layer path it replaces: the same hidden states and the same K/V written to the pool, for every weight
kind it takes, with biases, QK-norm, M-RoPE, sliding windows and requests of different lengths over scattered
slots; and it must step aside (nothing written) wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from tessera.layers import decode_stack
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import Linear, MergedLinear
from tessera.layers.lora.slots import LoraSlots, LoraStep
from tessera.layers.quantization.affine import quantize
from tessera.layers.rotary import RotaryEmbedding
from tessera.models.qwen2 import Qwen2ForCausalLM
from tessera.models.qwen3 import Qwen3ForCausalLM
from tessera.models.config import ModelConfig
from tessera.platform import cpu_kernels

pytestmark = pytest.mark.skipif(not all(cpu_kernels.available(k) for k in decode_stack._STEP_KERNELS),
                                reason="no C compiler: the kernels are never built")

# Large enough that the layer-by-layer path runs every product in our gemv too (GEMV_MIN_WEIGHT): the two paths
# then compute the same operations in the same order, and agree bit for bit.
BIG = dict(hidden_size=256, intermediate_size=384, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _model(family: str, sizes: dict, window: int | None = None, bias: bool = False, seed: int = 0):
    common = dict(vocab_size=128, num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **sizes)
    if family == "qwen3":
        hf_cfg = Qwen3Config(attention_bias=bias, **common)
        cls = Qwen3ForCausalLM
    else:
        extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
        hf_cfg = Qwen2Config(**common, **extra)
        cls = Qwen2ForCausalLM
    cfg = ModelConfig.from_hf(hf_cfg)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * 0.1)
    return model, cfg


def _batch(cfg, lens: list[int], seed: int = 0, mrope: bool = False):
    """A decode step for requests that hold `lens` tokens of K/V, their slots scattered over a pool filled with
    random K/V; returns (fb, pool) and a copy of the pool for the other path."""
    gen = torch.Generator().manual_seed(seed)
    b, ctx = len(lens), max(lens) + 1
    pool = TokenToKVPool(4 * b * ctx + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        pool.k_buffers[layer].normal_(generator=gen)
        pool.v_buffers[layer].normal_(generator=gen)
    req = ReqToTokenPool(b, ctx)
    req.req_to_token[:] = (1 + torch.randperm(4 * b * ctx, generator=gen))[: b * ctx].view(b, ctx)
    n = torch.tensor(lens)
    pos = n.clone()
    # M-RoPE: three position rows that differ (an image's height and width rows run behind its time row)
    fb = ForwardBatch(input_ids=torch.randint(0, cfg.vocab_size, (b,), generator=gen),
                      positions=torch.stack([pos, pos - 3, pos - 7]) if mrope else pos,
                      out_cache_loc=req.req_to_token[torch.arange(b), n].clone(), req_pool_indices=torch.arange(b),
                      seq_lens=n + 1, extend_lens=torch.ones(b, dtype=torch.int64), req_to_token=req.req_to_token,
                      logits_indices=torch.arange(b), req_generations=[1] * b)
    return fb, pool


def _fresh(fb: ForwardBatch) -> ForwardBatch:
    """The same step as a new object (backends keep per-batch state by identity)."""
    return ForwardBatch(fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
                        fb.extend_lens, fb.req_to_token, fb.logits_indices, req_generations=fb.req_generations,
                        lora_rows=fb.lora_rows)


def _both(model, fb, pool, monkeypatch):
    """(hidden, pool) through the C stack and through the layers, each from the same starting pool."""
    calls = []
    real = cpu_kernels.call
    monkeypatch.setattr(cpu_kernels, "call", lambda name, *a: calls.append(name) or real(name, *a))
    other = TokenToKVPool(pool.size, pool.num_layers, pool.num_kv_heads, pool.head_dim)
    for layer in range(pool.num_layers):
        other.k_buffers[layer].copy_(pool.k_buffers[layer])
        other.v_buffers[layer].copy_(pool.v_buffers[layer])
    with torch.inference_mode():
        x = model.embed(fb)
        stacked = model.model(x, fb.positions, fb, pool)
        assert calls.count("decode_stack") == 1, "the C stack did not run"
        monkeypatch.setenv("TESSERA_DECODE_STACK", "0")
        layered = model.model(x, fb.positions, _fresh(fb), other)
        assert calls.count("decode_stack") == 1
    return stacked, layered, pool, other


def _check(model, fb, pool, monkeypatch, exact: bool):
    stacked, layered, p1, p2 = _both(model, fb, pool, monkeypatch)
    tol = dict(atol=0, rtol=0) if exact else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(stacked, layered, **tol)
    for layer in range(p1.num_layers):
        torch.testing.assert_close(p1.k_buffers[layer], p2.k_buffers[layer], **tol)
        torch.testing.assert_close(p1.v_buffers[layer], p2.v_buffers[layer], **tol)
    assert stacked.abs().max() > 0.1  # not a trivially small output


@pytest.mark.parametrize("lens", [[37], [5, 60, 17, 33]], ids=["one", "four"])
def test_float32_equals_the_layers_bit_for_bit(lens, monkeypatch):
    model, cfg = _model("qwen2", BIG, bias=True)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    fb, pool = _batch(cfg, lens)
    _check(model, fb, pool, monkeypatch, exact=True)


def test_sliding_window_and_mrope_positions(monkeypatch):
    model, cfg = _model("qwen2", BIG, window=8)
    assert [w for w in cfg.sliding_windows] == [None, 8, 8]
    model.model.rotary_emb = RotaryEmbedding(cfg.head_dim, 1000.0, [4, 6, 6])  # Qwen2-VL's M-RoPE over 3 rows
    fb, pool = _batch(cfg, [3, 40, 21], mrope=True)
    _check(model, fb, pool, monkeypatch, exact=True)


@pytest.mark.parametrize("sizes", [BIG, SMALL], ids=["big", "small"])
def test_qk_norm_and_small_weights(sizes, monkeypatch):
    """QK-norm runs our RMSNorm kernel where the layers use torch's (another summation order), and small
    weights our gemv where the layers use torch's matmul: equal within float32 rounding."""
    model, cfg = _model("qwen3", sizes, bias=True)
    assert model.model.layers[0].self_attn.q_norm is not None
    fb, pool = _batch(cfg, [9, 30])
    _check(model, fb, pool, monkeypatch, exact=False)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "int8", "int4"])
def test_16_bit_and_int_weights(kind, monkeypatch):
    model, cfg = _model("qwen2", BIG)
    with torch.no_grad():
        for module in model.model.modules():
            if hasattr(module, "set_quantized") and module.weight is not None:
                if kind in ("int8", "int4"):
                    bits, group = (8, None) if kind == "int8" else (4, 32)
                    module.set_quantized(quantize(module.weight, bits, group, bits == 8), "c")
                else:
                    module.weight = torch.nn.Parameter(module.weight.to(getattr(torch, kind)), requires_grad=False)
    fb, pool = _batch(cfg, [12, 50])
    _check(model, fb, pool, monkeypatch, exact=True)


def test_steps_aside_where_it_does_not_apply(monkeypatch):
    """A prefill, grad mode, too many rows, or a non-float32 pool: the layers run and the stack writes nothing."""
    model, cfg = _model("qwen2", SMALL)
    fb, pool = _batch(cfg, [4, 7])
    with torch.inference_mode():
        x = model.embed(fb)
        cos, sin = model.model.rotary_emb.get_cos_sin(fb.positions, x.dtype)
        model.model.attn_backend.init_forward_metadata(fb)
        before = pool.k_buffers[0].clone()
        monkeypatch.setenv("TESSERA_DECODE_STACK", "0")
        assert decode_stack.run(model.model, x, cos, sin, fb, pool) is None
        monkeypatch.delenv("TESSERA_DECODE_STACK")
        many = torch.zeros(100, x.shape[1])
        assert decode_stack.run(model.model, many, cos, sin, fb, pool) is None
        half = TokenToKVPool(pool.size, pool.num_layers, pool.num_kv_heads, pool.head_dim, torch.bfloat16)
        fb2 = _fresh(fb)
        model.model.attn_backend.init_forward_metadata(fb2)
        assert decode_stack.run(model.model, x, cos, sin, fb2, half) is None
        torch.testing.assert_close(pool.k_buffers[0], before, atol=0, rtol=0)
        assert decode_stack.run(model.model, x, cos, sin, _fresh(fb), pool) is not None  # and it does apply here
    prefill = ForwardBatch(torch.tensor([1, 2, 3]), torch.arange(3), torch.tensor([5, 6, 7]), torch.tensor([0]),
                           torch.tensor([3]), torch.tensor([3]), fb.req_to_token)
    x = model.embed(prefill)
    cos, sin = model.model.rotary_emb.get_cos_sin(prefill.positions, x.dtype)
    with torch.inference_mode():
        model.model.attn_backend.init_forward_metadata(prefill)
        assert decode_stack.run(model.model, x, cos, sin, prefill, pool) is None
    x = model.embed(fb)
    cos, sin = model.model.rotary_emb.get_cos_sin(fb.positions, x.dtype)
    assert torch.is_grad_enabled()
    assert decode_stack.run(model.model, x, cos, sin, _fresh(fb), pool) is None  # grad mode: autograd needs torch


def test_replaced_weights_rebuild_the_table(monkeypatch):
    model, cfg = _model("qwen2", BIG)
    fb, pool = _batch(cfg, [10])
    _check(model, fb, pool, monkeypatch, exact=True)
    lin = model.model.layers[1].mlp.down_proj
    lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight) * 0.1, requires_grad=False)
    monkeypatch.delenv("TESSERA_DECODE_STACK")
    fb, pool = _batch(cfg, [10], seed=1)
    _check(model, fb, pool, monkeypatch, exact=True)


def test_a_pool_whose_buffers_moved_repoints_every_layer(monkeypatch):
    """A pool made after another was freed (same object id, its first buffer at the old address) can have its
    other layers' buffers elsewhere: the table must follow every layer's buffers, not the first layer's alone
    (it read a freed pool's memory before). Here one object's later buffers are replaced."""
    model, cfg = _model("qwen2", BIG)
    fb, pool = _batch(cfg, [10, 20])
    _check(model, fb, pool, monkeypatch, exact=True)
    monkeypatch.delenv("TESSERA_DECODE_STACK")
    fb2, _ = _batch(cfg, [10, 20], seed=1)
    for layer in range(1, pool.num_layers):
        pool.k_buffers[layer] = torch.randn_like(pool.k_buffers[layer])
        pool.v_buffers[layer] = torch.randn_like(pool.v_buffers[layer])
    _check(model, fb2, pool, monkeypatch, exact=True)


def _adapters(model, num_slots: int, seed: int = 0) -> LoraStep:
    """LoRA stacks on every projection: slot 0 rank 8 on all of them, slot 1 rank 3 on q, v and down only (its
    other shards and projections hold zeros), slot 2 empty (an adapter's slot no row uses)."""
    gen = torch.Generator().manual_seed(seed)
    step = LoraStep(dtype=torch.float32)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            sizes = list(lin.output_sizes.values()) if isinstance(lin, MergedLinear) else [lin.out_features]
            lin.lora = LoraSlots(step, num_slots, lin.in_features, sizes, torch.float32, torch.device("cpu"))
            lin.lora.ensure_rank(8)
            pair = lambda r, n, lin=lin: (torch.randn(r, lin.in_features, generator=gen) * 0.2,  # noqa: E731
                                          torch.randn(n, r, generator=gen) * 0.2)
            lin.lora.place(0, [pair(8, n) for n in sizes])
            partial = lin is layer.mlp.down_proj or lin is layer.self_attn.qkv_proj
            lin.lora.place(1, [pair(3, n) if partial and i != 1 else None for i, n in enumerate(sizes)])
    return step


@pytest.mark.parametrize("req_slots", [[0, -1, 1, 0, 1, -1], [1]], ids=["mixed", "one"])
def test_lora_rows_equal_the_layers(req_slots, monkeypatch):
    """Adapter rows run in the C stack: each row gets its own adapter's product (slots interleaved, base rows
    between them), as the layer-by-layer path's LoRA products give it."""
    model, cfg = _model("qwen2", BIG, bias=True)
    step = _adapters(model, num_slots=3)
    fb, pool = _batch(cfg, [9, 40, 17, 3, 25, 60][:len(req_slots)])
    fb.lora_rows = True
    step.set_rows(req_slots, [1] * len(req_slots), torch.device("cpu"))
    try:
        stacked, layered, *_ = _both(model, fb, pool, monkeypatch)
    finally:
        step.clear()
    torch.testing.assert_close(stacked, layered, atol=2e-5, rtol=1e-5)
    monkeypatch.delenv("TESSERA_DECODE_STACK")
    for lin in (m for m in model.modules() if isinstance(m, Linear)):
        lin.lora = None
    plain, *_ = _both(model, _fresh(fb), _batch(cfg, [9, 40, 17, 3, 25, 60][:len(req_slots)])[1], monkeypatch)
    assert (stacked - plain).abs().max() > 1e-2  # the adapters changed every output they touch
