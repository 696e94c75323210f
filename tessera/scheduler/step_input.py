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
from tessera.scheduler.kv_manager import KVManager
from tessera.messages.worker import (
    ForwardInput,
    StepOutput,
    MMPlacement,
    PoolingRows,
    PromptLogprobRows,
    RequestStateFill,
    SamplingRow,
)


def build_forward_input(batch: ScheduledBatch, model_cls: type[TesseraModel], config: ModelConfig,
                        kv: KVManager, pending: list[int] | None = None) -> ForwardInput:
    """The step's message. Takes the KV manager's pending slot writes and releases last, so a failure
    while building leaves them for the next step.

    pending (overlap scheduling, scheduler/overlap.py; a batch of decode rows only): per request, a placeholder
    for its last token, which the step in flight is still sampling: the row's input id (the worker reads the
    token on the device), and one more output token for its sampler, whose seed and min_new_tokens count them.

    A verify step (speculative decoding: the last token and k drafts, scheduler/speculative.py) goes to the
    worker as k + 1 decode rows of the same request, row i with i + 1 more tokens of KV: every backend writes a
    step's K/V before it attends, so each row sees exactly the tokens before it, and the step stays a decode
    step (the CPU decode stack, the CUDA graphs)."""
    # (scheduled request, its index in the batch, start, end): a verify step's rows, one per token.
    rows = [(s, b, start, start + 1) for b, s in enumerate(batch.reqs)
            for start in (range(s.start, s.end) if s.draft else (s.start,))]
    segments = [StepSegment(start, end if s.draft else s.end, len(s.req.origin_input_ids), s.req.mm_inputs)
                for s, _, start, end in rows]
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
    state_fills: list[RequestStateFill] = []
    pooling_rows: list[PoolingRows] = []
    flat = 0
    for r, (s, b, start, _) in enumerate(rows):
        req = s.req
        if s.draft:  # verify row start - s.start: the last real token, then the drafts
            i = start - s.start
            ids.append(req.fill_ids[-1] if i == 0 else s.draft[i - 1])
            locs.append(s.out_cache_loc[i:i + 1])
            flat += 1
            logits_rows.append(flat - 1)
            _add_sampling(sampling, grammars, req, model_cls, s.draft[:i])
            continue
        ids.extend(req.token_slice(s.start, s.end) if pending is None else (pending[b],))
        locs.append(s.out_cache_loc)
        prompt_len = len(req.origin_input_ids)
        if req.mm_inputs is not None and req.mm_inputs.items and s.start < prompt_len:
            for item in req.mm_inputs.items:
                item_row = 0  # rows of the item's embedding before this offset range
                for lo, hi in item.offsets:
                    a, e = max(lo, s.start), min(hi, s.end)
                    if a < e:
                        idx = item_index.setdefault(id(item), len(items))
                        if idx == len(items):
                            items.append(item)
                        placements.append(MMPlacement(idx, r, flat + a - s.start, item_row + a - lo,
                                                      item_row + e - lo))
                    item_row += hi - lo
            if s.end >= prompt_len:
                prompt_done.append(req.rid)
        if req.wants_input_logprobs and not req.input_logprobs_done:
            lo, hi = req.input_logprob_rows()
            lo, hi = max(lo, s.start), min(hi, s.end)
            if lo < hi:
                prompt_rows.append(PromptLogprobRows(b, flat + lo - s.start, lo + 1,
                                                     req.origin_input_ids[lo + 1:hi + 1],
                                                     req.sampling_params.top_logprobs_num,
                                                     req.prompt_logprob_ranks))
        if req.pooling is not None:
            pooling_rows.append(PoolingRows(r, flat, s.start, s.end - s.start, s.end >= prompt_len, req.pooling))
        flat += s.end - s.start
        if s.samples or pending is not None:  # a pending row reaches one past the tokens the host knows
            logits_rows.append(flat - 1)
            _add_sampling(sampling, grammars, req, model_cls, [] if pending is None else [-1])
        # A request's state comes from its media items (Whisper's one clip, Mllama's images), all of them at once.
        if req.state_slots is not None and not req.state_filled:
            state_fills.append(RequestStateFill(r, list(req.mm_inputs.items), req.state_slots))  # type: ignore[union-attr]
    writes, released = kv.take_pending()
    for s, *_ in rows:
        if s.req.state_slots is not None:
            s.req.state_filled = True
    return ForwardInput(
        rids=[s.req.rid for s, *_ in rows],
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=layout.positions,
        out_cache_loc=torch.cat(locs),
        req_pool_indices=[s.req.req_pool_idx for s, *_ in rows],  # type: ignore[misc]
        req_generations=[kv.req_pool.generation[s.req.req_pool_idx] for s, *_ in rows],  # type: ignore[index]
        seq_lens=[end if s.draft else s.end for s, _, _, end in rows],
        extend_lens=[1 if s.draft else s.end - s.start for s, *_ in rows],
        slot_writes=writes, logits_rows=logits_rows, sampling=sampling,
        mm_items=items, mm_placements=placements, bidirectional_spans=layout.bidirectional_spans,
        prompt_done=prompt_done, released=released, state_fills=state_fills, vocab_mask=fill_bitmask(grammars),
        stop_closers=stop_closers(grammars), prompt_logprob_rows=prompt_rows, pooling_rows=pooling_rows,
        placeholders=pending is not None,
    )


def take_prompt_logprobs(batch: ScheduledBatch, fi: ForwardInput, result: StepOutput) -> None:
    """Stores the step's prompt logprobs by prompt position; a request whose last asked row was in the
    step has them all."""
    for entry, values, tops, ranks in zip(fi.prompt_logprob_rows, result.prompt_logprobs,
                                          result.prompt_top_logprobs or [[]] * len(result.prompt_logprobs),
                                          result.prompt_ranks or [[]] * len(result.prompt_logprobs)):
        req = batch.reqs[entry.req].req
        at = entry.first_token - req.logprob_start_len
        req.input_logprobs[at:at + len(values)] = values
        req.input_ranks[at:at + len(ranks)] = ranks
        if tops:
            req.input_top_logprobs[at:at + len(tops)] = tops
    for s in batch.reqs:
        if s.req.wants_input_logprobs and s.end >= s.req.input_logprob_rows()[1]:
            s.req.input_logprobs_done = True


def _add_sampling(sampling: list[SamplingRow], grammars: list, req, model_cls: type[TesseraModel],
                  drafted: list[int]) -> None:
    """The sampling row of a request's next token; after `drafted` (a verify row), sampled as a decode step
    would sample it once those drafts were its output."""
    sp = req.sampling_params
    wants_prompt = sp.repetition_penalty != 1 or model_cls.process_logits_reads_prompt
    sampling.append(SamplingRow(sp, req.output_ids + drafted if drafted else req.output_ids,
                                req.origin_input_ids if wants_prompt else []))
    grammars.append(req.grammar.advanced(drafted) if req.grammar is not None and drafted else req.grammar)
