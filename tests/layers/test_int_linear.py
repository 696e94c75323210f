"""Weight-only int8 / int4 products (layers/quantization/int_linear.py, platform/csrc/cpu_int_gemv.c) against
the dequantized AffineWeight's float32 product, and the Linear modules' set_quantized."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from tessera.config import ServerArgs
from tessera.layers import half_linear
from tessera.layers import linear as lin
from tessera.layers.quantization import int_linear
from tessera.layers.quantization.affine import AffineWeight, quantize
from tessera.layers.quantization.int_linear import PackedIntWeight, parse_scheme, quantize_linears
from tessera.platform import cpu_kernels

# (out, in, bits, group or None for per channel, symmetric): odd row counts (not a multiple of the kernel's
# 4-row tiles), per-channel int8 over a row that is not a multiple of 8, groups from 16 to 128, and rows
# longer than the kernel's 512-column strips (ending mid-group and, for int8, mid-chunk).
SHAPES = [(37, 100, 8, None, True), (64, 96, 8, 32, False), (45, 80, 8, 20, False), (37, 96, 4, 32, False),
          (66, 128, 4, 16, False), (20, 256, 4, 128, False), (12, 64, 4, 64, True), (9, 1003, 8, None, True),
          (10, 1040, 4, 80, False)]
ROWS = [1, 2, 3, 5, 17, 48]


def c_kernels() -> bool:
    return all(cpu_kernels.available(k) for k in ("int8_gemv", "int4_gemv", "int_dequant"))


def weight_case(out: int, inp: int, bits: int, group: int | None, symmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    aw = quantize(torch.randn(out, inp, generator=gen) * 0.1, bits, group, symmetric)
    return aw, torch.randn(out, generator=gen)


def check(y: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in another order, and the zero point folded into a fused multiply-subtract.
    torch.testing.assert_close(y, want, atol=1e-5 * float(want.detach().abs().max()) + 1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:2])) + f"-int{s[2]}-g{s[3]}")
def test_c_kernel_matches_dequantized_product(shape):
    if not c_kernels():
        pytest.skip("no C compiler: the kernels are never built")
    aw, bias = weight_case(*shape)
    packed = PackedIntWeight(aw, "c")
    w = aw.dequantize()
    torch.testing.assert_close(packed.dequantize(), w, atol=1e-6, rtol=1e-6)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, aw.shape[1], generator=gen)
            check(packed._c_gemv(x, None), x @ w.T)
            check(packed._c_gemv(x, bias), x @ w.T + bias)


def test_paths_agree_and_rows_past_the_kernel_go_dequantized(monkeypatch):
    """Every path ("c", torch's packed ops, "affine") gives the dequantized product, for few rows and for a
    prefill's many (which the C path runs as its dequantized weight through `dense`, in float32 here)."""
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)
    dense_calls = []
    for shape in [(64, 128, 8, None, True), (64, 128, 4, 32, False)]:
        aw, bias = weight_case(*shape, seed=2)
        w = aw.dequantize()
        paths = ["affine", "torch"] + (["c"] if c_kernels() else [])
        for path in paths:
            packed = PackedIntWeight(aw, path)
            for m in (1, 7, int_linear.max_rows() + 5):
                x = torch.randn(2, m, aw.shape[1])  # a leading dim, as a batch of sequences
                with torch.inference_mode():
                    y = packed(x, bias, dense=lambda a, b, c: dense_calls.append(a.shape[0]) or lin.linear(a, b, c))
                check(y, x @ w.T + bias)
    assert 2 * (int_linear.max_rows() + 5) in dense_calls


# Rows of 128 columns and groups of 32, 64, 128, 256 take the AVX512-BF16 batch-1 kernel where the CPU has it;
# the others (and two or more rows) the float32 kernel over x rounded to bf16.
BF16X_SHAPES = [(37, 256, 4, 32, False), (20, 384, 4, 64, False), (9, 768, 4, 128, False), (16, 512, 4, 256, True),
                (37, 96, 4, 32, False), (66, 128, 4, 16, False), (10, 1040, 4, 80, False)]


