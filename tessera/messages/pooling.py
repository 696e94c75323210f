"""PoolingParams: how an embedding request's final hidden states become one vector.

A request that carries PoolingParams is prefill only: the scheduler computes its prompt, the worker pools
the rows of the final hidden states (after the model's final norm, as transformers' base model returns them)
and the request finishes with that vector, holding no decode slot. Built and verified at the edge
(Engine.encode, /v1/embeddings); errors are ValueErrors that start with the offending field's name.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """method: "last" (the prompt's last token: SGLang's and vLLM's default for decoder models), "mean"
    (over every prompt token) or "cls" (the first token). dimensions: keep the first `dimensions` values
    (Matryoshka truncation, before the normalisation, as vLLM). normalize: L2-normalise the result."""

    method: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def verify(self, hidden_size: int) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling: {self.method!r} is not one of {', '.join(POOLING_METHODS)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: expected true or false, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions: must be an integer from 1 to the model's embedding size {hidden_size}, "
                             f"got {d!r}")

    @property
    def uses_every_row(self) -> bool:
        """The pooled vector reads rows other than the last: a cached prefix (whose rows are not computed
        again) may not serve the request."""
        return self.method != "last"
