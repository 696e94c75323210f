"""16-bit weights under float32 activations (layers/half_linear.py): the C kernel (cpu_gemv16.c), the widened-block
path and their choice against a float64 product of the upcast weight, and keep_weights_in on a model."""

from __future__ import annotations

import pytest
import torch

from tessera.layers import cpu_gemv, half_linear
from tessera.layers.linear import Linear, ParallelLMHead, VocabParallelEmbedding, keep_weights_in, linear
from tessera.platform import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available("gemv_bf16") or not cpu_kernels.available("gemv_f16"),
                                reason="the 16-bit product kernels did not build here")

# (out, in): a 4-row block remainder and an 8-lane tail in every pair but the first.
SHAPES = [(8, 16), (7, 13), (37, 1003), (130, 771)]


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _weight(n: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (0.1 * torch.randn(n, k, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_upcast_product(dtype, threads, monkeypatch) -> None:
    """Every row count the kernel takes (1..48), odd shapes, with and without a bias, against float64; the
    widened path must not be what ran (it is made to raise)."""
    monkeypatch.setattr(half_linear, "_widened_linear", lambda *a: pytest.fail("widened path taken"))
    g = torch.Generator().manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        top = cpu_gemv.max_rows()
        with torch.inference_mode():
            for n, k in SHAPES:
                w = _weight(n, k, dtype, g)
                b = torch.randn(n, generator=g)
                # every row count on the last shape, the 2-row tile's edges on the others
                for m in range(1, top + 1) if (n, k) == SHAPES[-1] else (1, 2, 3, 5, top - 1, top):
                    x = torch.randn(m, k, generator=g)
                    bias = b if m % 2 else None
                    y = linear(x, w, bias)
                    assert y.dtype == torch.float32 and y.shape == (m, n)
                    torch.testing.assert_close(y.double(), _reference(x, w, bias), atol=2e-5 * k ** 0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_float16_special_values_widen_exactly() -> None:
    """Subnormals, zeros of both signs, the largest half and infinities, in the vector part and in the tail."""
    specials = torch.tensor([6e-8, -6e-8, 3e-5, 0.0, -0.0, 65504.0, -65504.0, 1.0], dtype=torch.float16)
    w = specials.repeat(4, 3)[:, :19].contiguous()  # 19 columns: two vectors of 8 and a tail of 3
    eye = torch.eye(19)
    with torch.inference_mode():
        y = linear(eye, w)  # row j of y is column j of w, widened
    assert torch.equal(y, w.float().t())
    inf = torch.tensor([[float("inf")] * 9], dtype=torch.float16)
    with torch.inference_mode():
        assert torch.isposinf(linear(torch.ones(1, 9), inf)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_rows_widen_blocks_into_sgemm(dtype, monkeypatch) -> None:
    """Past the kernel's rows: the weight widened in blocks (small blocks here, so a block boundary and a last
    partial block fall inside the weight) and the bias split with it; the same as widening it whole."""
    monkeypatch.setattr(half_linear, "BLOCK_VALUES", 1000)
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)  # the float32-compute path, on any CPU
    monkeypatch.setattr(half_linear, "_gemv16", lambda *a: pytest.fail("kernel taken for many rows"))
    g = torch.Generator().manual_seed(1)
    w, b = _weight(37, 101, dtype, g), torch.randn(37, generator=g)  # blocks of 9 rows: 4 whole and 1 row
    x = torch.randn(3, 70, 101, generator=g)  # 210 rows, batched dims kept
    with torch.inference_mode():
        y = linear(x, w, b)
    assert y.shape == (3, 70, 37)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w.float(), b), atol=1e-5, rtol=1e-5)


def test_without_the_kernel_few_rows_widen_too(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "available", lambda name: False)
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)
    monkeypatch.setattr(half_linear, "_gemv16", lambda *a: pytest.fail("kernel called while unavailable"))
    g = torch.Generator().manual_seed(2)
    w, x = _weight(33, 65, torch.bfloat16, g), torch.randn(2, 65, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w).double(), _reference(x, w, None), atol=1e-5, rtol=1e-5)
    assert "no gemv_bf16 kernel" in half_linear.describe(torch.bfloat16)


class _Tiny(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(11, 8)
        self.proj = Linear(8, 8, bias=True)
        self.head = ParallelLMHead(11, 8)
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [False, True])
def test_keep_weights_in_converts_linears_tables_and_heads(tied) -> None:
    model = _Tiny(tied)
    keep_weights_in(model, torch.float16)
    assert model.proj.weight.dtype == torch.float16 and model.proj.bias.dtype == torch.float32
    assert model.embed.weight.dtype == torch.float16 and model.embed(torch.tensor([3])).dtype == torch.float32
    assert model.head.weight.dtype == torch.float16
    assert (model.head.weight is model.embed.weight) == tied


def test_bf16_compute_takes_onednn_for_many_rows_only(monkeypatch) -> None:
    """With bf16 compute on, many rows of a bf16 weight run oneDNN's bf16 matmul: x rounded to bf16, the result
    float32 with the bias added, within bf16 rounding of the exact product; few rows keep the exact float32
    kernel; fp16 weights keep the widened path."""
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", True)
    g = torch.Generator().manual_seed(3)
    w, b, x = _weight(40, 64, torch.bfloat16, g), torch.randn(40, generator=g), torch.randn(100, 64, generator=g)
    with torch.inference_mode():
        y = linear(x, w, b)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, torch.nn.functional.linear(x.bfloat16(), w).float() + b)
        exact = _reference(x, w, b)
        err = (y.double() - exact).abs().max().item()
        assert 1e-6 < err < 0.05 * exact.abs().max().item()  # rounded, and only by bf16's 8 bits
        if cpu_kernels.available("gemv_bf16"):  # decode rows: exact, whatever the flag
            torch.testing.assert_close(linear(x[:2], w, b).double(), exact[:2], atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(half_linear, "F", None)  # fp16 must not reach F.linear's bf16 call
        h = w.to(torch.float16)
        torch.testing.assert_close(linear(x, h).double(), _reference(x, h, None), atol=1e-5, rtol=1e-5)
    assert "oneDNN bf16" in half_linear.describe(torch.bfloat16)
    assert "float32 compute" in half_linear.describe(torch.float16)


def test_bf16_compute_follows_the_cpu_unless_set(monkeypatch) -> None:
    """Unset or `auto`: on where the CPU has bf16 dot products (AVX512-BF16 or AMX), off elsewhere; 0 and 1
    decide on any CPU; anything else is an error naming the variable."""
    for flags, value, want in ((frozenset({"amx_bf16"}), "", True), (frozenset({"avx512_bf16"}), "auto", True),
                               (frozenset({"avx2", "f16c"}), "auto", False), (frozenset({"avx512_bf16"}), "0", False),
                               (frozenset({"avx2"}), "1", True)):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setenv("TESSERA_BF16_COMPUTE", value)
        assert half_linear.bf16_compute_wanted() is want, (flags, value)
    monkeypatch.setenv("TESSERA_BF16_COMPUTE", "yes")
    with pytest.raises(ValueError, match="TESSERA_BF16_COMPUTE"):
        half_linear.bf16_compute_wanted()
