"""The decoder layer's fused Triton kernels (layers/triton_ops.py) against the torch operators they replace, on
the device under test: float32 within rounding of the other summation order, float16 within one ulp (bit for bit
for the rotary, which rounds the same intermediates with no transcendental); and a tiny Qwen2 and Qwen2-VL decoding through
them equal HF. On a CPU the kernels run in Triton's interpreter, in a subprocess."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_device import DEVICE, RUNS_KERNELS, run_interpreted

pytestmark = pytest.mark.cuda
needs_kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16]
# Within rounding of another summation order and of the GPU's approximate exp / rsqrt / division (a few float32
# ulps; one float16 ulp where a transcendental feeds the rounding), which the interpreter's numpy does not show.
TOL = {torch.float32: dict(atol=5e-6, rtol=5e-6), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.skipif(RUNS_KERNELS, reason="the kernels run in this process")
def test_under_the_triton_interpreter() -> None:
    out = run_interpreted(__file__)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout.splitlines()[-1].split("passed")[0]


def _torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 96])
def test_rmsnorm_with_and_without_residual(dtype, hidden) -> None:
    from tessera.layers import triton_ops

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, hidden, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_ops.rmsnorm(x, None, w, 1e-6), _torch_rmsnorm(x, w, 1e-6),
                               **TOL[dtype])
    out, summed = triton_ops.rmsnorm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)  # the next residual: the same single add
    torch.testing.assert_close(out, _torch_rmsnorm(x + r, w, 1e-6), **TOL[dtype])
    # A row-strided view (a column slice of a wider tensor) is read through its stride.
    wide = torch.randn(5, hidden + 8, generator=g).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_ops.rmsnorm(wide[:, :hidden], None, w, 1e-6),
                               _torch_rmsnorm(wide[:, :hidden], w, 1e-6), **TOL[dtype])
    assert triton_ops.rmsnorm(x, None, w.float() if dtype != torch.float32 else w.half(), 1e-6) is None


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norms_and_sandwich(dtype) -> None:
    """Gemma's (1 + w) norm alone, and x + norm_post(a) with norm_next of the sum, as Gemma3DecoderLayer computes
    them with torch's operators."""
    from tessera.layers import triton_ops

    g = torch.Generator().manual_seed(5)
    a, x = (torch.randn(4, 48, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w_post, w_next = (0.3 * torch.randn(48, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    tol = TOL[dtype]
    torch.testing.assert_close(triton_ops.rmsnorm(x, None, w_post, 1e-6, gemma=True), _gemma_norm(x, w_post, 1e-6),
                               **tol)
    want_sum = x + _gemma_norm(a, w_post, 1e-6)
    out, summed = triton_ops.gemma_norm_add(a, x, w_post, w_next, 1e-6)
    torch.testing.assert_close(summed, want_sum, **tol)
    torch.testing.assert_close(out, _gemma_norm(summed, w_next, 1e-6), **tol)
    none, summed_only = triton_ops.gemma_norm_add(a, x, w_post, None, 1e-6)
    assert none is None and torch.equal(summed_only, summed)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype) -> None:
    from tessera.layers import triton_ops

    x = (3 * torch.randn(3, 2 * 70, generator=torch.Generator().manual_seed(6))).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up,
                               **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype) -> None:
    from tessera.layers import triton_ops

    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)  # > one block
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_and_mul(x), F.silu(gate) * up, **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [((4, 2), 24), ((6, 1), 16), ((2, 2), 128)])
@pytest.mark.parametrize("qk_norm", [False, "rms", "gemma"], ids=["plain", "qk_norm", "gemma_qk_norm"])
def test_rotary_store_kv_equals_rotary_then_set_kv(dtype, heads, head_dim, qk_norm) -> None:
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.layers import triton_ops
    from tessera.layers.norm import RMSNorm
    from tessera.layers.rotary import apply_rotary

    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(2)
    t = 5
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    angles = torch.randn(t, head_dim // 2, generator=g) * 3
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    loc = torch.tensor([9, 2, 7, 4, 11], device=DEVICE)
    fused, ref = (TokenToKVPool(12, 1, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    stale = torch.randn(fused.k_buffers[0].shape, generator=g).to(dtype).to(DEVICE)
    for pool in (fused, ref):  # the same stale content in the slots nobody writes
        pool.k_buffers[0].copy_(stale)
        pool.v_buffers[0].copy_(-stale)
    norms = None
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(t, num_heads + num_kv_heads, head_dim)
    if qk_norm:  # Qwen3's (or Gemma-3's) per-head norms, as the layer runs them with torch's operators
        from tessera.layers.gemma_decoder import GemmaRMSNorm

        cls = GemmaRMSNorm if qk_norm == "gemma" else RMSNorm
        q_norm, k_norm = (cls(head_dim, 1e-6).to(dtype).to(DEVICE) for _ in range(2))
        with torch.no_grad():
            for n in (q_norm, k_norm):
                n.weight.copy_(1 + 0.2 * torch.randn(head_dim, generator=g))
        norms = (q_norm.weight, k_norm.weight, 1e-6, qk_norm == "gemma")
        torch_form = (lambda n, t: _gemma_norm(t, n.weight, n.eps)) if qk_norm == "gemma" else (lambda n, t: n._norm(t))
        qk = torch.cat([torch_form(q_norm, qk[:, :num_heads]), torch_form(k_norm, qk[:, num_heads:])], dim=1)
    q = triton_ops.rotary_store_kv(qkv, cos, sin, *fused.get_kv(0), loc, num_heads, num_kv_heads, head_dim, norms)
    qk = apply_rotary(qk, cos, sin)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    ref.set_kv(0, loc, qk[:, num_heads:], v)
    # No transcendental without the q/k norms: the same roundings in the same order, bit for bit in float16.
    tol = TOL[torch.float32] if dtype == torch.float32 else dict(atol=0, rtol=0)
    if qk_norm and dtype != torch.float32:  # the norm's sum of squares in another order: a rare last-bit flip
        tol = dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(q, qk[:, :num_heads], **tol)
    torch.testing.assert_close(fused.k_buffers[0], ref.k_buffers[0], **tol)
    assert torch.equal(fused.v_buffers[0], ref.v_buffers[0])


@needs_kernels
def test_tiny_qwen2_vl_decodes_through_the_fused_kernels_as_hf(tmp_path) -> None:
    """Text and image prompts of a tiny Qwen2-VL (M-RoPE positions into the fused rotary) on the Triton backend:
    prefill logits and greedy tokens equal HF's in float32."""
    from tessera.models.registry import load_model
    from tests.models import qwen2_vl_testing as qv
    from tests.models.paged_driver import PagedKV, Step, decode_greedy, make_batch

    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration._from_config(qv.tiny_vl_config(), attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, torch.float32, device=DEVICE, attention_backend="triton")
    hf.to(DEVICE)
    ids = torch.randint(4, 64, (29,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None].to(DEVICE)).logits[0]
        want = hf.generate(input_ids=ids[None].to(DEVICE), attention_mask=torch.ones(1, 29, dtype=torch.long,
                           device=DEVICE), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, 29:].tolist()
        kv = PagedKV(ours.lm_config, page_size=4, device=DEVICE)
        row = kv.new_request()
        logits = ours(make_batch(kv, [Step(row, ids, torch.arange(29), all_logits=True)]), kv.pool)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert decode_greedy(ours, kv, [row], logits[-1:], 6) == [want]


@needs_kernels
def test_tiny_qwen3_decodes_through_the_fused_qk_norm_as_hf(tmp_path) -> None:
    """Qwen3's q/k norms inside the fused rotary kernel: prefill logits and greedy tokens equal HF's (float32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tessera.models.registry import load_model
    from tests.models.paged_driver import check_text_prefill_and_decode

    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1, so that a fused kernel that skipped them would show
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, torch.float32, device=DEVICE, attention_backend="triton")
    hf.to(DEVICE)
    ids = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(4))
    check_text_prefill_and_decode(hf, ours, ids, 5)
