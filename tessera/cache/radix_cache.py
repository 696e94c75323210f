"""Radix-tree prefix cache (SGLang's RadixCache semantics) over token keys, page aligned.

Keys are token ids as Python ints (multimodal pad values can be ~2**62, so keys are never int32 tensors).
Values are KV slots (long tensor, one per key token). With page_size > 1 only whole pages are matched and
inserted: keys are truncated to a multiple of page_size, and every edge length is a multiple of page_size.

Ownership: slots stored in the tree are owned by the tree; it returns them to the allocator on `evict` and
`reset`. A node with lock_ref > 0 (some running request uses its prefix) and all its ancestors are never
evicted.

How the scheduler uses it (KVManager, scheduler/; row = the request's ReqToTokenPool row, req_to_token = that
pool's table, kv_len = how many of the request's tokens have slots, prefix_len = how many of those the tree owns):

  Admission (no slots taken yet):
      m = tree.match_prefix(key[:len(key) - 1])  # keep >= 1 token to compute: it yields the logits (cut back
                                                 # to the start of a media span the match would end inside)
      req_to_token[row, :len(m.slots)] = m.slots
      tree.inc_lock_ref(m.last_node)             # the match is not evicted while the request runs
      prefix_len = kv_len = len(m.slots)         # a multiple of page_size
  Each prefill chunk or decode token, before its forward (n tokens):
      new = allocator.alloc_extend(kv_len, last_slot, n)    # last_slot = req_to_token[row, kv_len - 1]
      on None: tree.evict(n + page_size) and retry; still None: the policy retracts a request
      req_to_token[row, kv_len:kv_len + n] = new; kv_len += n
      (a decode batch takes its new pages in one allocator.alloc_pages call first, this path when that fails)
  After a prefill chunk (its KV written):
      m = tree.cache_unfinished_req(key[:kv_len], req_to_token[row, :kv_len], prefix_len, last_node)
      req_to_token[row, prefix_len:len(m.slots)] = m.slots[prefix_len:]  # duplicate pages were swapped
      prefix_len, last_node = len(m.slots), m.last_node                   # now locked instead of the old one
  Finish, abort or retraction (the same call: computed whole pages stay cached):
      tree.cache_finished_req(key[:kv_len], req_to_token[row, :kv_len], prefix_len, last_node)
      req_to_token_pool.free(row)
      which does:  aligned = kv_len // page_size * page_size
                   new_prefix_len = tree.insert(key[:aligned], slots[:aligned])
                   allocator.free(slots[prefix_len:new_prefix_len])  # our copies of pages the tree already had
                   allocator.free(slots[aligned:])                   # partial last page + unused allocated slots
                   tree.dec_lock_ref(last_node)

With disable=True: match returns no slots and root, insert stores nothing and returns 0, evict returns 0,
locks are no-ops, and cache_finished_req frees every slot of the request. The recipe above is unchanged.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tessera.cache.allocator import PagedTokenAllocator

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives at `value` slots. Hashes by identity."""

    key: list[int] = field(default_factory=list)
    value: torch.Tensor | None = None  # None only for the root
    parent: TreeNode | None = field(default=None, repr=False)
    # Keyed by the child edge's first page (tuple of page_size ints); edges out of a node differ there.
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # running requests whose prefix goes through this node
    last_access_time: int = 0  # logical clock, strictly increasing per tree operation
    id: int = field(default_factory=lambda: next(_node_ids))  # LRU tie-break

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    slots: torch.Tensor  # [n] long, n a multiple of page_size; owned by the tree
    last_node: TreeNode  # deepest node of the match (root when n == 0); lock it while using the slots