@pytest.mark.parametrize("shape", BF16X_SHAPES, ids=lambda s: "x".join(map(str, s[:2])) + f"-g{s[3]}")
def test_int4_kernel_with_bf16_activations_is_the_product_over_x_rounded(shape, monkeypatch):
    """With bf16 products on, the few-row products of a torchao int4 weight (bf16 activations) round x to bf16 and
    are otherwise exact: the float32 product of the rounded x and the dequantized weight, up to the order of the
    sums (the batch-1 kernel adds 128 to every weight and takes 128 x the group's sum back off, which costs a few
    bits: hence 3e-5 of the largest value). A pre-quantized checkpoint's int4 weight keeps float32 x."""
    if not (c_kernels() and cpu_kernels.available("int4_gemv_bf16x")):
        pytest.skip("no C kernels")
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", True)
    aw, bias = weight_case(*shape, seed=5)
    packed = PackedIntWeight(aw, "c", bf16_activations=True)
    assert packed.kernel == "int4_gemv_bf16x" and PackedIntWeight(aw, "c").kernel == "int4_gemv"
    w = aw.dequantize()
    gen = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for m in (1, 2, 5):
            x = torch.randn(m, aw.shape[1], generator=gen)
            want = x.bfloat16().float() @ w.T + bias
            y = packed._c_gemv(x, bias)
            torch.testing.assert_close(y, want, atol=3e-5 * float(want.abs().max()), rtol=0)
            assert not torch.allclose(y, x @ w.T + bias, atol=1e-6, rtol=1e-6)  # x was rounded
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)  # float32 products everywhere: x as it is
    assert packed.kernel == "int4_gemv"
    with torch.inference_mode():
        check(packed._c_gemv(x, bias), x @ w.T + bias)


def test_bf16_products_take_many_rows_only(monkeypatch):
    """Where the CPU has bf16 dot products, a prefill's rows multiply the dequantized weight rounded to bf16
    (x rounded too), within bf16 rounding of the exact product; few rows stay on the C kernel (int4's over x
    rounded to bf16 for torchao's int4: the test above) or, without it, on the exact float32 product."""
    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", True)
    aw, bias = weight_case(64, 128, 4, 32, False, seed=3)
    w = aw.dequantize()
    for path in ["affine"] + (["c"] if c_kernels() else []):
        packed = PackedIntWeight(aw, path)
        x = torch.randn(int_linear.max_rows() + 5, aw.shape[1])
        with torch.inference_mode():
            y = packed(x, bias, dense=lambda *a: pytest.fail("float32 product taken with bf16 products on"))
            check(packed(x[:3], bias), x[:3] @ w.T + bias)
        torch.testing.assert_close(y, half_linear.bf16_linear(x, w.bfloat16(), bias))
        err = (y - (x @ w.T + bias)).abs().max().item()
        assert 1e-6 < err < 0.05 * (x @ w.T).abs().max().item()


