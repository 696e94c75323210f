"""Grammar matchers in the scheduler process: built off the step loop, advanced with each accepted token.

The scheduler owns request state, so each constrained request's matcher lives on its Req: it has consumed
exactly the request's output_ids, which survive retraction, so a retracted request resumes with the right
state without replaying anything. Each step the scheduler fills one int32 bitmask row per sampled request
(`fill_bitmask`) and ships it in the ForwardInput; the worker's sampler applies it to the whole batch. Only
rank 0 samples, so under tensor parallelism the other ranks ignore the (small) mask.

Building a matcher compiles its grammar's lexer (milliseconds for a schema, more for a large one), so it
runs on a thread (`GrammarCompiler.submit`) and the request waits outside the batch until it is ready; the
compiled matcher is kept as a template per (kind, source) and copied for each later request (microseconds).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tessera.constrained.grammar import grammar_text

logger = logging.getLogger("tessera.constrained")

TEMPLATE_CACHE_SIZE = 256  # compiled grammars kept per scheduler (a template is a few KB to a few MB)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's position in its grammar. closers: the tokens that close a JSON string, array and
    object (and ','), for a JSON grammar (the sampler's close_on_stop_intent); () for others."""

    def __init__(self, matcher, vocab_size: int, closers: tuple[int, ...] = ()):
        self._m = matcher
        self.vocab_size = vocab_size
        self.closers = closers

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar rejects it (the mask was not applied)."""
        return bool(self._m.consume_token(token_id))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (nothing is consumed)."""
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def advanced(self, tokens: Sequence[int]) -> GrammarMatcher:
        """A copy that has also consumed `tokens` (speculative decoding: the mask of a draft row)."""
        copy = self._m.deep_copy()
        for t in tokens:
            copy.consume_token(t)
        return GrammarMatcher(copy, self.vocab_size, self.closers)

    @property
    def is_terminated(self) -> bool:
        """The grammar admits no further token (its end, or EOS consumed): the request is finished."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def raw(self):
        return self._m


class GrammarCompiler:
    """Builds matchers for one model's tokenizer; owned by the scheduler.

    eos_token_ids: allowed (and only then) once the grammar is complete; sampling one ends the request.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Collection[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()  # (kind, source) -> compiled matcher
        self._lock = threading.Lock()  # the template cache is touched by the compile thread and the loop
        self._pool: ThreadPoolExecutor | None = None
        # Single-token '"', ']', '}' and ',' (the order close_on_stop_intent prefers them in: close a string, then
        # an array, then an object; ',' last, to leave a value, e.g. a number, for the next required key).
        ids = [hf_tokenizer.encode(ch, add_special_tokens=False) for ch in '"]},']
        self.json_closers = tuple(i[0] for i in ids if len(i) == 1 and 0 <= i[0] < vocab_size)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            eos = self._eos[0] if len(self._eos) == 1 else (self._eos or None)
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=eos)
        return self._ll_tokenizer

    def _matcher(self, kind: str, template) -> GrammarMatcher:
        return GrammarMatcher(template.deep_copy(), self.vocab_size,
                              self.json_closers if kind == "json_schema" else ())

    def _cached(self, kind: str, source: str) -> GrammarMatcher | None:
        with self._lock:
            template = self._templates.get((kind, source))
            if template is None:
                return None
            self._templates.move_to_end((kind, source))
        return self._matcher(kind, template)

    def build(self, kind: str, source: str) -> GrammarMatcher:
        """A fresh matcher for the constraint; raises ValueError naming the field if it cannot be built."""
        cached = self._cached(kind, source)
        if cached is not None:
            return cached
        grammar = grammar_text(kind, source)
        from llguidance import LLMatcher

        try:
            tokenizer = self._tokenizer()
        except Exception as e:  # e.g. a slow (non-`tokenizers`) tokenizer
            raise ValueError(f"{kind}: constrained decoding is unavailable for this model's tokenizer ({e})") from e
        template = LLMatcher(tokenizer, grammar)
        if template.is_error():
            raise ValueError(f"{kind}: {template.get_error().strip().splitlines()[0]}")
        with self._lock:
            self._templates[(kind, source)] = template
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        return self._matcher(kind, template)

    def submit(self, kind: str, source: str) -> Future:
        """A future GrammarMatcher. A cached constraint is resolved at once; a new one is translated and
        compiled on the compile thread, so the step loop never waits for it."""
        fut: Future = Future()
        cached = self._cached(kind, source)
        if cached is not None:
            fut.set_result(cached)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-grammar")
        return self._pool.submit(self.build, kind, source)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_executor = None


def fill_bitmask(matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
    """The step's token bitmask: [len(matchers), bitmask_width(V)] int32, all ones on unconstrained rows;
    None when no row is constrained. Rows are filled in parallel by llguidance's executor."""
    rows = [(m.raw, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    vocab_size = next(m.vocab_size for m in matchers if m is not None)
    bitmask = torch.full((len(matchers), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module (it sets up
    # torch.compile at import): each listed row of the contiguous host tensor is written in place.
    _executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    return bitmask


def stop_closers(matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
    """[len(matchers), K] closing-token ids per row, -1 padded; None when no row has closers."""
    width = max((len(m.closers) for m in matchers if m is not None), default=0)
    if width == 0:
        return None
    rows = [list(m.closers) if m is not None else [] for m in matchers]
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64)
