"""Prefix caching for hybrid linear-attention models (Qwen3-Next, Qwen3.5): the scheduler's half of the state
snapshots (cache/state_pool.py holds them, cache/radix_cache.py hangs them on its nodes).

A cached prefix's K/V resume a request only with the linear-attention state at the prefix's end, so the radix
tree keeps copies of that state (snapshots) at some of its nodes and an admission matches only as far as the
deepest one. Snapshots are taken where a later request will match:
- the end of the prompt's last whole page before its last token (an admission always leaves the prompt's last
  token to compute), saved by the prefill chunk that passes it (`ForwardInput.state_saves`): a repeated prompt,
  the same image asked again, resumes there;
- the end of a request's KV when it leaves (finish, abort, retraction) and that is a whole page: its row is
  copied out before the next step (`ForwardInput.state_copies`): the next turn of a chat, whose prompt repeats
  this one's prompt and answer, resumes there; so does the retracted request itself. With pages of several
  tokens, where the KV ends inside a page, the state at the last whole page its decode steps completed: each such
  step saves it to a slot the request holds (the previous one goes back), handed to the tree when it leaves;
- the end of each prefill chunk but the last (a whole page), copied out the same way (a prefill step is never
  overlapped, so the row is still there): requests sharing the first chunks (a system prompt, an image) resume
  at the last chunk end they share, also those that waited for this prefill (policy's in-batch sharing).
A request's state has taken in every token of the steps scheduled for it (`Req.state_len`); where its KV length
was cut back since (a token discarded after overlap, a failed step) the row is not at the KV's end and nothing
is copied. A prefix without a snapshot is matched up to an earlier one or computed from the start.

Speculative decoding: a verify step's rows (the last token, then the drafts) go through the request's state in
turn, and the state after each row but the last is saved to a verify slot (the pool keeps k for each request
that may verify at once, apart from the snapshots; given back after the step); once the scheduler knows how many
drafts were accepted, the state after the last accepted row is copied back into the request's row before the next
step (all accepted: the row is already there).
"""

from __future__ import annotations

from tessera.cache.radix_cache import MatchResult, RadixCache
from tessera.cache.state_pool import SnapshotSlots
from tessera.scheduler.batch import ScheduledReq
from tessera.scheduler.req import Req


class StateSnapshots:
    """Journals the state-pool copies and plans the in-step saves of one scheduler (see the module docstring)."""

    def __init__(self, tree: RadixCache, page_size: int, verify: SnapshotSlots | None = None):
        self.tree, self.page_size = tree, page_size
        self.verify = verify  # speculative decoding's slots, apart from the snapshots (cache/state_pool.py)
        self._copies: list[tuple[int, int]] = []  # (source slot, destination slot), in order

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def resume(self, req: Req, match: MatchResult) -> None:
        """Admission: the request's row starts from the matched snapshot (or clean, from token 0)."""
        if match.state is not None:
            self._copies.append((match.state, req.req_pool_idx))  # type: ignore[arg-type]
        req.state_len = int(match.slots.numel())

    def plan_save(self, req: Req, start: int, end: int) -> tuple[int, int] | None:
        """For a prefill chunk [start, end): (tokens of the chunk, snapshot slot) when the chunk passes the prompt's
        snapshot point and the match did not reach it; the slot is the request's until its step is done."""
        at = (len(req.origin_input_ids) - 1) // self.page_size * self.page_size
        if not start < at <= end or at <= req.prefix_len or req.pending_state is not None:
            return None
        slot = self.tree.take_state_slot()
        if slot is None:
            return None
        req.pending_state = (at, slot)
        return at - start, slot

    def track(self, s: ScheduledReq) -> None:
        """Pages of several tokens: a plain decode step that completes a page saves the state there, in place of
        the request's previous such save (see the module docstring)."""
        req = s.req
        if self.page_size == 1 or s.is_prefill or s.draft or s.end % self.page_size:
            return
        slot = self.tree.take_state_slot()
        if slot is not None:
            if req.pending_state is not None:
                self.tree.free_state_slot(req.pending_state[1])
            req.pending_state = (s.end, slot)
            s.state_saves.append((1, slot))

    def after_prefill(self, req: Req) -> None:
        """After a prefill chunk's KV went into the tree: its saved snapshot joins the node ending there."""
        if req.pending_state is not None and req.pending_state[0] <= req.kv_len:
            at, slot = req.pending_state
            req.pending_state = None
            self._attach(req.cache_key()[:at], slot)
        if not req.is_prefill_done:
            self._copy_out(req, req.cache_key()[:req.kv_len])

    def verify_slots(self, num_drafts: int) -> list[int] | None:
        """Slots for the states after a verify step's rows but the last, or None (nothing taken) when too few."""
        slots = []
        for _ in range(num_drafts):
            slot = self.verify.alloc() if self.verify is not None else None
            if slot is None:
                self.free(slots)
                return None
            slots.append(slot)
        return slots

    def free(self, slots: list[int]) -> None:
        """Gives verify slots back."""
        for slot in slots:
            self.verify.free(slot)  # type: ignore[union-attr]

    def after_verify(self, req: Req, saves: list[tuple[int, int]], accepted: int) -> None:
        """A verify step kept `accepted` drafts: the request's state rolls back to the row after the last of them
        (its KV was truncated to the same length), and the step's slots go back."""
        if accepted < len(saves):
            self._copies.append((saves[accepted][1], req.req_pool_idx))  # type: ignore[arg-type]
        req.state_len = req.kv_len
        self.free([slot for _, slot in saves])

    def release(self, req: Req, key: list[int]) -> None:
        """A request leaves, its KV (`key`) just cached: its row's state is copied to a snapshot at the KV's end
        when that is a whole page with none yet; else a save it holds from inside its KV joins the node there. A
        save past its KV (its step failed) goes back."""
        pending, req.pending_state = req.pending_state, None
        if self._copy_out(req, key) or pending is None:
            if pending is not None:
                self.tree.free_state_slot(pending[1])
            return
        at, slot = pending
        if at <= len(key):
            self._attach(key[:at], slot)
        else:
            self.tree.free_state_slot(slot)

    def _attach(self, key: list[int], slot: int) -> None:
        """A saved snapshot joins the node ending at `key`, or goes back when there is none or it has one."""
        node = self.tree.node_at(key)
        if node is not None and node.state is None:
            node.state = slot
        else:
            self.tree.free_state_slot(slot)

    def _copy_out(self, req: Req, key: list[int]) -> bool:
        """A snapshot of the request's row, at the node ending at `key` (cached whole pages) if it has none and the
        row's state has taken in exactly `key`. Whether the node has one now."""
        n = len(key)
        if not n or n % self.page_size or req.state_len != n:
            return False
        node = self.tree.node_at(key)
        if node is None or node.state is not None:
            return node is not None
        slot = self.tree.take_state_slot()  # evicts only nodes holding a snapshot: never this one
        if slot is not None:
            node.state = slot
            self._copies.append((req.req_pool_idx, slot))  # type: ignore[arg-type]
        return slot is not None
