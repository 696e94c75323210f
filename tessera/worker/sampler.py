"""Sampler: one next token per row of a [B, V] logits batch, vectorised over the batch.

One step, all on [B, V] float32 tensors with no per-row Python loop (seeded rows excepted):
  1. penalties on the raw logits, in vLLM's order: repetition (HF/CTRL: a positive logit of a token
     seen in prompt+output is divided by the penalty, a negative one multiplied), then
     frequency/presence (OpenAI: logit -= freq * count + presence * (count > 0), over generated
     tokens only), then logit_bias (added as given), then the min_new_tokens ban (-inf on EOS and stop ids);
     then the model's own rules (if any), then the grammar mask of constrained rows (-inf on every token the
     row's grammar does not allow; one op for the batch).
  2. logprobs = log_softmax(penalised logits), before the grammar mask.
  3. greedy rows: argmax of the penalised (and masked) logits (exactly; temperature and filters never touch them).
  4. other rows: softmax(logits / temperature); top-k, top-p and min-p become one per-row probability
     threshold found by sorting; then an exponential race, argmax(p / E) with E ~ Exp(1), which
     draws a token with probability proportional to p (the Gumbel-max trick, without the logs).

Reported logprobs are those of step 2: after penalties, BEFORE temperature, top-k, top-p, min-p and the
grammar mask.
That is what the model (with the request's penalties) predicts, so logprobs do not change when a
client changes its sampling knobs, and a sampled token never reports a truncation artefact. Peers
differ here (vLLM's default reports raw logprobs, before penalties; SGLang's default reports the
post-temperature, top-p-renormalised distribution); this is the choice the Tessera API documents.

Random streams: unseeded rows share one generator (the Sampler's, or torch's default). A seeded
row gets its own torch.Generator, seeded with mix_seed(seed, step) where step is the number of
tokens that request has generated so far, so its token depends only on (seed, step, its own logits)
and not on which other requests share the batch or on how the scheduler interleaves steps.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from tessera.messages.sampling import SamplingParams
from tessera.platform.device import to_device_packed


@dataclass
class SamplingBatchInfo:
    """Per-step sampling state of a batch of B requests over a vocabulary of V tokens.

    Built once per step by `build`; the Sampler only reads it. Optional [B, V] tensors are None
    when no row of the batch needs them, so plain sampling allocates nothing of size V here.
    """

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows (they never divide by it)
    top_ps: torch.Tensor  # [B] float32; 1.0 = off
    top_ks: torch.Tensor  # [B] int64; vocab_size = off
    min_ps: torch.Tensor  # [B] float32; 0.0 = off
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    # Counts of each token among the generated tokens; rows without frequency/presence penalty are 0.
    output_token_counts: torch.Tensor | None  # [B, V] float32
    # Tokens seen in prompt + output; rows without repetition penalty are all False.
    seen_token_mask: torch.Tensor | None  # [B, V] bool
    # EOS and stop ids of rows that have not yet reached min_new_tokens.
    banned_token_mask: torch.Tensor | None  # [B, V] bool
    # logit_bias of each row (0 elsewhere); None when no row of the batch has one.
    logit_bias: torch.Tensor | None  # [B, V] float32
    # Grammar bitmask (tessera/constrained): bit t % 32 of word t // 32 of row i allows token t; unconstrained
    # rows are all ones. None when no row of the batch is constrained.
    vocab_mask: torch.Tensor | None  # [B, ceil(V / 32)] int32
    # JSON rows: the tokens that close a string, array, object, then ',' (in that order of preference), -1 padded; with
    # the EOS ids, for close_on_stop_intent. None when no row has them.
    stop_closers: torch.Tensor | None  # [B, K] int64
    eos_ids: torch.Tensor | None  # [E] int64
    # (row, generator seed) for every non-greedy row whose request has a seed.
    seeded_rows: list[tuple[int, int]]
    top_logprobs_nums: list[int]  # [B]; 0 = none for that row
    # Host-side flags, so the Sampler skips whole stages without a device sync.
    is_all_greedy: bool
    has_greedy: bool
    need_filter: bool  # some row uses top-k, top-p or min-p
    return_logprob: bool  # some row asked for logprobs or top logprobs

    @property
    def batch_size(self) -> int:
        return len(self.top_logprobs_nums)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        eos_token_ids: Collection[int] = (),
        device: torch.device | str = "cpu",
        vocab_mask: torch.Tensor | None = None,
        stop_closers: torch.Tensor | None = None,
    ) -> SamplingBatchInfo:
        """Build the step's state from the B requests' verified SamplingParams.

        params[i]: row i's params (normalized and verified).
        vocab_size: V, the width of the logits the Sampler will get.
        output_ids[i]: tokens row i has generated so far; len(output_ids[i]) is also the step
            index that seeds a seeded row and that min_new_tokens is compared with.
        prompt_ids[i]: row i's prompt ids; read only when its repetition_penalty != 1. Ids outside
            [0, V) (multimodal placeholder pad values) are ignored.
        eos_token_ids: the model's EOS ids; banned (with stop_token_ids) while a row is below
            min_new_tokens, unless its ignore_eos is set (then EOS does not finish it anyway).
        device: where the tensors live (the logits' device).
        vocab_mask: the step's grammar bitmask (host, int32 [B, ceil(V / 32)]) or None. A constrained row
            gets no min_new_tokens ban: its grammar decides when EOS may come.
        stop_closers: [B, K] closing-token ids per row (-1 = none), see close_on_stop_intent; needs vocab_mask.

        Cost: the [B, V] tensors are rebuilt from the id lists every step for the rows that use
        penalties (O(tokens) host work); an incremental per-request penalizer state is a later step.
        """
        batch_size = len(params)
        assert len(output_ids) == batch_size and len(prompt_ids) == batch_size, "one id list per row"
        num_generated = [len(ids) for ids in output_ids]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        is_greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        # Every row's knobs, made on the host and moved together (one copy on CUDA, see to_device_packed).
        knobs = torch.tensor([[1.0 if g else p.temperature for p, g in zip(params, is_greedy)],
                              [p.top_p for p in params], [p.min_p for p in params],
                              [p.frequency_penalty for p in params], [p.presence_penalty for p in params],
                              [p.repetition_penalty for p in params]], dtype=torch.float32)
        knobs, top_ks_t, is_greedy_t = to_device_packed(
            [knobs, torch.tensor(top_ks, dtype=torch.int64), torch.tensor(is_greedy, dtype=torch.bool)], device)
        temperatures, top_ps, min_ps, frequency_penalties, presence_penalties, repetition_penalties = knobs
        freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
        ban_rows: list[tuple[int, list[int]]] = []
        for i, p in enumerate(params):
            if num_generated[i] < p.min_new_tokens and p.constraint is None:
                stop_ids = p.stop_ids(eos_token_ids)
                if stop_ids:
                    ban_rows.append((i, sorted(stop_ids)))

        output_token_counts = None
        if freq_rows:
            output_token_counts = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device)
            rows, ids = _flatten_rows({i: output_ids[i] for i in freq_rows}, vocab_size, device)
            output_token_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        seen_token_mask = None
        if rep_rows:
            seen_token_mask = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)
            seen = {i: [*prompt_ids[i], *output_ids[i]] for i in rep_rows}
            seen_token_mask[_flatten_rows(seen, vocab_size, device)] = True
        banned_token_mask = None
        if ban_rows:
            banned_token_mask = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)
            banned_token_mask[_flatten_rows(dict(ban_rows), vocab_size, device)] = True

        logit_bias = None
        bias_rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if bias_rows:
            logit_bias = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device)
            for i, bias in bias_rows:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
                logit_bias[i, ids] = floats([float(v) for v in bias.values()])

        return cls(
            vocab_size=vocab_size,
            temperatures=temperatures.view(-1, 1),
            top_ps=top_ps,
            top_ks=top_ks_t,
            min_ps=min_ps,
            frequency_penalties=frequency_penalties,
            presence_penalties=presence_penalties,
            repetition_penalties=repetition_penalties,
            is_greedy=is_greedy_t,
            output_token_counts=output_token_counts,
            seen_token_mask=seen_token_mask,
            banned_token_mask=banned_token_mask,
            logit_bias=logit_bias,
            vocab_mask=None if vocab_mask is None else vocab_mask.to(device, non_blocking=True),
            stop_closers=None if stop_closers is None or vocab_mask is None else stop_closers.to(device),
            eos_ids=torch.tensor(sorted(eos_token_ids), dtype=torch.int64, device=device)
            if stop_closers is not None and eos_token_ids else None,
            seeded_rows=[
                (i, mix_seed(p.seed, num_generated[i]))
                for i, p in enumerate(params)
                if p.seed is not None and not is_greedy[i]
            ],
            top_logprobs_nums=[p.top_logprobs_num for p in params],
            is_all_greedy=all(is_greedy),
            has_greedy=any(is_greedy),
            need_filter=any(
                not g and (k < vocab_size or p.top_p < 1 or p.min_p > 0)
                for p, g, k in zip(params, is_greedy, top_ks)
            ),
            return_logprob=any(p.logprobs or p.top_logprobs_num > 0 for p in params),
        )


@dataclass
class SamplerOutput:
    """The Sampler's result for a batch of B rows.

    logprobs are of the penalised distribution before temperature/top-k/top-p/min-p (see module
    docstring). The top-logprob tensors have K columns, K = the largest top_logprobs_num in the batch,
    sorted descending; row i keeps its first top_logprobs_nums[i] columns.
    """

    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of next_token_ids; None if no row asked
    top_logprob_ids: torch.Tensor | None = None  # [B, K] int64; None if K == 0
    top_logprob_values: torch.Tensor | None = None  # [B, K] float32; None if K == 0


class Sampler:
    """Turns a [B, V] logits batch into next tokens (and logprobs) under a SamplingBatchInfo.

    `seed` seeds the generator shared by unseeded rows (for reproducible tests and benchmarks);
    None uses torch's default generator. The input logits are never modified.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo,
                 logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        return self.sample(logits, info, logits_processor)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """logits_processor: the model's own rules (TesseraModel.process_logits), applied after the penalties,
        as HF applies a model's processors after its generic ones; logprobs are reported after it, but before
        the grammar mask: they are what the model predicts, so scoring a forced continuation (tessera.lang's
        select) reads real probabilities rather than the mask's 0s."""
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        assert logits.shape == (info.batch_size, info.vocab_size), (
            f"logits {tuple(logits.shape)} do not match the batch info ({info.batch_size}, {info.vocab_size})"
        )
        logits = apply_penalties(logits.float(), info)
        if logits_processor is not None:
            logits = logits_processor(logits)
        scored = logits
        logits = apply_grammar_mask(logits, info)

        if info.is_all_greedy:
            next_token_ids = logits.argmax(dim=-1)
        else:
            next_token_ids = self._sample_non_greedy(logits, info)
            if info.has_greedy:
                next_token_ids = torch.where(info.is_greedy, logits.argmax(dim=-1), next_token_ids)

        output = SamplerOutput(next_token_ids=next_token_ids)
        if info.return_logprob:
            logprobs = torch.log_softmax(scored, dim=-1)
            output.logprobs = logprobs.gather(1, next_token_ids.unsqueeze(1)).squeeze(1)
            num_top = max(info.top_logprobs_nums)
            if num_top > 0:
                values, ids = logprobs.topk(min(num_top, info.vocab_size), dim=-1, sorted=True)
                output.top_logprob_values, output.top_logprob_ids = values, ids
        return output

    def _sample_non_greedy(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_filter:
            probs = probs.masked_fill(probs < filter_threshold(probs, info), 0.0)
        # Noise is in vocab order for every row whatever the batch needs, so a seeded row's token
        # does not depend on whether its batch neighbours made the filter stage run.
        noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        for row, seed in info.seeded_rows:
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(seed)
            noise[row].exponential_(generator=generator)
        # Exp(1) can return 0 on some backends; 0/0 would be NaN, and argmax picks NaN.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Return the penalised logits (a new tensor whenever any penalty applies; `logits` is never
    written). Order: repetition, frequency/presence, logit_bias, min_new_tokens ban."""
    if info.seen_token_mask is not None:
        penalty = info.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(info.seen_token_mask, penalised, logits)
    if info.output_token_counts is not None:
        counts = info.output_token_counts
        logits = (
            logits
            - info.frequency_penalties.unsqueeze(1) * counts
            - info.presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
        )
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.banned_token_mask is not None:
        logits = logits.masked_fill(info.banned_token_mask, float("-inf"))
    return logits


def apply_grammar_mask(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """-inf on every token a constrained row's grammar does not allow, for the whole batch in one op. Last
    of all (after the model's own rules too), so nothing re-enables a token the grammar forbids."""
    if info.vocab_mask is None:
        return logits
    allowed = unpack_bitmask(info.vocab_mask, logits.shape[-1])
    if info.stop_closers is not None and info.eos_ids is not None:
        allowed = close_on_stop_intent(logits, allowed, info.stop_closers, info.eos_ids)
    return logits.masked_fill(~allowed, float("-inf"))


def close_on_stop_intent(logits: torch.Tensor, allowed: torch.Tensor, closers: torch.Tensor,
                         eos_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose model would end here (its most likely token is EOS) while the grammar cannot end yet get
    the first closer the grammar allows as their only token: a JSON string, then array, then object closes
    (or a value ends with ',') instead of running on. Without this a small model that has said what it knows keeps writing inside an
    open string or array until max_tokens (seen on demo-vl). Only ever narrows to an allowed token, so the
    output stays valid; rows without closers (-1) or with EOS allowed are unchanged. No host sync."""
    wants_stop = torch.isin(logits.argmax(dim=-1), eos_ids)
    eos_allowed = allowed[:, eos_ids].any(dim=-1)
    closer_ok = allowed.gather(1, closers.clamp(min=0)) & (closers >= 0)  # [B, K]
    redirect = wants_stop & ~eos_allowed & closer_ok.any(dim=-1)
    first = closer_ok.to(torch.int8).argmax(dim=-1, keepdim=True)  # the first allowed closer (argmax takes the first max)
    only = torch.zeros_like(allowed).scatter_(1, closers.gather(1, first).clamp(min=0), True)
    return torch.where(redirect.unsqueeze(1), only, allowed)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 token bitmask -> [B, vocab_size] bool, True where the token is allowed. Tokens past
    32 * W are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def filter_threshold(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Per-row probability [B, 1] below which a token is dropped by top-k, top-p or min-p.

    top-k keeps the k largest; top-p then keeps the shortest prefix of those k (sorted descending)
    whose mass reaches top_p of the top-k mass (HF/vLLM order: top-p is over the top-k renormalised
    distribution); min-p keeps probs >= min_p * max prob. Returning a value rather than a mask means
    tokens tied with the threshold are all kept; ties are measure-zero for real logits and it
    keeps the result independent of the sort's tie order.
    """
    sorted_probs = probs.sort(dim=-1, descending=True).values
    positions = torch.arange(probs.shape[-1], device=probs.device)
    top_k_probs = sorted_probs.masked_fill(positions >= info.top_ks.unsqueeze(1), 0.0)
    cumulative = top_k_probs.cumsum(dim=-1)
    top_k_mass = cumulative[:, -1:]
    # Position j survives top-p when the mass strictly before it is below top_p of the top-k mass;
    # position 0 always survives. Positions past k have mass-before == top_k_mass and drop out.
    num_kept = ((cumulative - top_k_probs) < info.top_ps.unsqueeze(1) * top_k_mass).sum(dim=-1)
    # top_p == 1 must keep every top-k token, including the tail whose partial sums round to the total.
    num_kept = torch.where(info.top_ps >= 1.0, info.top_ks, num_kept).clamp(min=1)
    threshold = sorted_probs.gather(1, (num_kept - 1).unsqueeze(1))
    return torch.maximum(threshold, sorted_probs[:, :1] * info.min_ps.unsqueeze(1))


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step). Stable across processes and Python
    versions (unlike hash() of a str), and distinct steps give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _flatten_rows(
    ids_by_row: dict[int, Sequence[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, token ids) of every id in [0, vocab_size) of the given rows, for indexing a
    [B, V] tensor. Ids outside the vocab (multimodal pad values) are dropped."""
    lengths = torch.tensor([len(row_ids) for row_ids in ids_by_row.values()], dtype=torch.int64)
    rows = torch.tensor(list(ids_by_row), dtype=torch.int64).repeat_interleave(lengths)
    ids = torch.tensor(list(itertools.chain.from_iterable(ids_by_row.values())), dtype=torch.int64)
    keep = (ids >= 0) & (ids < vocab_size)
    return rows[keep].to(device), ids[keep].to(device)
