"""Rotary (plain and M-RoPE), RMSNorm and SiluAndMul against transformers' Qwen2-VL / Qwen2 code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLRMSNorm,
    Qwen2VLRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tessera.layers.activation import SiluAndMul
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import RotaryEmbedding, apply_rotary


def _hf_rotate(section, positions, q, k):
    cfg = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    cos, sin = Qwen2VLRotaryEmbedding(cfg)(q, positions[:, None, :])
    return apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)


def test_mrope_matches_hf():
    g = torch.Generator().manual_seed(0)
    t = 9
    hw = torch.randint(0, 20, (2, t), generator=g)
    positions = torch.cat([torch.arange(t)[None], hw])
    q, k = torch.randn(t, 4, 16, generator=g), torch.randn(t, 2, 16, generator=g)
    rope = RotaryEmbedding(16, 10000.0, [2, 3, 3])
    cos, sin = rope.get_cos_sin(positions, torch.float32)
    hq, hk = _hf_rotate([2, 3, 3], positions, q, k)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hq[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hk[0].transpose(0, 1), atol=1e-6, rtol=0)
    # Sections matter: the same angles taken all from row 0 differ.
    assert not torch.allclose(apply_rotary(q, *rope.get_cos_sin(positions[0], torch.float32)), hq[0].transpose(0, 1))


def test_text_positions_equal_for_plain_and_mrope():
    pos = torch.arange(7)
    plain, mrope = RotaryEmbedding(16, 500.0), RotaryEmbedding(16, 500.0, [4, 2, 2])
    for a, b in zip(plain.get_cos_sin(pos, torch.float32), mrope.get_cos_sin(pos.expand(3, -1), torch.float32)):
        assert torch.equal(a, b)


def test_rmsnorm_matches_hf_and_fuses_residual():
    """torch's path (autograd on here, so the C kernel of tests/platform/test_cpu_kernels.py is not taken)."""
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    ours, ref = RMSNorm(32, 1e-6), Qwen2VLRMSNorm(32, 1e-6)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    assert torch.equal(ours(x), ref(x))
    normed, new_res = ours(x, res)
    assert torch.equal(new_res, x + res) and torch.equal(normed, ref(x + res))
    for rows, width in ((1, 4096), (33, 896), (700, 256)):  # float32 takes F.rms_norm: still bit-identical to HF
        x, w = torch.randn(rows, width, generator=g) * 3, torch.rand(width, generator=g) + 0.5
        ours, ref = RMSNorm(width, 1e-5), Qwen2VLRMSNorm(width, 1e-5)
        with torch.no_grad():
            ours.weight.copy_(w)
            ref.weight.copy_(w)
        assert torch.equal(ours(x), ref(x))
        assert torch.equal(ours(x.bfloat16()).float(), ref(x.bfloat16()).float())  # bf16 keeps HF's own ops


def test_silu_and_mul():
    x = torch.randn(3, 10)
    assert torch.equal(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_linear_takes_onednn_over_a_large_weight_on_several_threads(monkeypatch):
    """A large float32 weight with 2+ torch threads goes through oneDNN at any number of rows (and equals
    F.linear); everything else (small weights, one thread, autograd) stays on F.linear."""
    import tessera.layers.linear as lin

    if lin._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(lin, "_onednn_any_size", False)  # the AVX-512 rule: the next test
    # Few rows also fit our own kernel (cpu_gemv, taken first, tested in test_cpu_kernels.py): off here.
    monkeypatch.setattr(lin.cpu_gemv, "applies", lambda *a: False)
    calls: list[tuple[int, int]] = []
    real = lin._onednn_linear
    monkeypatch.setattr(lin, "_onednn_linear", lambda x, w, *a: calls.append((x.shape[0], w.numel())) or real(x, w, *a))
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(lin.ONEDNN_MIN_WEIGHT // 512, 512, generator=g)
    bias = torch.randn(weight.shape[0], generator=g)
    small = torch.randn(256, 512, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            for rows in (1, 7, 300):  # few rows and a prefill's many
                x = torch.randn(rows, 512, generator=g)
                torch.testing.assert_close(lin.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5,
                                           atol=1e-4)
            lin.linear(torch.randn(4, 512), small)  # small weight
            torch.set_num_threads(1)
            lin.linear(torch.randn(4, 512), weight)  # one thread
        torch.set_num_threads(2)
        lin.linear(torch.randn(4, 512), weight)  # grad mode on
    finally:
        torch.set_num_threads(threads)
    assert calls == [(1, weight.numel()), (7, weight.numel()), (300, weight.numel())]


@pytest.mark.parametrize("avx512", [False, True])
def test_on_avx512_onednn_takes_many_rows_of_any_weight(monkeypatch, avx512):
    """Where the CPU has AVX-512, many rows of a small weight go through oneDNN on any number of threads (and
    equal F.linear); few rows stay. Without it, small weights stay on F.linear."""
    import tessera.layers.linear as lin

    if lin._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(lin, "_onednn_any_size", avx512)
    calls: list[int] = []
    real = lin._onednn_linear
    monkeypatch.setattr(lin, "_onednn_linear", lambda x, w, *a: calls.append(x.shape[0]) or real(x, w, *a))
    g = torch.Generator().manual_seed(1)
    small, bias = torch.randn(384, 128, generator=g), torch.randn(384, generator=g)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (lin.ONEDNN_MIN_ROWS - 1, lin.ONEDNN_MIN_ROWS, 256):
                    x = torch.randn(rows, 128, generator=g)
                    torch.testing.assert_close(lin.linear(x, small, bias), F.linear(x, small, bias), rtol=1e-5,
                                               atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert calls == ([lin.ONEDNN_MIN_ROWS, 256] * 2 if avx512 else [])
