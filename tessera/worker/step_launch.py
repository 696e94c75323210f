"""A step's second half, launched without waiting for it: sampling, then the read-back of its tokens.

`ModelWorker.launch(fi)` queues the forward and the sampling (`OutputLauncher.launch`) and starts the copy of
the sampled ids (and logprobs) to the host (`Platform.start_read`: pinned memory and an event on CUDA);
`collect(handle)` waits for that copy and turns it into the StepOutput. `execute(fi)` is the two in a row. Between them the scheduler forms
and launches the next step (scheduler/overlap.py), whose decode rows take their input token from this step's
sampled ids on the device: `input_ids` < 0 name a row of the previous step's output (-1 - row), resolved by
`resolve_placeholders` before the forward. Steps that read anything on the host (prompt logprobs, pooled
embeddings) finish within launch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from tessera.messages.worker import ForwardInput, SamplingRow, StepOutput
from tessera.platform.device import HostRead, Platform
from tessera.worker.pooling import Pooler
from tessera.worker.prompt_logprobs import prompt_logprobs
from tessera.worker.sampler import Sampler, SamplingBatchInfo


@dataclass
class StepHandle:
    """A launched step: its StepOutput already (`output`), or its sampled rows on their way to the host."""

    output: StepOutput | None = None
    read: HostRead | None = None
    rows: list[SamplingRow] | None = None
    has_logprobs: bool = False
    has_top: bool = False

    def result(self) -> StepOutput:
        if self.output is not None:
            return self.output
        assert self.read is not None and self.rows is not None
        host = self.read.wait()
        out = StepOutput(host[0].tolist())
        if self.has_logprobs:
            out.logprobs = host[1].tolist()
        if self.has_top:
            ids, values = host[-2].tolist(), host[-1].tolist()
            out.top_logprobs = [list(zip(ids[i][:r.params.top_logprobs_num], values[i][:r.params.top_logprobs_num]))
                                for i, r in enumerate(self.rows)]
        self.output = out
        return out


def resolve_placeholders(input_ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """The step's input ids with each placeholder (< 0) replaced, on the device, by the previous step's sampled
    id of row -1 - id."""
    if previous is None:
        raise RuntimeError("a step names the previous step's tokens, but no sampled step came before it")
    rows = (-1 - input_ids).clamp(0, previous.shape[0] - 1)
    return torch.where(input_ids < 0, previous.index_select(0, rows), input_ids)


@dataclass
class OutputLauncher:
    """A model worker's step outputs: its sampler, its pooler of embedding requests, the model's EOS ids and
    logits rules, and the platform that reads results back."""

    sampler: Sampler
    pooler: Pooler
    eos_token_ids: Collection[int]
    device: torch.device
    process_logits: Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor]
    platform: Platform

    def launch(self, fi: ForwardInput, logits: torch.Tensor,
               pooled_hidden: torch.Tensor | None) -> tuple[StepHandle, torch.Tensor | None]:
        """Samples the step's rows from its logits and starts reading them back; returns the handle and the
        sampled ids on the device (the next step's placeholders read them). Prompt logprobs and pooled vectors
        are read here (such steps never overlap)."""
        prompt_lp, prompt_top, prompt_ranks = prompt_logprobs(logits[len(fi.logits_rows):], fi.prompt_logprob_rows) \
            if fi.prompt_logprob_rows else ([], [], [])
        embeddings = []
        if fi.pooling_rows:
            assert pooled_hidden is not None, "the model handed back no hidden states for pooling"
            embeddings = self.pooler.pool(pooled_hidden, fi.pooling_rows, fi.rids)
        if not fi.sampling:
            return StepHandle(StepOutput([], prompt_logprobs=prompt_lp, prompt_top_logprobs=prompt_top,
                                         prompt_ranks=prompt_ranks, embeddings=embeddings)), None
        logits = logits[:len(fi.logits_rows)]
        rows = fi.sampling
        info = SamplingBatchInfo.build([r.params for r in rows], logits.shape[-1], [r.output_ids for r in rows],
                                       [r.prompt_ids for r in rows], eos_token_ids=self.eos_token_ids,
                                       device=self.device, vocab_mask=fi.vocab_mask, stop_closers=fi.stop_closers)
        out = self.sampler(logits.float(), info, lambda scores: self.process_logits(scores, rows))
        parts = [out.next_token_ids]
        if out.logprobs is not None:
            parts.append(out.logprobs)
        has_top = out.top_logprob_ids is not None and out.top_logprob_values is not None
        if has_top:
            parts += [out.top_logprob_ids, out.top_logprob_values]
        handle = StepHandle(read=self.platform.start_read(parts), rows=rows, has_logprobs=out.logprobs is not None,
                            has_top=has_top)
        if prompt_lp or embeddings:  # a step with host reads of its own is finished here
            output = handle.result()
            output.prompt_logprobs, output.prompt_top_logprobs = prompt_lp, prompt_top
            output.prompt_ranks, output.embeddings = prompt_ranks, embeddings
        return handle, out.next_token_ids
