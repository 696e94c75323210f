"""TokenToKVPool: writes land at their slots, gathers return exactly the indexed rows in the asked shape."""

from __future__ import annotations

import torch

from tessera.cache.kv_pool import TokenToKVPool


def test_set_and_gather_match_plain_indexing() -> None:
    pool = TokenToKVPool(64, num_layers=2, num_kv_heads=2, head_dim=4)
    gen = torch.Generator().manual_seed(0)
    loc = torch.randperm(64, generator=gen)[:20] + 1
    k, v = torch.randn(20, 2, 4, generator=gen), torch.randn(20, 2, 4, generator=gen)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k_buffers[1][loc], k) and torch.equal(pool.v_buffers[1][loc], v)
    assert pool.k_buffers[0].abs().sum() == 0  # other layers untouched
    slots = loc[:12].view(3, 4)
    gk, gv = pool.gather(1, slots)
    assert gk.shape == (3, 4, 2, 4) and torch.equal(gk, pool.k_buffers[1][slots])
    assert torch.equal(gv, pool.v_buffers[1][slots])
    half_k, _ = pool.gather(1, slots, torch.float16)
    assert half_k.dtype == torch.float16


def test_gather_reuses_its_scratch_and_grows_it() -> None:
    pool = TokenToKVPool(4096, num_layers=1, num_kv_heads=1, head_dim=2)
    pool.k_buffers[0].copy_(torch.arange(4097.0)[:, None, None].expand(-1, 1, 2))
    first, _ = pool.gather(0, torch.tensor([5, 6]))
    assert first[:, 0, 0].tolist() == [5.0, 6.0]
    second, _ = pool.gather(0, torch.tensor([7, 8]))
    # the documented contract: a gather's result lives until the next gather
    assert first.data_ptr() == second.data_ptr() and first[:, 0, 0].tolist() == [7.0, 8.0]
    big, _ = pool.gather(0, torch.arange(1, 3001))
    assert big.shape == (3000, 1, 2) and big[-1, 0, 0].item() == 3000.0
