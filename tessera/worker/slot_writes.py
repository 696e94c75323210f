"""The step's slot-table writes (ForwardInput.slot_writes): staged as host tensors with the step's other inputs,
then applied to the worker's device copy of the table in the order they happened."""

from __future__ import annotations

import torch

from tessera.messages.worker import ForwardInput


def slot_write_parts(fi: ForwardInput) -> list[torch.Tensor]:
    """The step's slot writes as host tensors (values, rows, columns), staged with the other inputs."""
    writes = fi.slot_writes
    if not writes:
        return []
    positions = [w.positions() for w in writes]
    values = torch.cat([w.slots for w in writes])
    return [values, torch.cat([r for r, _ in positions]), torch.cat([c for _, c in positions])]


def apply_slot_writes(req_to_token: torch.Tensor, fi: ForwardInput, staged: list[torch.Tensor]) -> None:
    """Device-side copies of the staged writes, in order (a row freed and reused between two steps gets
    its writes in the order they happened)."""
    if not staged:
        return
    values, rows, cols = staged
    written = [r for w in fi.slot_writes for r in w.written_rows()]
    # No entry written twice (a row may be, at other columns: a request's cached prefix, then its new
    # tokens, as every admitted request of a prefill step): one scatter. 64 admissions a step were 128 calls.
    if len(set(written)) == len(written) or \
            torch.unique(rows * req_to_token.shape[1] + cols).numel() == rows.numel():
        req_to_token.index_put_((rows, cols), values)
        return
    offset = 0
    for w in fi.slot_writes:
        n = w.slots.shape[0]
        part = slice(offset, offset + n)
        req_to_token.index_put_((rows[part], cols[part]), values[part])
        offset += n
