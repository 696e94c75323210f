"""Decode attention through our C kernel (tessera/layers/cpu_decode_attention.c) against a float64 reference:
block and vector tails, query groups, sliding windows, mirror rows and gathered layouts, one and two threads."""

from __future__ import annotations

import shutil

import pytest
import torch

from tessera.layers import cpu_kernels
from tessera.layers.attention import cpu_decode

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernel is never built, decode keeps torch's path")


def reference(q, k, v, lens, rows, scaling, window=None):
    """q [B, Hkv, G, D]; k, v [rows, Hkv, L, D]; float64 softmax over each request's keys."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        row = b if rows is None else int(rows[b])
        hi = int(lens[b])
        lo = max(0, hi - window) if window else 0
        kb, vb = k[row, :, lo:hi].double(), v[row, :, lo:hi].double()  # [Hkv, n, D]
        scores = torch.einsum("hgd,hnd->hgn", q[b].double(), kb) * scaling
        out[b] = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), vb).float()
    return out


def run(q, k, v, lens, rows, scaling, window, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            assert cpu_decode.applies(q, k, v)
            return cpu_decode.decode_attention(q, k, v, lens, rows, scaling, window)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim", "lens", "window"), [
    (2, 2, 64, [1, 3, 64, 65, 130, 257], None),  # key tails of 1-3, a whole block, a block and one
    (1, 7, 8, [5, 9, 70], None),  # an odd group, the smallest head
    (4, 1, 128, [100, 33], None),  # no grouping (MHA), accumulators past the 32-lane chunks
    (2, 4, 40, [200, 6, 90], 64),  # head_dim with an 8-lane tail; a sliding window shorter and longer than lens
    (3, 2, 16, [300, 2], 5),
], ids=["blocks", "odd-group", "mha", "window", "short-window"])
@pytest.mark.parametrize("layout", ["mirror", "gathered"])
def test_kernel_matches_the_reference(threads, kv_heads, group, head_dim, lens, window, layout):
    g = torch.Generator().manual_seed(sum(lens) + head_dim)
    batch, longest = len(lens), max(lens)
    q = torch.randn(batch, kv_heads, group, head_dim, generator=g)
    if layout == "mirror":  # [R, Hkv, Tcap, D] with spare rows and capacity; request b sits in row rows[b]
        k = torch.randn(batch + 3, kv_heads, longest + 40, head_dim, generator=g)
        v = torch.randn(batch + 3, kv_heads, longest + 40, head_dim, generator=g)
        rows = torch.randperm(batch + 3, generator=g)[:batch]
    else:  # gathered from the pool [B, L, Hkv, D], viewed as [B, Hkv, L, D]
        k = torch.randn(batch, longest, kv_heads, head_dim, generator=g).transpose(1, 2)
        v = torch.randn(batch, longest, kv_heads, head_dim, generator=g).transpose(1, 2)
        rows = None
    lens_t = torch.tensor(lens)
    got = run(q, k, v, lens_t, rows, 0.125, window, threads)
    torch.testing.assert_close(got, reference(q, k, v, lens_t, rows, 0.125, window), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_running_max_rises_across_blocks(threads):
    """Scores that grow block after block (and span ~100 nats) make every block rescale what came before;
    the exponential's range limits must not turn large negative gaps into garbage."""
    n, head_dim = 300, 16
    q = torch.ones(1, 1, 2, head_dim)
    q[0, 0, 1] = -1.0  # the second query row sees the scores falling instead
    k = torch.linspace(-6.0, 6.0, n)[None, None, :, None].repeat(1, 1, 1, head_dim)
    v = torch.randn(1, 1, n, head_dim, generator=torch.Generator().manual_seed(0))
    lens = torch.tensor([n])
    got = run(q, k, v, lens, None, 1.0, None, threads)
    torch.testing.assert_close(got, reference(q, k, v, lens, None, 1.0), rtol=1e-5, atol=1e-6)


def test_applies_only_to_float32_cpu_inference_with_shapes_the_kernel_handles():
    q, k = torch.randn(2, 2, 2, 64), torch.randn(2, 2, 10, 64)
    with torch.inference_mode():
        assert cpu_decode.applies(q, k, k)
        assert not cpu_decode.applies(q.bfloat16(), k.bfloat16(), k.bfloat16())
        assert not cpu_decode.applies(q[..., :60].contiguous(), k[..., :60], k[..., :60])  # head_dim % 8
        assert not cpu_decode.applies(torch.randn(2, 2, cpu_decode.MAX_GROUP + 1, 64), k, k)
        assert not cpu_decode.applies(q, k.transpose(2, 3).contiguous().transpose(2, 3), k)  # strided head dim
        assert cpu_decode.applies(q.transpose(0, 1).contiguous().transpose(0, 1), k, k)  # q: any strides
    assert not cpu_decode.applies(q, k, k)  # autograd on: no kernel (it records no graph)


def test_disabled_kernels_leave_decode_to_torch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", [None])
    with torch.inference_mode():
        assert not cpu_decode.applies(torch.randn(2, 2, 2, 64), torch.randn(2, 2, 10, 64), torch.randn(2, 2, 10, 64))
