"""Prompt (input) log-probabilities from the prefill logits, without a second pass.

The model turns into logits only the rows asked for (ForwardBatch.logits_indices): the sampled rows, then
the rows of requests that asked for prompt logprobs (ForwardInput.prompt_logprob_rows). Row p of a prompt
predicts token p + 1. The reported value is the model's log_softmax in float32, before penalties and
sampling settings (as vLLM's prompt_logprobs and SGLang's input_token_logprobs): it equals HF's
log_softmax(logits)[p, ids[p + 1]]. Entries that ask get each target's rank too (vLLM's prompt_logprobs report
it): the number of tokens at least as likely, the target included. That comparison over the vocabulary costs
about as much as the log_softmax itself (docs/benchmarks.md), so a step computes it only when an entry asks.
"""

from __future__ import annotations

import torch

from tessera.messages.worker import PromptLogprobRows

# Rows turned into float32 log-probabilities at a time: a 1,024-row slice of a 152k vocabulary is 0.6 GB.
ROWS_PER_SLICE = 1024


def extra_logits_rows(entries: list[PromptLogprobRows]) -> list[int]:
    """The flat rows the entries need logits of, in their order (appended after the sampled rows)."""
    return [r for e in entries for r in range(e.row, e.row + len(e.targets))]


def prompt_logprobs(logits: torch.Tensor, entries: list[PromptLogprobRows]
                    ) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]], list[list[int]]]:
    """Per entry: the targets' logprobs, when it asks (top > 0) each row's `top` most likely (token id,
    logprob) pairs, and the targets' ranks. `logits` holds the entries' rows in extra_logits_rows order."""
    targets = torch.tensor([t for e in entries for t in e.targets], dtype=torch.int64, device=logits.device)
    k = min(max(e.top for e in entries), logits.shape[-1])
    want_ranks = any(e.ranks for e in entries)
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, targets.shape[0], ROWS_PER_SLICE):
        lp = torch.log_softmax(logits[lo:lo + ROWS_PER_SLICE].float(), dim=-1)
        value = lp.gather(1, targets[lo:lo + ROWS_PER_SLICE, None])
        chosen.append(value.squeeze(1))
        if want_ranks:
            ranks.append((lp >= value).sum(dim=1, dtype=torch.int32))
        if k:
            v, i = lp.topk(k, dim=-1, sorted=True)
            top_vals.append(v)
            top_ids.append(i)
    values, rank_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist() if want_ranks else []
    vals = torch.cat(top_vals).tolist() if k else []
    ids = torch.cat(top_ids).tolist() if k else []
    out_lp, out_top, out_rank = [], [], []
    at = 0
    for e in entries:
        n = len(e.targets)
        out_lp.append(values[at:at + n])
        out_rank.append(rank_list[at:at + n] if e.ranks else [])
        out_top.append([list(zip(ids[r][:e.top], vals[r][:e.top])) for r in range(at, at + n)] if e.top else [])
        at += n
    return out_lp, out_top, out_rank
