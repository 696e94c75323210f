"""Decode attention through our C kernel over the paged pool (tessera/platform/csrc/cpu_decode_attention.c) against a
float64 reference: block and vector tails, query groups, sliding windows, scattered slots, one and two threads;
and the backend taking it on random traffic."""

from __future__ import annotations

import shutil

import pytest
import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.platform import cpu_kernels
from tessera.layers.attention import cpu_decode
from tests.platform.test_cpu_kernels import torch_threads
from tests.layers.test_decode_mirror import Sim, random_traffic

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernel is never built, decode keeps torch's path")


def reference(q, pool, layer, slots, lens, scaling, window=None):
    """q [B, Hkv, G, D]; float64 softmax over each request's keys read from the pool."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        hi = int(lens[b])
        lo = max(0, hi - window) if window else 0
        rows = slots[b, lo:hi]
        kb = pool.k_buffers[layer][rows].double().transpose(0, 1)  # [Hkv, n, D]
        vb = pool.v_buffers[layer][rows].double().transpose(0, 1)
        scores = torch.einsum("hgd,hnd->hgn", q[b].double(), kb) * scaling
        out[b] = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), vb).float()
    return out


def run(q, pool, layer, slots, lens, scaling, window, threads):
    with torch_threads(threads), torch.inference_mode():
        assert cpu_decode.reads_pool(q.reshape(q.shape[0], -1, q.shape[-1]), pool)
        return cpu_decode.paged_decode_attention(q, pool, layer, slots, lens, scaling, window)


def make_pool(kv_heads, head_dim, lens, g, layers=2):
    """A pool with random contents and each request's keys in random (scattered) slots; slots [B, max+3]."""
    pool = TokenToKVPool(sum(lens) + 50, layers, kv_heads, head_dim)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_(generator=g)
    perm = torch.randperm(pool.size, generator=g) + 1
    slots = torch.zeros(len(lens), max(lens) + 3, dtype=torch.int64)  # + 3: padding the kernel never reads
    taken = 0
    for b, n in enumerate(lens):
        slots[b, :n] = perm[taken:taken + n]
        taken += n
    return pool, slots


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("batch_heads", "lens", "window"), [
    ((2, 2, 64), [1, 3, 64, 65, 130, 257], None),  # key tails of 1-3, a whole block, a block and one
    ((1, 7, 8), [5, 9, 70], None),  # an odd group, the smallest head
    ((4, 1, 128), [100, 33], None),  # no grouping (MHA), accumulators past the 32-lane chunks
    ((2, 4, 40), [200, 6, 90], 64),  # head_dim with an 8-lane tail; a sliding window shorter and longer than lens
    ((3, 2, 16), [300, 2], 5),
    ((8, 4, 32), [40] * 12, None),  # many requests per thread: several KV heads share a task (4 x 4 rows)
    ((2, 16, 8), [7, 90, 3, 11, 50, 8, 9, 70, 33], None),  # the largest group: one head per task
], ids=["blocks", "odd-group", "mha", "window", "short-window", "heads-per-task", "group-16"])
def test_kernel_matches_the_reference(threads, batch_heads, lens, window):
    kv_heads, group, head_dim = batch_heads
    g = torch.Generator().manual_seed(sum(lens) + head_dim)
    pool, slots = make_pool(kv_heads, head_dim, lens, g)
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=g)
    lens_t = torch.tensor(lens)
    for layer in (0, 1):
        got = run(q, pool, layer, slots, lens_t, 0.125, window, threads)
        torch.testing.assert_close(got, reference(q, pool, layer, slots, lens_t, 0.125, window), rtol=1e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_running_max_rises_across_blocks(threads):
    """Scores that grow block after block (and span ~100 nats) make every block rescale what came before;
    the exponential's range limits must not turn large negative gaps into garbage."""
    n, head_dim = 300, 16
    pool = TokenToKVPool(n, 1, 1, head_dim)
    slots = torch.arange(n, 0, -1)[None, :]  # keys in reverse slot order
    pool.k_buffers[0][slots[0]] = torch.linspace(-6.0, 6.0, n)[:, None, None].repeat(1, 1, head_dim)
    pool.v_buffers[0].normal_(generator=torch.Generator().manual_seed(0))
    q = torch.ones(1, 1, 2, head_dim)
    q[0, 0, 1] = -1.0  # the second query row sees the scores falling instead
    lens = torch.tensor([n])
    got = run(q, pool, 0, slots, lens, 1.0, None, threads)
    torch.testing.assert_close(got, reference(q, pool, 0, slots, lens, 1.0), rtol=1e-5, atol=1e-6)


def test_reads_pool_only_for_float32_cpu_inference_with_shapes_the_kernel_handles():
    pool = TokenToKVPool(16, 1, 2, 64)
    q = torch.randn(3, 4, 64)
    with torch.inference_mode():
        assert cpu_decode.reads_pool(q, pool)
        assert not cpu_decode.reads_pool(q.bfloat16(), pool)
        assert not cpu_decode.reads_pool(q, TokenToKVPool(16, 1, 2, 64, dtype=torch.bfloat16))
        assert not cpu_decode.reads_pool(torch.randn(3, 4, 60), TokenToKVPool(16, 1, 2, 60))  # head_dim % 8
        assert not cpu_decode.reads_pool(torch.randn(3, 2 * (cpu_decode.MAX_GROUP + 1), 64), pool)
    assert not cpu_decode.reads_pool(q, pool)  # autograd on: no kernel (it records no graph)


def test_disabled_kernels_leave_decode_to_torch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_functions", {})  # loaded, but this kernel did not build
    monkeypatch.setattr(cpu_kernels, "_loaded", True)
    with torch.inference_mode():
        assert not cpu_decode.reads_pool(torch.randn(3, 4, 64), TokenToKVPool(16, 1, 2, 64))


def test_backend_reads_the_pool_in_place_on_random_traffic():
    """The mirror tests' traffic (joins, mixed prefill, shuffled batches, leaves, steps without generations),
    every step's attention against the reference; the mirror is never planned or filled."""
    sim = Sim(seed=1)
    plans = random_traffic(sim)
    assert plans == [] and sim.backend._mirror.k == []
