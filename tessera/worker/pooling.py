"""Pooling the final hidden states of embedding requests (messages/pooling.py) into one vector each.

The model hands back the rows the step asks for (ForwardBatch.hidden_indices: rows after the final norm,
transformers' `last_hidden_state`): the last prompt row for "last", the first for "cls", every row for "mean".
A prompt split over prefill chunks is pooled across them: the running sum (mean) or the first row (cls) is kept
per request until the chunk with its last token, and dropped when the request leaves (a retracted request
starts again from its first token: mean and CLS pooling never take a cached prefix).
"""

from __future__ import annotations

import torch

from tessera.messages.worker import PoolingRows


def hidden_rows(entries: list[PoolingRows]) -> list[int]:
    """The flat rows whose hidden states the entries need, in entry order (pool() reads them in this order)."""
    rows: list[int] = []
    for e in entries:
        if e.params.method == "mean":
            rows.extend(range(e.row, e.row + e.n))
        elif e.params.method == "cls":
            if e.start == 0:
                rows.append(e.row)
        elif e.final:
            rows.append(e.row + e.n - 1)
    return rows


class Pooler:
    """Per-request partial pools across prefill chunks; pool() returns the finished vectors."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}  # rid -> (sum or first row, rows seen)

    def release(self, rid: str) -> None:
        self._partial.pop(rid, None)

    def pool(self, hidden: torch.Tensor, entries: list[PoolingRows], rids: list[str]) -> list[torch.Tensor]:
        """hidden: the rows of hidden_rows(entries), in order. One float32 host vector per final entry."""
        hidden = hidden.float()
        out: list[torch.Tensor] = []
        at = 0
        for e in entries:
            rid, method = rids[e.req], e.params.method
            if method == "mean":
                part = hidden[at:at + e.n].sum(dim=0)
                at += e.n
                prev = self._partial.get(rid)
                self._partial[rid] = (part, e.n) if prev is None else (prev[0] + part, prev[1] + e.n)
            elif method == "cls" and e.start == 0:
                self._partial[rid] = (hidden[at], 1)
                at += 1
            elif method == "last" and e.final:
                self._partial[rid] = (hidden[at], 1)
                at += 1
            if e.final:
                total, count = self._partial.pop(rid)
                out.append(total / count)
        return finish(out, [e for e in entries if e.final])


def finish(vectors: list[torch.Tensor], entries: list[PoolingRows]) -> list[torch.Tensor]:
    """Matryoshka truncation, then L2 normalisation (each when asked); the vectors on the host, in one copy
    (one device sync a step, not one a request)."""
    if not vectors:
        return []
    stacked = torch.stack(vectors)
    full = torch.nn.functional.normalize(stacked, p=2, dim=-1).cpu()  # the common case: every value kept
    raw = stacked.cpu()
    out = []
    for i, e in enumerate(entries):
        d = e.params.dimensions
        if d is None:
            out.append((full[i] if e.params.normalize else raw[i]).clone())
        else:  # cut first, then normalise what is kept (vLLM's order)
            v = raw[i, :d].clone()
            out.append(torch.nn.functional.normalize(v, p=2, dim=-1) if e.params.normalize else v)
    return out
