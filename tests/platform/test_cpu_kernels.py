"""Our C kernels for the CPU (tessera/platform/cpu_kernels.py): the build and the few-row product (cpu_gemv.c)."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from tessera.layers import cpu_gemv
from tessera.platform import cpu_kernels
from tessera.layers import linear as lin

@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def count_kernel_calls(monkeypatch) -> list[str]:
    """The names cpu_kernels.call is asked to run from now on (it still runs them)."""
    calls: list[str] = []
    real = cpu_kernels.call
    monkeypatch.setattr(cpu_kernels, "call", lambda name, *a: calls.append(name) or real(name, *a))
    return calls


needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler: the kernel is never built, linear() keeps torch's path")


@needs_cc
def test_every_kernel_is_built_and_loaded_where_a_compiler_is():
    assert cpu_kernels.load() == {name: "loaded" for name in cpu_kernels.KERNELS}


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 64, 32), (1, 37, 300), (2, 67, 40), (3, 5, 8), (5, 130, 67), (8, 1, 7), (7, 33, 300), (17, 70, 300),
                          (48, 9, 64)])
def test_kernel_equals_f_linear(threads, rows, out_features, in_features):
    """Every tile remainder: rows of x odd and even, weight rows not a multiple of 4, in_features not a multiple
    of 8 (the scalar tail; at one row past the four-accumulator loop too); with and without bias; on one and two
    threads."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    with torch_threads(threads):
        for bias in (None, b):
            got = cpu_gemv.gemv(x, w, bias)
            assert got.shape == (rows, out_features)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=5e-5)  # 300-term sums


@needs_cc
def test_linear_takes_the_kernel_exactly_for_few_rows_of_float32_inference(monkeypatch):
    calls: list[int] = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(cpu_gemv.GEMV_MIN_WEIGHT // 256, 256, generator=g)
    b = torch.randn(w.shape[0], generator=g)
    with torch.inference_mode():
        for rows in (1, cpu_gemv.max_rows()):
            x = torch.randn(rows, 256, generator=g)
            torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        lin.linear(torch.randn(cpu_gemv.max_rows() + 1, 256), w)  # many rows
        lin.linear(torch.randn(2, 128), torch.randn(64, 128))  # small weight
        lin.linear(torch.randn(2, 256).bfloat16(), w.bfloat16())  # not float32
        lin.linear(torch.randn(256, 2).t(), w)  # x not contiguous
        lin.linear(torch.randn(2, 3, 256), w)  # not 2-D
        with pytest.raises(RuntimeError):  # shapes that disagree get torch's error, not the kernel
            lin.linear(torch.randn(2, 255), w)
    lin.linear(torch.randn(2, 256), w)  # autograd on
    assert calls == [1, cpu_gemv.max_rows()]


def _fresh_state(monkeypatch):
    """A process that has not loaded the kernels yet."""
    monkeypatch.setattr(cpu_kernels, "_functions", {})
    monkeypatch.setattr(cpu_kernels, "_errors", {})
    monkeypatch.setattr(cpu_kernels, "_loaded", False)


@needs_cc
def test_build_is_cached_per_source_and_a_failure_is_remembered(tmp_path, monkeypatch):
    lib = cpu_kernels.build("cpu_gemv.c", tmp_path)
    stamp = lib.stat().st_mtime_ns
    assert cpu_kernels.build("cpu_gemv.c", tmp_path) == lib and lib.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temp files left behind
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*cpu_kernels.FLAGS, "-DOTHER"))  # another key: must compile
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_kernels.build("cpu_gemv.c", tmp_path)
    failed = [p for p in tmp_path.iterdir() if p.suffix == ".failed"]
    assert len(failed) == 1 and "false failed" in failed[0].read_text()
    monkeypatch.setenv("CC", shutil.which("cc") or shutil.which("gcc"))  # a working compiler, the same key
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "false")
    with pytest.raises(RuntimeError, match="failed to build earlier"):  # not compiled again
        cpu_kernels.build("cpu_gemv.c", tmp_path)


@needs_cc
def test_one_bad_source_disables_its_kernel_alone(tmp_path, monkeypatch, caplog):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path))
    bad = cpu_kernels.Kernel("cpu_does_not_exist.c", "nothing", (), "torch's operators")
    monkeypatch.setattr(cpu_kernels, "KERNELS", {**cpu_kernels.KERNELS, "rmsnorm": bad})
    with caplog.at_level("WARNING", logger=cpu_kernels.logger.name):
        report = cpu_kernels.load()
    assert report["rmsnorm"].startswith("unavailable") and report["rmsnorm"].endswith("instead: torch's operators")
    assert all(report[name] == "loaded" for name in cpu_kernels.KERNELS if name != "rmsnorm")
    assert [r.message for r in caplog.records if "rmsnorm" in r.message] and not cpu_kernels.available("rmsnorm")
    assert cpu_kernels.load() == report  # once per process


