"""The decode K/V mirror kept across steps: every step's attention equals a naive read of the pool while
requests join, decode, leave, reuse slot-table rows, get retracted, and steps fail halfway."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from tessera.layers.attention import cpu_decode, get_attention_backend
from tessera.layers.forward_batch import ForwardBatch
from tests.layers.test_attention_backend import reference

HEAD_DIM, LAYERS, HEADS, KV_HEADS = 8, 2, 4, 2


@pytest.fixture(autouse=True)
def keep_the_mirror(monkeypatch):
    """Float32 on a CPU reads the pool in place through our C kernel (test_cpu_decode_attention.py runs this
    file's traffic through it); the mirror serves every other dtype and device: keep it here."""
    monkeypatch.setattr(cpu_decode, "reads_pool", lambda *a: False)


class Sim:
    """Requests over a real ReqToTokenPool and a KV pool with scattered slots; one backend under test."""

    def __init__(self, pool_size: int = 2000, max_reqs: int = 12, seed: int = 0):
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.pool = TokenToKVPool(pool_size, LAYERS, KV_HEADS, HEAD_DIM)
        for buf in self.pool.k_buffers + self.pool.v_buffers:
            buf.normal_(generator=self.g)  # stale values everywhere: reading a wrong slot shows
        self.req_pool = ReqToTokenPool(max_reqs, 256)
        self.free_slots = list(range(1, pool_size))
        self.rng.shuffle(self.free_slots)
        self.reqs: dict[int, int] = {}  # req_to_token row -> KV length so far
        self.backend = get_attention_backend("torch_native")

    def join(self) -> int | None:
        row = self.req_pool.alloc()
        if row is not None:
            self.reqs[row] = 0
        return row

    def leave(self, row: int) -> None:
        n = self.reqs.pop(row)
        self.free_slots.extend(self.req_pool.req_to_token[row, :n].tolist())
        self.rng.shuffle(self.free_slots)  # freed slots come back in another order, then get reused
        self.req_pool.free(row)

    def step(self, extends: dict[int, int], generations: bool = True, layers: int = LAYERS) -> None:
        """Runs one step (row -> new tokens) through `layers` layers and checks each against the reference."""
        rows = list(extends)
        seq_lens, ext = [], []
        locs = []
        for row in rows:
            n, start = extends[row], self.reqs[row]
            slots = torch.tensor([self.free_slots.pop() for _ in range(n)])
            self.req_pool.req_to_token[row, start : start + n] = slots
            locs.append(slots)
            seq_lens.append(start + n)
            ext.append(n)
        t = sum(ext)
        fb = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long), positions=torch.zeros(3, t),
                          out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor(rows),
                          seq_lens=torch.tensor(seq_lens), extend_lens=torch.tensor(ext),
                          req_to_token=self.req_pool.req_to_token,
                          req_generations=[self.req_pool.generation[r] for r in rows] if generations else None)
        self.backend.init_forward_metadata(fb)
        for layer in range(layers):
            q = torch.randn(t, HEADS, HEAD_DIM, generator=self.g)
            k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=self.g)
            v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=self.g)
            with torch.inference_mode():  # as the model runs: our C kernels take no autograd inputs
                out = self.backend.forward(q, k, v, layer, fb, self.pool, 0.35)
            expected = reference(q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], fb, 0.35)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        for row, n in zip(rows, ext):
            self.reqs[row] += n

    def decoding(self) -> list[int]:
        return [r for r, n in self.reqs.items() if n > 0]


def random_traffic(sim: Sim, steps: int = 120) -> list:
    """Requests join (prefill chunks mixed into decode batches), decode in shuffled order and leave; returns
    each step's mirror plan (None where the step did not use the mirror)."""
    plans = []
    plan = sim.backend._mirror.plan
    sim.backend._mirror.plan = lambda *a: plans.append(plan(*a)) or plans[-1]
    for _ in range(steps):
        extends = {r: 1 for r in sim.decoding()}
        sim.rng.shuffle(order := list(extends))  # the batch order changes from step to step
        extends = {r: 1 for r in order}
        if sim.rng.random() < 0.3 and (row := sim.join()) is not None:
            extends[row] = sim.rng.randint(2, 20)  # a prefill chunk in the same step (mixed batch)
        if not extends:
            continue
        sim.step(extends, generations=sim.rng.random() > 0.1)  # now and then a step without the mirror
        for row in sim.decoding():
            if sim.rng.random() < 0.08 or sim.reqs[row] > 150:
                sim.leave(row)
    return plans


def test_random_traffic_matches_the_pool() -> None:
    plans = random_traffic(Sim(seed=1))
    done = [p for p in plans if p is not None]
    assert len(done) > 80
    # Every path of the plan ran: appends, fills, compaction moves, and batches out of mirror order.
    assert sum(p.append_index is not None for p in done) > 50 and sum(len(p.fills) for p in done) > 10
    assert sum(len(p.moves) for p in done) > 3 and sum(not p.identity for p in done) > 20


def test_reused_row_never_reads_the_previous_tenant() -> None:
    sim = Sim(seed=2)
    a = sim.join()
    sim.step({a: 9})
    for _ in range(3):
        sim.step({a: 1})
    sim.leave(a)
    b = sim.join()
    assert b == a  # same slot-table row, new generation
    sim.step({b: 12})  # longer prompt: length 13 after the first decode would line up with nothing stale
    sim.step({b: 1})
    sim.step({b: 1})


def test_retracted_request_is_refilled() -> None:
    """Retraction returns the row and re-admits the request later: a new generation, so a full refill."""
    sim = Sim(seed=3)
    a, b = sim.join(), sim.join()
    sim.step({a: 6, b: 4})
    sim.step({a: 1, b: 1})
    kept = sim.req_pool.req_to_token[b, : sim.reqs[b]].clone()
    sim.reqs.pop(b)
    sim.req_pool.free(b)
    sim.step({a: 1})
    b2 = sim.join()
    sim.req_pool.req_to_token[b2, : len(kept)] = kept  # resumed from the prefix cache: same slots
    sim.reqs[b2] = len(kept) - 1
    sim.free_slots.extend(kept[-1:].tolist())
    sim.step({b2: 1, a: 1})
    sim.step({a: 1, b2: 1})


def test_step_that_stops_between_layers_does_not_corrupt_the_next() -> None:
    sim = Sim(seed=4)
    a, b = sim.join(), sim.join()
    sim.step({a: 5, b: 7})
    sim.step({a: 1, b: 1})
    sim.step({a: 1, b: 1}, layers=1)  # layer 1 never ran: the mirror of layer 1 misses a token
    sim.pool.k_buffers[1][sim.req_pool.req_to_token[a, sim.reqs[a] - 1]] = 0.5  # what a rerun would have written
    sim.step({a: 1, b: 1})
    sim.step({a: 1, b: 1})


def test_falls_back_to_gathering_when_the_mirror_would_outgrow_the_pool() -> None:
    sim = Sim(pool_size=400, seed=5)
    rows = [sim.join() for _ in range(6)]
    sim.step({r: 60 for r in rows})
    sim.step({r: 1 for r in rows})  # 8 rows x 64 positions > the pool's 400 slots (both per layer, K and V)
    assert sim.backend._mirror.k == []
    sim.step({r: 1 for r in rows[:1]})
    assert sim.backend._mirror.k != []
