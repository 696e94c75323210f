"""The scheduler/worker seam: ForwardInput is self-contained and serialisable, and the worker's slot table
follows the scheduler's through the journaled writes alone."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.messages.finish import FinishReason
from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.config import ServerArgs
from tessera.models.base import StepSegment, TesseraModel
from tessera.models.config import ModelConfig
from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.messages.sampling import SamplingParams
from tessera import messages
from tessera.scheduler.kv_manager import KVManager
from tessera.scheduler.policy import SchedulePolicy
from tessera.scheduler.req import Req
from tessera.scheduler.step_input import build_forward_input
from tessera.messages.worker import ForwardInput
from tessera.worker.masks import span_mask
from tests.processed_chat import process_chat, scene_question


def _policy(pool_tokens: int, page_size: int, chunk: int, max_running: int = 6) -> SchedulePolicy:
    alloc = PagedTokenAllocator(pool_tokens, page_size)
    tree = RadixCache(alloc, page_size)
    return SchedulePolicy(KVManager(ReqToTokenPool(max_running + 1, 256), alloc, tree, page_size), max_running, chunk)


def _drive(policy: SchedulePolicy, reqs: list[Req], config: ModelConfig, on_step) -> int:
    """Runs the policy with a fake model (token 7 every step) until all requests finish; on_step(fi, batch)."""
    for r in reqs:
        policy.add(r)
    steps = 0
    while True:
        batch = policy.next_batch()
        if batch is None:
            return steps
        fi = build_forward_input(batch, TesseraModel, config, policy.kv)
        on_step(fi, batch)
        steps += 1
        for s in batch.reqs:
            if s.end - s.start > 1 or not s.req.output_ids:
                policy.kv.cache_prefill(s.req)
        for s in batch.reqs:
            if s.samples:
                s.req.output_ids.append(7)
                if len(s.req.output_ids) >= s.req.sampling_params.max_new_tokens:
                    policy.finish(s.req)
                    s.req.finished_reason = FinishReason.of_length(0)


def test_worker_slot_table_follows_the_journal_under_random_traffic() -> None:
    config = ModelConfig.load(ServerArgs(model_path="demo-vl").model_path)
    rng = random.Random(0)
    shared = [rng.randrange(50) for _ in range(40)]  # a common prefix, so the radix cache dedups slots
    reqs = [Req(f"r{i}", shared[: rng.randrange(0, 40)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))],
                SamplingParams(max_new_tokens=rng.randrange(1, 12)), None) for i in range(24)]
    policy = _policy(pool_tokens=300, page_size=4, chunk=24)  # small pool: evictions and retractions happen
    worker_table = torch.zeros_like(policy.kv.req_pool.req_to_token)
    released: set[str] = set()

    def on_step(fi: ForwardInput, batch) -> None:
        fi = messages.decode(messages.encode(fi))  # what another process (a TP rank) would receive
        for w in fi.slot_writes:
            worker_table.index_put_(w.positions(), w.slots)
        released.update(fi.released)
        for row, seq in zip(fi.req_pool_indices, fi.seq_lens):
            assert torch.equal(worker_table[row, :seq], policy.kv.req_pool.req_to_token[row, :seq])
        assert fi.num_tokens == int(fi.out_cache_loc.shape[0]) == sum(fi.extend_lens)
        assert len(fi.sampling) == len(fi.logits_rows)

    assert _drive(policy, reqs, config, on_step) > 10
    assert policy.num_retractions > 0 or policy.kv.tree.total_size() > 0
    # Every request's worker state is released: in a later step's message, or pending for the next one.
    assert released | set(policy.kv.take_pending()[1]) == {r.rid for r in reqs}


def _image_req(rid: str, prompt_len: int, span: tuple[int, int]) -> Req:
    item = MultimodalDataItem(Modality.IMAGE, hash=hash(rid) & 0xFFFF, offsets=[span])
    req = Req(rid, list(range(prompt_len)), SamplingParams(max_new_tokens=2), MultimodalInputs([item]))
    req.atomic_spans = [span]
    return req


def test_chunked_prefill_never_splits_an_atomic_span() -> None:
    config = ModelConfig.load(ServerArgs(model_path="demo-vl").model_path)
    policy = _policy(pool_tokens=512, page_size=1, chunk=8)
    req = _image_req("a", 40, (5, 25))  # a 20-token image: bigger than one chunk
    chunks: list[tuple[int, int]] = []
    _drive(policy, [req], config, lambda fi, b: chunks.extend((s.start, s.end) for s in b.reqs))
    for start, end in chunks:
        assert not (5 < start < 25) and not (5 < end < 25), chunks
    assert (5, 25) in chunks  # taken whole, over the chunk budget
    assert chunks[0] == (0, 5)  # the chunk before it stops at its start


def test_prefix_match_never_ends_inside_an_atomic_span() -> None:
    policy = _policy(pool_tokens=512, page_size=1, chunk=64)
    first = Req("x", list(range(30)), SamplingParams(max_new_tokens=1), None)
    _drive(policy, [first], ModelConfig.load(ServerArgs(model_path="demo-vl").model_path), lambda fi, b: None)
    # Same first 30 tokens cached; a request whose span [20, 35) straddles the cached end must not reuse 20..29.
    req = _image_req("y", 40, (20, 35))
    req.mm_inputs = None  # plain tokens as the cache key, so the cached prefix really matches
    assert policy.kv.admit(req)
    assert req.prefix_len == 20


def test_span_mask_is_causal_plus_whole_spans() -> None:
    mask = span_mask([(2, 5)], prefix_len=0, seq_len=7)
    causal = torch.ones(7, 7).tril().bool()
    expected = causal.clone()
    expected[2:5, 2:5] = True
    assert torch.equal(mask, expected)
    assert span_mask([(2, 5)], prefix_len=5, seq_len=7) is None  # no query inside a span: plain causal
    tail = span_mask([(6, 9)], prefix_len=5, seq_len=9)
    assert tail.shape == (4, 9) and tail[1, 8] and not tail[0, 6]


def test_prepare_step_positions() -> None:
    vl = ModelConfig.load(ServerArgs(model_path="demo-vl").model_path)
    mrope = torch.arange(30).view(3, 10)
    mm = MultimodalInputs([], mrope_positions=mrope, mrope_position_delta=-4)
    layout = TesseraModel.prepare_step(vl, [StepSegment(3, 10, 10, mm), StepSegment(12, 13, 10, mm)])
    assert torch.equal(layout.positions[:, :7], mrope[:, 3:10])
    assert layout.positions[:, 7].tolist() == [8, 8, 8]  # decode: index 12 + delta -4
    assert layout.bidirectional_spans is None
    asr = ModelConfig.load(ServerArgs(model_path="demo-asr").model_path)
    layout = TesseraModel.prepare_step(asr, [StepSegment(4, 7, 5), StepSegment(0, 2, 2)])
    assert layout.positions.tolist() == [4, 5, 6, 0, 1]


def test_a_worker_fed_decoded_messages_matches_one_fed_the_originals() -> None:
    """Two workers step through the same ForwardInputs: one receives them in-process, the other after the
    wire codec (as a tensor-parallel rank would). Same tokens, and the image is encoded once per worker."""
    from tessera.frontend.model_info import ModelInfo
    from tessera.models.config import eos_token_ids
    from tessera.worker.model_worker import ModelWorker

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=2048, max_running_requests=4)
    info = ModelInfo.load(args)
    out = scene_question(info)
    eos = eos_token_ids(info.config)
    local, remote = ModelWorker(args, eos, info.config), ModelWorker(args, eos, info.config)
    policy = _policy(pool_tokens=2048, page_size=1, chunk=32, max_running=4)  # the image spans several chunks
    reqs = [Req(f"q{i}", list(out.input_ids), SamplingParams(max_new_tokens=6, temperature=0), out.mm_inputs)
            for i in range(2)]
    tokens: dict[str, list[int]] = {"local": [], "remote": []}
    for r in reqs:
        policy.add(r)
    while (batch := policy.next_batch()) is not None:
        fi = build_forward_input(batch, info.config.family.model_class(), info.config, policy.kv)
        a, b = local.execute(fi), remote.execute(messages.decode(messages.encode(fi)))
        assert a.next_token_ids == b.next_token_ids
        tokens["local"] += a.next_token_ids
        for s in batch.reqs:
            if s.end - s.start > 1 or not s.req.output_ids:
                policy.kv.cache_prefill(s.req)
        for s, tok in zip([s for s in batch.reqs if s.samples], a.next_token_ids):
            s.req.output_ids.append(tok)
            if len(s.req.output_ids) >= 6:
                policy.finish(s.req)
    assert len(tokens["local"]) == 12
    assert reqs[0].output_ids == reqs[1].output_ids  # same prompt, greedy
    assert local.cache_stats()[1] == remote.cache_stats()[1] == 1  # one encoder miss each: the image once
    assert local._held == remote._held == {}  # embeddings are dropped once a prompt's KV exists


def test_kv_pool_sizing() -> None:
    from tessera.cache.kv_pool import CPU_KV_MIN_TOKENS, kv_pool_tokens

    gib = 2**30
    args = ServerArgs(model_path="demo-vl", page_size=16)
    # CPU: the weights' bytes of KV (1 GiB at 1 KiB a token), within what 64 requests of 32k tokens can use...
    assert kv_pool_tokens(args, 1024, None, weight_bytes=gib, context_length=32768) == 1 << 20
    assert kv_pool_tokens(args.replace(max_running_requests=4), 1024, None, gib, 32768) == 4 * 32768
    # ... but never under one full-length request, nor the floor for tiny models.
    assert kv_pool_tokens(args, 1024, None, weight_bytes=2**20, context_length=32768) == 32768
    assert kv_pool_tokens(args, 1024, None, weight_bytes=2**20, context_length=4096) == CPU_KV_MIN_TOKENS
    assert kv_pool_tokens(args.replace(max_total_tokens=1000), 1024, None, gib, 4096) == 992  # the flag wins
    # 80 GiB device, 20 GiB in use after the weights, 0.85 of it for weights + KV: 48 GiB of KV.
    tokens = kv_pool_tokens(args, 1 << 20, (60 * gib, 80 * gib))
    assert tokens == 48 * 1024 and tokens % 16 == 0
    assert kv_pool_tokens(args.replace(max_total_tokens=1000), 1 << 20, (60 * gib, 80 * gib)) == 992  # flag wins
    with pytest.raises(ValueError, match="mem_fraction_static"):
        kv_pool_tokens(args.replace(mem_fraction_static=0.2), 1 << 20, (60 * gib, 80 * gib))


def test_worker_applies_slot_writes_in_order_when_a_row_is_written_twice() -> None:
    """A slot-table row freed and given to another request between two steps is written twice in one
    message (a range write, then the decode batch's token write): the later write must win."""
    from types import SimpleNamespace

    from tessera.messages.worker import SlotWrite, TokenSlotWrites
    from tessera.worker.slot_writes import apply_slot_writes, slot_write_parts

    writes = [SlotWrite(1, 0, torch.tensor([5, 6, 7])), SlotWrite(2, 0, torch.tensor([8, 9])),
              TokenSlotWrites(torch.tensor([2, 1]), torch.tensor([2, 1]), torch.tensor([10, 11]))]
    want = torch.zeros(4, 8, dtype=torch.int64)
    for w in writes:  # one by one, in order
        want.index_put_(w.positions(), w.slots)
    assert want[1, :3].tolist() == [5, 11, 7] and want[2, :3].tolist() == [8, 9, 10]
    for ws in (writes, writes[1:]):  # rows written twice (in order, one write at a time), then once (one scatter)
        fi = SimpleNamespace(slot_writes=ws)
        table = torch.zeros(4, 8, dtype=torch.int64)
        apply_slot_writes(table, fi, slot_write_parts(fi))
        expected = want.clone() if ws is writes else torch.zeros(4, 8, dtype=torch.int64).index_put_(
            (torch.tensor([2, 2, 2, 1]), torch.tensor([0, 1, 2, 1])), torch.tensor([8, 9, 10, 11]))
        assert torch.equal(table, expected)
    # A prefill step's admissions: each row's cached prefix, then its new tokens (no entry twice: one scatter).
    ws = [SlotWrite(1, 0, torch.tensor([5, 6])), SlotWrite(1, 2, torch.tensor([7])), SlotWrite(3, 0, torch.tensor([9]))]
    table = torch.zeros(4, 8, dtype=torch.int64)
    apply_slot_writes(table, SimpleNamespace(slot_writes=ws), slot_write_parts(SimpleNamespace(slot_writes=ws)))
    assert table[1, :3].tolist() == [5, 6, 7] and table[3, 0] == 9



def test_cpu_encoder_runs_in_chunks_with_the_thread_policy_between(tmp_path) -> None:
    """With a thread policy attached (the scheduler's, on a CPU), a prefill step's images are encoded a few at
    a time, the policy asked before every chunk and once more before the language model, and the embeddings
    equal one encoder call over all of them."""
    from PIL import Image

    from tessera.frontend.model_info import ModelInfo
    from tessera.worker.model_worker import CPU_ENCODE_CHUNK, ModelWorker

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=4096, max_running_requests=4)
    info = ModelInfo.load(args)
    count = CPU_ENCODE_CHUNK + 3
    rng = torch.Generator().manual_seed(0)
    paths = []
    for i in range(count):
        pixels = torch.randint(0, 256, (56 + 28 * (i % 4), 56 + 28 * (i % 3), 3), generator=rng, dtype=torch.uint8)
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(pixels.numpy()).save(paths[-1])
    out = process_chat(info, [{"type": "image"}] * count, paths)
    items = out.mm_inputs.items
    assert len({it.hash for it in items}) == count
    worker = ModelWorker(args, {2}, info.config)
    with torch.inference_mode():
        whole = worker.encoders[Modality.IMAGE](items)
    sizes: list[int] = []
    inner = worker.encoders[Modality.IMAGE]
    worker.encoders = {Modality.IMAGE: lambda its: sizes.append(len(its)) or inner(its)}
    asked: list[list[int]] = []
    worker.between_phases = lambda: asked.append(list(sizes))  # what had been encoded when asked

    alloc = PagedTokenAllocator(4096, 1)
    policy = SchedulePolicy(KVManager(ReqToTokenPool(5, 2048), alloc, RadixCache(alloc, 1), 1), 4, 4096)
    req = Req("r", list(out.input_ids), SamplingParams(max_new_tokens=2, temperature=0), out.mm_inputs)
    policy.add(req)
    batch = policy.next_batch()
    worker.execute(build_forward_input(batch, info.config.family.model_class(), info.config, policy.kv))
    assert sizes == [CPU_ENCODE_CHUNK, 3]
    assert asked == [[], [CPU_ENCODE_CHUNK], [CPU_ENCODE_CHUNK, 3]]  # before each chunk, then before the LM
    for item, emb in zip(items, whole):
        torch.testing.assert_close(worker.encoder_cache.get(item.hash), emb, rtol=1e-5, atol=1e-5)