def test_disabled_or_without_a_compiler_every_product_stays_with_torch(monkeypatch):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("TESSERA_CPU_KERNELS", "0")
    assert all("TESSERA_CPU_KERNELS=0" in v for v in cpu_kernels.load().values())
    _fresh_state(monkeypatch)
    monkeypatch.setenv("TESSERA_CPU_KERNELS", "1")
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert all("no C compiler" in v for v in cpu_kernels.load().values())  # logged, not raised
    with torch.inference_mode():
        x, w = torch.randn(1, 256), torch.randn(cpu_gemv.GEMV_MIN_WEIGHT // 256, 256)
        assert not cpu_gemv.applies(x, w, None)
        torch.testing.assert_close(lin.linear(x, w), F.linear(x, w))




@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "width"), [(1, 256), (3, 37), (700, 256)])  # a scalar tail; the parallel branch
def test_rmsnorm_kernel_matches_hf(threads, rows, width):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    from tessera.layers import norm

    g = torch.Generator().manual_seed(rows + width)
    x, res = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    ours, ref = norm.RMSNorm(width, 1e-5), Qwen2VLRMSNorm(width, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(width, generator=g) + 0.5)
        ref.weight.copy_(ours.weight)
    x0, res0 = x.clone(), res.clone()
    with torch_threads(threads), torch.inference_mode():
        assert norm._kernel_applies(x, res, ours.weight)
        torch.testing.assert_close(ours(x), ref(x), rtol=2e-6, atol=2e-6)
        normed, summed = ours(x, res)
        assert torch.equal(summed, x + res)  # the next residual: the same single add
        torch.testing.assert_close(normed, ref(x + res), rtol=2e-6, atol=2e-6)
        assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@needs_cc
def test_rmsnorm_takes_the_kernel_only_for_float32_inference_on_contiguous_rows():
    from tessera.layers import norm

    w = torch.ones(64)
    with torch.inference_mode():
        assert norm._kernel_applies(torch.randn(4, 64), None, w)
        assert not norm._kernel_applies(torch.randn(2, 4, 64), None, w)  # not [tokens, hidden]
        assert not norm._kernel_applies(torch.randn(4, 64).bfloat16(), None, w.bfloat16())
        assert not norm._kernel_applies(torch.randn(64, 4).t(), None, w)  # not contiguous
        assert not norm._kernel_applies(torch.randn(4, 64), torch.randn(64, 4).t(), w)  # residual not contiguous
        assert not norm._kernel_applies(torch.randn(4, 32), None, w)  # width disagrees: torch raises
    assert not norm._kernel_applies(torch.randn(4, 64), None, w)  # autograd on


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 6, 64), (3, 2, 20), (700, 6, 64), (5, 3, 128)])
def test_rotary_kernel_is_bit_identical_to_torchs_form(threads, tokens, heads, head_dim, monkeypatch):
    """q and k as column slices of a fused qkv output (strided rows), half a head not a multiple of 8 (the
    scalar tail), the parallel branch (700 tokens): the same bits as the operators (transformers' order)."""
    from tessera.layers import rotary

    g = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=g)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = torch.randn(tokens, head_dim // 2, generator=g), torch.randn(tokens, head_dim // 2, generator=g)
    want = rotary.apply_rotary(x, cos, sin)  # autograd on: torch's operators
    calls = count_kernel_calls(monkeypatch)
    with torch_threads(threads), torch.inference_mode():
        got = rotary.apply_rotary(x, cos, sin)
    assert calls == ["rotary"] and torch.equal(got, want)
    assert rotary.apply_rotary(x.bfloat16(), cos.bfloat16(), sin.bfloat16()).dtype == torch.bfloat16  # torch's path


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "d"), [(1, 704), (3, 11), (64, 1408), (300, 256)])
def test_silu_mul_kernel_matches_torch(threads, rows, d, monkeypatch):
    """Vector tails (d not a multiple of 8), rows with a stride wider than 2d, the parallel branch; large
    gates both ways (exp's range)."""
    from tessera.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(rows + d)
    wide = torch.randn(rows, 2 * d + 5, generator=g) * 6
    x = wide[:, : 2 * d]  # row stride 2d + 5
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    calls = count_kernel_calls(monkeypatch)
    with torch_threads(threads), torch.inference_mode():
        got = SiluAndMul()(x)
        assert SiluAndMul()(x.bfloat16()).dtype == torch.bfloat16  # torch's path
        assert SiluAndMul()(x[None]).shape == (1, rows, d)  # 3-D: torch's path
    assert calls == ["silu_mul"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