class RadixCache:
    def __init__(self, allocator: PagedTokenAllocator, page_size: int, disable: bool = False):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evictable
        self._evictable_size = 0
        self._protected_size = 0

    # ---- queries -----------------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (what `evict` could free)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        return sum(len(node.key) for node in self._nodes())

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `key`, whole pages only. Splits an edge when the match ends inside it, so
        `last_node` ends exactly at the match. Marks the matched path as recently used."""
        if self.disable:
            return MatchResult(self._empty_slots(), self.root)
        path = self._walk(list(key[: len(key) // self.page_size * self.page_size]), next(self._clock))
        slots = torch.cat([n.value for n in path]) if path else self._empty_slots()
        return MatchResult(slots, path[-1] if path else self.root)

    def _walk(self, key: list[int], now: int) -> list[TreeNode]:
        """The nodes along the longest cached prefix of `key` (whole pages), each marked used at `now`. An
        edge the prefix ends inside is split, so the last node ends exactly at the prefix."""
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            child.last_access_time = now
            matched = self._match_len(child.key, key, pos)
            is_partial = matched < len(child.key)
            if is_partial:
                child = self._split(child, matched)
            assert child.value is not None
            path.append(child)
            node, pos = child, pos + matched
            if is_partial:
                break
        return path

    # ---- mutation ----------------------------------------------------------------------------------------

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Stores `key` -> `slots` (truncated to whole pages) and returns how many leading tokens were ALREADY
        in the tree. The tree keeps its own slots for that range, so the caller still owns
        slots[:returned_len] and must free the part of it that it did not get from the tree
        (slots[cached_len:returned_len]); slots[returned_len:aligned] now belong to the tree. Tokens past the
        last whole page are ignored (the caller keeps and frees them). Disabled: stores nothing, returns 0.
        """
        assert len(key) == len(slots), (len(key), len(slots))
        if self.disable:
            return 0
        aligned = len(key) // self.page_size * self.page_size
        key = list(key[:aligned])
        now = next(self._clock)
        path = self._walk(key, now)
        node = path[-1] if path else self.root
        pos = sum(len(n.key) for n in path)
        if pos < aligned:
            # Clone: callers pass a view of req_to_token, whose row is reused by the next request.
            leaf = TreeNode(key=key[pos:], value=slots[pos:aligned].clone(), parent=node, last_access_time=now)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._evictable_size += len(leaf.key)
        return pos

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pins `node` and its ancestors. Returns the change of evictable_size (<= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undoes one `inc_lock_ref(node)`. Returns the change of evictable_size (>= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref of unlocked node {node.id}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            assert node.parent is not None
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Evicts least-recently-used unlocked leaves (a parent becomes a candidate once its last child goes)
        until >= num_tokens are freed or nothing is evictable; their slots go back to the allocator.
        Returns the number of tokens freed (a multiple of page_size)."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.value is not None
            del parent.children[self._child_key(node.key, 0)]
            freed.append(node.value)
            num_freed += len(node.key)
            self._evictable_size -= len(node.key)
            if parent.is_leaf and parent.lock_ref == 0:  # the root has lock_ref 1, so it never gets here
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))  # one free call: one cat on the allocator's free list
        return num_freed

    def reset(self) -> None:
        """Returns every slot the tree holds to the allocator and empties the tree. Only valid when no request
        holds a lock (asserted). Do not also clear() the allocator: that would double free."""
        assert self._protected_size == 0, f"reset with {self._protected_size} locked tokens"
        values = [n.value for n in self._nodes() if n.value is not None]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ---- scheduler helpers (see the module docstring) ----------------------------------------------------

    def cache_finished_req(self, key: Sequence[int], slots: torch.Tensor, cached_len: int,
                           last_node: TreeNode, freed: list[torch.Tensor] | None = None) -> None:
        """A request is done. key: its tokens whose KV is written (kv_len of them); slots: every slot the
        request holds, slots[:len(key)] matching key (len(slots) >= len(key); extra ones were allocated but
        unused); cached_len, last_node: what admission (or the last cache_unfinished_req) gave it, its
        slots[:cached_len] are the tree's. Afterwards the request holds no slot and no lock. freed: the slots
        to give back are appended there (the caller frees them) instead of freed here."""
        assert len(slots) >= len(key) >= cached_len, (len(slots), len(key), cached_len)
        free = self.allocator.free if freed is None else freed.append
        if self.disable:
            free(slots)
            return
        aligned = len(key) // self.page_size * self.page_size
        new_prefix_len = self.insert(key[:aligned], slots[:aligned])
        # The locked path [0, cached_len) cannot have been evicted, so insert walks at least that far.
        assert new_prefix_len >= cached_len, (new_prefix_len, cached_len)
        # Both ranges are page aligned at their start and cover pages only this request owns.
        free(torch.cat((slots[cached_len:new_prefix_len], slots[aligned:])))
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(self, key: Sequence[int], slots: torch.Tensor, cached_len: int,
                             last_node: TreeNode) -> MatchResult:
        """Caches the whole pages of a still-running request (chunked prefill). key: tokens whose KV is
        written; slots: their slots (len(slots) == len(key)). Returns the tree's slots for the aligned prefix
        and its last node, already locked (last_node is unlocked). The caller copies result.slots[cached_len:]
        into its table (duplicate pages were freed and replaced by the tree's) and sets
        cached_len = len(result.slots). It keeps owning slots[len(result.slots):] (its partial page)."""
        assert len(slots) == len(key) >= cached_len, (len(slots), len(key), cached_len)
        if self.disable:
            return MatchResult(self._empty_slots(), self.root)
        aligned = len(key) // self.page_size * self.page_size
        new_prefix_len = self.insert(key[:aligned], slots[:aligned])
        assert new_prefix_len >= cached_len, (new_prefix_len, cached_len)
        self.allocator.free(slots[cached_len:new_prefix_len])
        result = self.match_prefix(key[:aligned])
        assert len(result.slots) == aligned, (len(result.slots), aligned)
        self.inc_lock_ref(result.last_node)  # lock the new path before unlocking the old (shared) one
        self.dec_lock_ref(last_node)
        return result

    # ---- debugging ---------------------------------------------------------------------------------------

    def format_tree(self, max_tokens: int = 8) -> str:
        lines = [f"root (total={self.total_size()} evictable={self._evictable_size} "
                 f"protected={self._protected_size})"]
        stack = [(child, 1) for child in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            assert node.value is not None
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}[{len(node.key)}] key={node.key[:max_tokens]}{more} "
                         f"slots={node.value[:max_tokens].tolist()}{more} lock={node.lock_ref} "
                         f"t={node.last_access_time}")
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        return "\n".join(lines)

    # ---- internals ---------------------------------------------------------------------------------------

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _child_key(self, key: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(key[pos:pos + self.page_size])

    def _match_len(self, edge: Sequence[int], key: Sequence[int], pos: int) -> int:
        """Common prefix length of `edge` and key[pos:], rounded down to whole pages."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos:pos + n]:  # the common case; list compare runs in C
            return n
        i = 0
        while edge[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cuts child's edge after split_len tokens; returns the new upper node (same locks as child)."""
        assert 0 < split_len < len(child.key) and split_len % self.page_size == 0
        assert child.parent is not None and child.value is not None
        # The new node inherits lock_ref: every lock through child also goes through it; sizes are unchanged.
        upper = TreeNode(key=child.key[:split_len], value=child.value[:split_len], parent=child.parent,
                         lock_ref=child.lock_ref, last_access_time=child.last_access_time)
        child.parent.children[self._child_key(upper.key, 0)] = upper
        child.key, child.value, child.parent = child.key[split_len:], child.value[split_len:], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
