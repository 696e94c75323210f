"""TorchNativeAttentionBackend against a naive per-request reference over the same paged pool."""

from __future__ import annotations

import pytest
import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import cpu_decode, get_attention_backend, packed_extend
from tessera.layers.forward_batch import ForwardBatch

HEAD_DIM, POOL_SIZE, MAX_CTX = 8, 200, 32


def reference(q, k_buf, v_buf, fb: ForwardBatch, scaling: float) -> torch.Tensor:
    out = []
    group = q.shape[1] // k_buf.shape[1]
    for i in range(fb.batch_size):
        s, n = int(fb.extend_start_loc[i]), int(fb.extend_lens[i])
        seq, prefix = int(fb.seq_lens[i]), int(fb.prefix_lens[i])
        slots = fb.req_to_token[fb.req_pool_indices[i], :seq]
        k = k_buf[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_buf[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[s:s + n], k) * scaling
        mask = fb.custom_masks[i] if fb.custom_masks and fb.custom_masks[i] is not None else (
            torch.arange(seq)[None, :] <= torch.arange(prefix, seq)[:, None])
        scores = scores.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, -1))
    return torch.cat(out)


def make_case(seq_lens, extend_lens, num_kv_heads, masks=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = TokenToKVPool(POOL_SIZE, 1, num_kv_heads, HEAD_DIM)
    pool.k_buffers[0].normal_(generator=g)  # stale content everywhere: reading a wrong slot must show
    pool.v_buffers[0].normal_(generator=g)
    # Random distinct slots per request; the tail of each row holds stale (valid) slot ids.
    req_to_token = torch.randint(1, POOL_SIZE + 1, (8, MAX_CTX), generator=g)
    perm = torch.randperm(POOL_SIZE, generator=g) + 1
    rows = [5, 1, 7, 2, 0, 3][: len(seq_lens)]
    taken = 0
    for row, seq in zip(rows, seq_lens):
        req_to_token[row, :seq] = perm[taken:taken + seq]
        taken += seq
    seq_t, ext_t = torch.tensor(seq_lens), torch.tensor(extend_lens)
    locs = torch.cat([req_to_token[r, s - e:s] for r, s, e in zip(rows, seq_lens, extend_lens)])
    fb = ForwardBatch(input_ids=torch.zeros(int(ext_t.sum()), dtype=torch.long), positions=torch.zeros(3, len(locs)),
                      out_cache_loc=locs, req_pool_indices=torch.tensor(rows), seq_lens=seq_t, extend_lens=ext_t,
                      req_to_token=req_to_token, custom_masks=masks)
    return pool, fb, g


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Float32 decode on a CPU runs our C kernel over the pool (cpu_decode) where it is built; "torch" forces
    the fallback: torch's matmuls from MATMUL_DECODE_MIN_BATCH decode requests on, SDPA below."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_decode, "reads_pool", lambda *a: False)
    return request.param


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("layout", ["mixed", "decode_ragged", "decode_equal", "prefill_only", "decode_batch_ragged",
                                    "decode_batch_equal", "packed", "packed_beside_masks"])
def test_matches_reference(heads, layout, decode_path):
    num_heads, num_kv_heads = heads
    seq_lens, ext_lens, masks = {
        "mixed": ([5, 9, 7, 5, 6], [5, 1, 3, 3, 1], "masks"),
        "decode_ragged": ([3, 12, 7], [1, 1, 1], None),
        "decode_equal": ([6, 6], [1, 1], None),
        "prefill_only": ([4, 6], [4, 6], None),
        # From MATMUL_DECODE_MIN_BATCH decode requests on, torch's path is matmuls, not SDPA.
        "decode_batch_ragged": ([3, 12, 7, 20, 9, 15], [1] * 6, None),
        "decode_batch_equal": ([8] * 5, [1] * 5, None),
        # From PACK_MIN_REQUESTS causal extends on, they share one padded call (packed_extend.py).
        "packed": ([5, 9, 7, 5, 6, 4], [5, 3, 2, 4, 1, 4], None),
        "packed_beside_masks": ([5, 9, 7, 5, 6, 8], [5, 3, 2, 3, 1, 2], "masks"),
    }[layout]
    if masks and layout == "packed_beside_masks":
        m3 = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
        masks = [None, None, None, m3, None, None]
    elif masks:
        g = torch.Generator().manual_seed(3)
        m3 = torch.rand(3, 5, generator=g) > 0.5
        m3[torch.arange(3), torch.arange(2, 5)] = True  # every query sees itself
        m1 = torch.ones(1, 6, dtype=torch.bool)
        m1[0, 1] = False
        masks = [None, None, None, m3, m1]
    pool, fb, g = make_case(seq_lens, ext_lens, num_kv_heads, masks)
    t = fb.out_cache_loc.shape[0]
    q = torch.randn(t, num_heads, HEAD_DIM, generator=g)
    k = torch.randn(t, num_kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(t, num_kv_heads, HEAD_DIM, generator=g)
    backend = get_attention_backend("torch_native")
    with torch.inference_mode():  # as the model runs: our C kernels take no autograd inputs
        out = backend.forward(q, k, v, 0, fb, pool, 0.3)  # no init_forward_metadata: must build it itself
    assert torch.equal(pool.k_buffers[0][fb.out_cache_loc], k) and torch.equal(pool.v_buffers[0][fb.out_cache_loc], v)
    torch.testing.assert_close(out, reference(q, pool.k_buffers[0], pool.v_buffers[0], fb, 0.3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_packed_extends_match_one_call_each(window, pool_dtype, monkeypatch):
    """The packed call gives what one SDPA call per request gives, sliding window included; a pool in another
    dtype than the queries (a prefix-free request's own call reads its fresh K/V) runs one call each."""
    outs = []
    for packed in (True, False):
        monkeypatch.setattr(packed_extend, "PACK_MIN_REQUESTS", 4 if packed else 99)
        pool, fb, g = make_case([5, 9, 7, 5, 6, 4], [5, 3, 2, 4, 1, 4], 2)
        pool.k_buffers[0], pool.v_buffers[0] = pool.k_buffers[0].to(pool_dtype), pool.v_buffers[0].to(pool_dtype)
        pool.dtype = pool_dtype
        t = fb.out_cache_loc.shape[0]
        q, k, v = (torch.randn(t, n, HEAD_DIM, generator=g) for n in (4, 2, 2))
        with torch.inference_mode():
            outs.append(get_attention_backend("torch_native").forward(q, k, v, 0, fb, pool, 0.3, window))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)


def test_metadata_is_rebuilt_for_a_new_batch():
    backend = get_attention_backend("torch_native")
    for seq_lens in ([4, 9], [11, 2, 5]):
        pool, fb, g = make_case(seq_lens, [1] * len(seq_lens), 2)
        backend.init_forward_metadata(fb)
        q = torch.randn(len(seq_lens), 4, HEAD_DIM, generator=g)
        kv = torch.randn(len(seq_lens), 2, HEAD_DIM, generator=g)
        out = backend.forward(q, kv, kv, 0, fb, pool, 1.0)
        torch.testing.assert_close(out, reference(q, pool.k_buffers[0], pool.v_buffers[0], fb, 1.0), atol=1e-5, rtol=0)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="torch_native"):
        get_attention_backend("flashinfer-nope")
