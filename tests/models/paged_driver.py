"""Test-only driver: a tiny paged KV allocator and ForwardBatch builder (the real ones live in the scheduler).

Slots are handed out page by page; with page_size > 1 pages are taken in descending order, so a request's
KV is never one contiguous run and two requests' pages interleave.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from tessera.cache.state_pool import StatePool
from tessera.layers.forward_batch import ForwardBatch
from tests.kernel_device import batch_to


class PagedKV:
    def __init__(self, lm_config, page_size: int = 1, num_pages: int = 256, max_reqs: int = 4,
                 max_context_len: int = 256, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.page_size = page_size
        self.device = torch.device(device)
        layout = lm_config.kv_layout
        self.pool = TokenToKVPool(
            num_pages * page_size, layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype, device
        )
        self.req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        if getattr(getattr(lm_config, "family", None), "linear_attention", False):  # a slot per request row
            from tessera.layers.hybrid_decoder import state_layout

            self.pool.state = StatePool(state_layout(lm_config.hf_config.get_text_config()), max_reqs, dtype, device)
        pages = list(range(num_pages))
        self.free_pages = pages if page_size == 1 else pages[::-1]
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        assert row is not None
        self.pages[row], self.lens[row] = [], 0
        return row

    def extend(self, row: int, num: int) -> torch.Tensor:
        """Allocates slots for the next `num` tokens of request `row`; returns them [num]."""
        slots = []
        for pos in range(self.lens[row], self.lens[row] + num):
            page_idx, offset = divmod(pos, self.page_size)
            if page_idx == len(self.pages[row]):
                self.pages[row].append(self.free_pages.pop(0))
            slot = 1 + self.pages[row][page_idx] * self.page_size + offset  # slot 0 is the dummy
            self.req_pool.req_to_token[row, pos] = slot
            slots.append(slot)
        self.lens[row] += num
        return torch.tensor(slots, dtype=torch.long)


@dataclass
class Step:
    """New tokens of one request in one forward."""

    row: int
    input_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [3, n] (M-RoPE) or [n]
    mm_rows: torch.Tensor | None = None  # local rows (0..n-1) that take embeddings
    mm_embeds: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    all_logits: bool = False  # logits for every new token instead of only the last


def make_batch(kv: PagedKV, steps: list[Step]) -> ForwardBatch:
    """Allocates KV for every step and builds the ForwardBatch (requests in list order)."""
    locs, rows, embeds, logits_idx = [], [], [], []
    seq_lens, ext_lens = [], []
    start = 0
    for s in steps:
        n = s.input_ids.shape[0]
        locs.append(kv.extend(s.row, n))
        seq_lens.append(kv.lens[s.row])
        ext_lens.append(n)
        if s.mm_rows is not None:
            rows.append(s.mm_rows + start)
            embeds.append(s.mm_embeds)
        logits_idx += list(range(start, start + n)) if s.all_logits else [start + n - 1]
        start += n
    has_masks = any(s.custom_mask is not None for s in steps)
    return batch_to(ForwardBatch(
        input_ids=torch.cat([s.input_ids for s in steps]),
        positions=torch.cat([s.positions for s in steps], dim=-1),
        out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor([s.row for s in steps]),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(ext_lens),
        req_to_token=kv.req_pool.req_to_token,
        logits_indices=torch.tensor(logits_idx),
        mm_embed_rows=torch.cat(rows) if rows else None,
        mm_embeds=torch.cat(embeds) if embeds else None,
        custom_masks=[s.custom_mask for s in steps] if has_masks else None,
    ), kv.device)


def share_prefix(kv: PagedKV, src_row: int, dst_row: int, num_tokens: int) -> None:
    """A prefix-cache hit: request `dst_row` (new, empty) takes the KV slots of `src_row`'s first `num_tokens`
    tokens, as whole pages (num_tokens % page_size == 0)."""
    assert num_tokens % kv.page_size == 0 and kv.lens[dst_row] == 0 and num_tokens <= kv.lens[src_row]
    kv.pages[dst_row] = list(kv.pages[src_row][: num_tokens // kv.page_size])
    kv.req_pool.req_to_token[dst_row, :num_tokens] = kv.req_pool.req_to_token[src_row, :num_tokens]
    kv.lens[dst_row] = num_tokens


def decode_step(kv: PagedKV, row: int, logits: torch.Tensor) -> Step:
    """Request `row`'s next token (the argmax of its last logits) at the 1-D position after its KV."""
    return Step(row, logits.argmax().reshape(1), torch.tensor([kv.lens[row]]))


def decode_greedy(model, kv: PagedKV, rows: list[int], logits, num_new: int,
                  step: Callable[[PagedKV, int, torch.Tensor], Step] = decode_step) -> list[list[int]]:
    """Greedy tokens of the requests `rows` from their last logits (one row of `logits` each), decoded
    together: one batched forward per token, each request's input built by `step(kv, row, logits)`."""
    tokens: list[list[int]] = [[] for _ in rows]
    with torch.inference_mode():
        for _ in range(num_new):
            for toks, lo in zip(tokens, logits):
                toks.append(int(lo.argmax()))
            logits = model(make_batch(kv, [step(kv, r, lo) for r, lo in zip(rows, logits)]), kv.pool)
    return tokens


def check_text_prefill_and_decode(hf, ours, ids: torch.Tensor, num_new: int,
                                  page_size: int = 4) -> tuple[torch.Tensor, list[int]]:
    """A text-only prompt `ids` [L]: our prefill logits equal HF's (fp32, 1e-4) and our greedy tokens, decoded
    over paged KV at 1-D positions, equal HF generate's. Returns (HF's prefill logits, its tokens)."""
    n = len(ids)
    device = next(ours.parameters()).device  # HF's model is on the same device
    with torch.inference_mode():
        ref = hf(input_ids=ids[None].to(device)).logits[0]
        want = hf.generate(input_ids=ids[None].to(device), attention_mask=torch.ones(1, n, dtype=torch.long, device=device),
                           max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None)[0, n:].tolist()
        kv = PagedKV(ours.lm_config, page_size=page_size, device=device)
        row = kv.new_request()
        logits = ours(make_batch(kv, [Step(row, ids, torch.arange(n), all_logits=True)]), kv.pool)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert decode_greedy(ours, kv, [row], logits[-1:], num_new) == [want]
    return ref, want
