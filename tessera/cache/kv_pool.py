"""KV storage: per-layer key/value buffers indexed by token slot, and how many slots a server's pool gets.

Slot 0 is reserved as a dummy (padding writes land there), so valid slots are 1..size.
Which slots are free is the allocator's business (cache/allocator.py); this class only stores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tessera.cache.state_pool import LinearStateLayout, StatePool, build_state_pool, split_budget, verify_slot_count
from tessera.config import ServerArgs

logger = logging.getLogger("tessera.cache")

# A CPU pool's default (no --max-total-tokens): what the running requests can use at most
# (max_running_requests x context_length), capped at the bytes of the weights, so KV never more than doubles the
# model's footprint; but never under one full-length request nor CPU_KV_MIN_TOKENS (a tiny model's weights would
# leave almost no pool).
CPU_KV_MIN_TOKENS = 16384


def kv_pool_tokens(args: ServerArgs, bytes_per_token: int, cuda_mem_info: tuple[int, int] | None,
                   weight_bytes: int = 0, context_length: int = 0) -> int:
    """KV pool size in tokens, whole pages: --max-total-tokens when given; on CUDA (cuda_mem_info = free,
    total bytes, read after the weights are loaded) what --mem-fraction-static of the device leaves after
    everything already in use; on CPU, sized from the model and the requests (see CPU_KV_MIN_TOKENS)."""
    page = args.page_size
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    elif cuda_mem_info is not None:
        free, total = cuda_mem_info
        budget = total * args.mem_fraction_static - (total - free)
        tokens = int(budget // bytes_per_token)
        if tokens < 2 * page:
            raise ValueError(f"mem_fraction_static: {args.mem_fraction_static} of {total / 2**30:.1f} GiB leaves no "
                             f"room for the KV pool after the weights ({(total - free) / 2**30:.1f} GiB in use)")
    else:
        needed = args.max_running_requests * context_length
        tokens = min(needed, max(weight_bytes // bytes_per_token, context_length, CPU_KV_MIN_TOKENS))
        tokens = max(tokens, 2 * page)
    return tokens // page * page


def size_pools(args: ServerArgs, bytes_per_token: int, memory_info: Callable[[], tuple[int, int] | None],
               weight_bytes: int, context_length: int, state: tuple[LinearStateLayout, torch.dtype, str | torch.device]
               | None = None) -> tuple[int, StatePool | None]:
    """The KV pool's size in tokens and, for a hybrid model (`state`: its layout, dtype, device), its state pool,
    from one memory budget: what kv_pool_tokens would give the KV alone, split by split_budget (the request rows'
    slots always, prefix-cache snapshots with what the ratio leaves, none without the radix cache; speculative
    decoding's verify slots on top). On CUDA the state pool is allocated first and the KV pool gets what the
    device has left."""
    tokens = kv_pool_tokens(args, bytes_per_token, memory_info(), weight_bytes, context_length)
    if state is None:
        return tokens, None
    layout, dtype, device = state
    rows, fixed = args.max_running_requests + 2, args.max_total_tokens is not None
    snapshots = 0 if args.disable_radix_cache else split_budget(tokens * bytes_per_token,
                                                                layout.bytes_per_request(dtype), rows, fixed)
    pool = build_state_pool(layout, rows, snapshots, dtype, device, verify_slot_count(args))
    assert pool is not None
    if not snapshots and not args.disable_radix_cache:
        logger.warning("linear-attention state pool: no room for prefix-cache snapshots after the %d request rows, "
                       "so the prefix cache never hits; give the pools more memory (--max-total-tokens, "
                       "--mem-fraction-static) or lower --max-running-requests", rows)
    if fixed:
        return tokens, pool
    mem = memory_info()
    if mem is not None:
        return kv_pool_tokens(args, bytes_per_token, mem, weight_bytes, context_length), pool
    # Host memory: the states take their share of the notional budget, never below one full-length request.
    left = max(tokens - pool.nbytes // bytes_per_token, min(tokens, context_length), 2 * args.page_size)
    return left // args.page_size * args.page_size, pool


class TokenToKVPool:
    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.size = size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._scratch: torch.Tensor | None = None  # [2, n, num_kv_heads, head_dim], see gather
        # Hybrid linear-attention models: each request's conv and recurrent state (cache/state_pool.py).
        self.state: StatePool | None = None

    # Row copies go through index_copy_ / index_select, not `buf[loc] = x` / `buf[slots]`: on CPU the
    # advanced-indexing kernels were ~17x slower for these row gathers (1.7 vs 0.1 ms for 32 x 257 rows).
    # Gathers land in a scratch buffer reused across layers and steps: a fresh multi-MB tensor per gather
    # costs page faults on every call (2x the copy itself, measured at batch 32 x 257 tokens).
    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for slots loc [T] (int64)."""
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S, int64): each [*S, num_kv_heads, head_dim], in `dtype`.

        The result is a view of scratch memory that the next gather overwrites: use it before gathering again.
        """
        flat = slots.reshape(-1)
        n = flat.numel()
        if self._scratch is None or self._scratch.shape[1] < n:
            self._scratch = torch.empty((2, max(n, 1024), self.num_kv_heads, self.head_dim), dtype=self.dtype,
                                        device=self.device)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        k = torch.index_select(self.k_buffers[layer], 0, flat, out=self._scratch[0, :n]).view(shape)
        v = torch.index_select(self.v_buffers[layer], 0, flat, out=self._scratch[1, :n]).view(shape)
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_buffers[0].element_size()


class ReqToTokenPool:
    """Request slot table: row r lists the KV slot of each token position of the request in row r."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)
        self.free_rows = list(range(max_reqs))
        self.max_context_len = max_context_len
        # Bumped on every alloc, so (row, generation) names one tenancy of a row: per-request state kept
        # elsewhere (the decode K/V mirror) can tell a new request in a reused row from the old one.
        self.generation = [0] * max_reqs

    def alloc(self) -> int | None:
        if not self.free_rows:
            return None
        row = self.free_rows.pop()
        self.generation[row] += 1
        return row

    def free(self, row: int) -> None:
        assert row not in self.free_rows, f"double free of req row {row}"
        self.free_rows.append(row)

    @property
    def num_free(self) -> int:
        return len(self.free_rows)
