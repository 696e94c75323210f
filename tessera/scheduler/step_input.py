"""ScheduledBatch -> ForwardInput: the scheduler's half of the scheduler/worker seam.

Positions (and bidirectional spans) come from the model contract's prepare_step; the media placements
say which rows of which item's embedding fall inside each request's chunk.
"""

from __future__ import annotations

import torch

from tessera.constrained.matcher import fill_bitmask, stop_closers
from tessera.models.base import StepSegment, TesseraModel
from tessera.models.config import ModelConfig
from tessera.messages.items import MultimodalDataItem
from tessera.scheduler.batch import ScheduledBatch
from tessera.scheduler.policy import KVManager
from tessera.messages.worker import (
    ForwardInput,
    MMPlacement,
    PoolingRows,
    PromptLogprobRows,
    RequestStateFill,
    SamplingRow,
)


def build_forward_input(batch: ScheduledBatch, model_cls: type[TesseraModel], config: ModelConfig,
                        kv: KVManager) -> ForwardInput:
    """The step's message. Takes the KV manager's pending slot writes and releases last, so a failure
    while building leaves them for the next step."""
    segments = [StepSegment(s.start, s.end, len(s.req.origin_input_ids), s.req.mm_inputs) for s in batch.reqs]
    layout = model_cls.prepare_step(config, segments)
    ids: list[int] = []
    locs: list[torch.Tensor] = []
    logits_rows: list[int] = []
    sampling: list[SamplingRow] = []
    items: list[MultimodalDataItem] = []
    item_index: dict[int, int] = {}  # id(item) -> index in items
    placements: list[MMPlacement] = []
    prompt_done: list[str] = []
    grammars = []  # per SamplingRow: the request's GrammarMatcher or None
    prompt_rows: list[PromptLogprobRows] = []
    pooling_rows: list[PoolingRows] = []
    flat = 0
    for i, s in enumerate(batch.reqs):
        req = s.req
        ids.extend(req.token_slice(s.start, s.end))
        locs.append(s.out_cache_loc)
        prompt_len = len(req.origin_input_ids)
        if req.mm_inputs is not None and req.mm_inputs.items and s.start < prompt_len:
            for item in req.mm_inputs.items:
                item_row = 0  # rows of the item's embedding before this offset range
                for lo, hi in item.offsets:
                    a, b = max(lo, s.start), min(hi, s.end)
                    if a < b:
                        idx = item_index.setdefault(id(item), len(items))
                        if idx == len(items):
                            items.append(item)
                        placements.append(MMPlacement(idx, i, flat + a - s.start, item_row + a - lo,
                                                      item_row + b - lo))
                    item_row += hi - lo
            if s.end >= prompt_len:
                prompt_done.append(req.rid)
        if req.wants_input_logprobs and not req.input_logprobs_done:
            lo, hi = req.input_logprob_rows()
            lo, hi = max(lo, s.start), min(hi, s.end)
            if lo < hi:
                prompt_rows.append(PromptLogprobRows(i, flat + lo - s.start, lo + 1,
                                                     req.origin_input_ids[lo + 1:hi + 1],
                                                     req.sampling_params.top_logprobs_num,
                                                     req.prompt_logprob_ranks))
        if req.pooling is not None:
            pooling_rows.append(PoolingRows(i, flat, s.start, s.end - s.start, s.end >= prompt_len, req.pooling))
        flat += s.end - s.start
        if s.samples:
            logits_rows.append(flat - 1)
            sp = req.sampling_params
            wants_prompt = sp.repetition_penalty != 1 or model_cls.process_logits_reads_prompt
            sampling.append(SamplingRow(sp, req.output_ids, req.origin_input_ids if wants_prompt else []))
            grammars.append(req.grammar)
    # A request's state comes from its one media item (the frontend admits exactly one for such families).
    state_fills = [RequestStateFill(i, s.req.mm_inputs.items[0], s.req.state_slots)  # type: ignore[union-attr]
                   for i, s in enumerate(batch.reqs) if s.req.state_slots is not None and not s.req.state_filled]
    writes, released = kv.take_pending()
    for fill in state_fills:
        batch.reqs[fill.req].req.state_filled = True
    return ForwardInput(
        rids=[s.req.rid for s in batch.reqs],
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=layout.positions,
        out_cache_loc=torch.cat(locs),
        req_pool_indices=[s.req.req_pool_idx for s in batch.reqs],  # type: ignore[misc]
        req_generations=[kv.req_pool.generation[s.req.req_pool_idx] for s in batch.reqs],  # type: ignore[index]
        seq_lens=[s.end for s in batch.reqs],
        extend_lens=[s.end - s.start for s in batch.reqs],
        slot_writes=writes, logits_rows=logits_rows, sampling=sampling,
        mm_items=items, mm_placements=placements, bidirectional_spans=layout.bidirectional_spans,
        prompt_done=prompt_done, released=released, state_fills=state_fills, vocab_mask=fill_bitmask(grammars),
        stop_closers=stop_closers(grammars), prompt_logprob_rows=prompt_rows, pooling_rows=pooling_rows,
    )