def test_portable_c_path_without_avx2(tmp_path):
    """cpu_int_gemv.c built for baseline x86-64 (no AVX2: the vector-extension path) gives the AVX2 build's results."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not c_kernels():
        pytest.skip("no C compiler")
    lib = tmp_path / "portable.so"
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC"] + (["-march=x86-64"] if "x86" in _machine() else [])
    subprocess.run([cc, *flags, str(cpu_kernels.CSRC / "cpu_int_gemv.c"), "-o", str(lib)], check=True)
    portable = ctypes.CDLL(str(lib))
    for bits, group in ((8, None), (4, 32)):
        aw, bias = weight_case(36, 96, bits, group, bits == 8, seed=3)
        packed = PackedIntWeight(aw, "c")
        fn = getattr(portable, f"tessera_int{bits}_gemv_f32")
        fn.argtypes, fn.restype = cpu_kernels.KERNELS[f"int{bits}_gemv"].argtypes, None
        for m in (1, 2, 5):
            x = torch.randn(m, 96)
            y = torch.empty(m, 36)
            fn(x.data_ptr(), packed.q.data_ptr(), packed.scale.data_ptr(), packed.zs.data_ptr(), bias.data_ptr(),
               y.data_ptr(), m, 36, 96, packed.group_size, 1)
            check(y, x @ aw.dequantize().T + bias)
            if bits == 4:  # bf16 x: the same numbers as the float32 product over the rounded x
                bf16x = portable.tessera_int4_gemv_bf16x
                bf16x.argtypes, bf16x.restype = cpu_kernels.KERNELS["int4_gemv_bf16x"].argtypes, None
                bf16x(x.data_ptr(), packed.q.data_ptr(), packed.scale.data_ptr(), packed.zs.data_ptr(),
                      bias.data_ptr(), y.data_ptr(), m, 36, 96, packed.group_size, 1)
                check(y, x.bfloat16().float() @ aw.dequantize().T + bias)


def _machine() -> str:
    import platform

    return platform.machine()


def test_linear_set_quantized_frees_the_float_weight_and_keeps_merged_and_row_parallel_behaviour():
    torch.manual_seed(4)
    merged = lin.MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=True, sources={"k": (16, 32), "v": (0, 16)})
    shards = {s: quantize(torch.randn(full if s in merged.sources else size, 64), 4, 32)
              for s, size, full in (("q", 32, 32), ("k", 16, 32), ("v", 16, 16))}
    torch.nn.init.normal_(merged.bias)
    merged.set_quantized_shards(shards)
    assert merged.weight is None and "weight" not in dict(merged.named_parameters())
    want_w = torch.cat([shards["q"].dequantize(), shards["k"].dequantize()[16:], shards["v"].dequantize()])
    x = torch.randn(3, 64)
    with torch.inference_mode():
        y = merged(x)
    check(y, x @ want_w.T + merged.bias)
    assert [t.shape[-1] for t in merged.split(y)] == [32, 16, 16]

    # A row-parallel rank given the checkpoint's full width keeps its columns (on group boundaries).
    row = lin.RowParallelLinear(64, 24, bias=True, start=64, full_in_features=128)
    torch.nn.init.normal_(row.bias)
    full = quantize(torch.randn(24, 128), 8, 32)
    row.set_quantized(full)
    xr = torch.randn(2, 64)
    with torch.inference_mode():
        check(row(xr), xr @ full.dequantize()[:, 64:].T + row.bias)
    with pytest.raises(ValueError, match="split groups"):
        lin.RowParallelLinear(48, 24, start=16, full_in_features=64).set_quantized(quantize(torch.randn(24, 64), 4, 32))
    with pytest.raises(ValueError, match="want"):
        lin.Linear(64, 8).set_quantized(quantize(torch.randn(8, 32), 8))


def test_quantize_linears_covers_the_language_model_only():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.ModuleDict({"proj": lin.Linear(64, 32), "router": lin.Linear(64, 4)})
            self.model["router"].is_router = True  # as the MoE layers mark theirs: it stays float
            self.visual = lin.Linear(64, 64)

    tiny = Tiny()
    for p in tiny.parameters():
        torch.nn.init.normal_(p)
    what = quantize_linears(tiny, "int4wo-32")
    assert what.startswith("int4wo-32 (torchao-config), ")
    assert tiny.model["proj"].weight is None and tiny.model["router"].weight is not None
    assert tiny.visual.weight is not None
    partly = Tiny()
    partly.model["wide"] = lin.Linear(128, 8)
    what = quantize_linears(partly, "int4wo-128")  # as torchao: 64 input features stay float at groups of 128
    assert partly.model["proj"].weight is not None and partly.model["wide"].weight is None
    assert what.endswith("(1 linears), 1 linears float (input features not a multiple of 128); encoders, "
                         "embeddings and LM head float")
    with pytest.raises(ValueError, match="no language-model linear layer"):
        quantize_linears(Tiny(), "int4wo-128")


def test_scheme_names_and_the_flag_check():
    assert parse_scheme("int8wo") == (8, None, True)
    assert parse_scheme("int4wo-64") == (4, 64, False)
    with pytest.raises(ValueError, match="torchao_config: expected one of int8wo, int4wo-32"):
        ServerArgs(torchao_config="int4wo")
    assert ServerArgs(torchao_config="int4wo-128").torchao_config == "int4wo-128"


def test_affine_path_where_the_kernels_are_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_functions", {})
    monkeypatch.setattr(cpu_kernels, "_loaded", True)
    monkeypatch.setattr(int_linear, "prefers_torch_ops", lambda: False)
    aw = quantize(torch.randn(8, 32), 8)
    packed = PackedIntWeight(aw)
    assert packed.path == "affine" and "dequantized by torch" in packed.description
    x = torch.randn(1, 32)
    check(packed(x), x @ aw.dequantize().T)


def test_affine_weight_is_the_interface():
    """What a pre-quantized checkpoint's loader builds goes straight in."""
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    aw = AffineWeight(q, torch.rand(16, 2) + 0.01, torch.rand(16, 2) * 15, 4, 32)
    layer = lin.Linear(64, 16)
    layer.set_quantized(aw)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        check(layer(x), x @ aw.dequantize().T)


@pytest.mark.parametrize("shape", [(48, 1040, 8, None, True), (32, 1056, 4, 32, False)])
def test_dequantized_to_bf16_is_the_float32_weight_rounded(shape):
    """int_dequant_bf16 (columns in chunks of 512, the last one partial here) rounds to nearest, ties to even:
    torch's own float32 -> bfloat16 rounding of the float32 dequantization."""
    if not (c_kernels() and cpu_kernels.available("int_dequant_bf16")):
        pytest.skip("no C kernels")
    aw, _ = weight_case(*shape, seed=4)
    packed = PackedIntWeight(aw, "c")
    w32 = packed.dequantize()
    w16 = packed.dequantize(torch.bfloat16)
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))
    assert not torch.equal(w16.float(), w32)  # the values were rounded, not all representable already
