"""The LoRA products against a plain per-row reference: the grouped and stacked torch paths (any machine) and
the Triton kernels (on the GPU, or under TRITON_INTERPRET=1 in a subprocess on a CPU); and the scheduler's slot
table (LRU eviction, admission by adapter)."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.lora.slots import LoraSlots, LoraStep
from tests.kernel_device import DEVICE, IN_INTERPRETER, RUNS_KERNELS, run_interpreted

SHARDS = [24, 8, 8]  # a merged QKV: q, k, v rows
IN = 40


def _stacks(dtype=torch.float32, device=DEVICE, kernels=False):
    """4 slots: three adapters of ranks 4, 2, 3 (some shards untargeted) and an empty slot; per slot the
    reference (A_s, B_s) per shard."""
    gen = torch.Generator().manual_seed(0)
    step = LoraStep(dtype=dtype, kernels=kernels)
    slots = LoraSlots(step, 4, IN, SHARDS, dtype, device)
    slots.ensure_rank(2)
    slots.ensure_rank(4)  # grown after creation: kept blocks move
    ref = {}
    for slot, (rank, targeted) in enumerate([(4, [1, 1, 1]), (2, [1, 0, 1]), (3, [0, 1, 0])]):
        pairs = [(torch.randn(rank, IN, generator=gen), torch.randn(size, rank, generator=gen)) if t else None
                 for size, t in zip(SHARDS, targeted)]
        slots.place(slot, pairs)
        ref[slot] = pairs
    return step, slots, ref


def _reference(x, y, row_slots, ref):
    out = y.clone().double()
    for t, slot in enumerate(row_slots):
        if slot < 0 or slot not in ref:
            continue
        parts = [torch.zeros(size, dtype=torch.float64) if p is None else p[1].double() @ (p[0].double() @ x[t].double())
                 for size, p in zip(SHARDS, ref[slot])]
        out[t] += torch.cat(parts)
    return out


@pytest.mark.parametrize("req_slots,lens", [
    ([0, 1, 2, -1, 0, 3], [1] * 6),  # a decode batch over three adapters, the base and an empty slot: stacked
    ([1, -1, 0, 1], [5, 3, 7, 2]),  # prefill chunks: grouped, one adapter's requests apart (gathered)
    ([2, 2], [4, 1]),  # one adapter: one slice
])
def test_torch_paths_match_reference(req_slots, lens):
    step, slots, ref = _stacks(device=torch.device("cpu"))
    step.set_rows(req_slots, lens, torch.device("cpu"))
    n = sum(lens)
    x, y = torch.randn(n, IN), torch.randn(n, sum(SHARDS))
    row_slots = [s for s, k in zip(req_slots, lens) for _ in range(k)]
    want = _reference(x, y, row_slots, ref)
    got = slots(x, y.clone())
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)


def test_slot_table_lru_and_admission():
    from tessera.messages.sampling import SamplingParams
    from tessera.messages.worker import ForwardInput
    from tessera.scheduler.batch import ScheduledBatch, ScheduledReq
    from tessera.scheduler.lora_slots import LoraSlotTable
    from tessera.scheduler.req import Req

    def req(name):
        return Req(f"r{name}", [1, 2], SamplingParams(), None, lora_name=name)

    def step(table, names):
        batch = ScheduledBatch()
        batch.reqs = [ScheduledReq(req(n), 0, 1, torch.zeros(1, dtype=torch.int64)) for n in names]
        fi = ForwardInput([s.req.rid for s in batch.reqs], torch.zeros(0), torch.zeros(0), torch.zeros(0), [], [], [], [],
                          [], [], [])
        table.fill(fi, batch)
        return fi.lora_slots, fi.lora_loads

    table = LoraSlotTable(2)
    assert step(table, ["a", None, "b"]) == ([0, -1, 1], [(0, "a"), (1, "b")])
    assert step(table, ["b"]) == ([1], [])  # placed: no copy
    assert step(table, ["c", "b"]) == ([0, 1], [(0, "c")])  # a was least recently used
    assert step(table, [None]) == (None, [])
    running = [req("c"), req("b")]
    assert table.fits(req("b"), running) and table.fits(req(None), running) and not table.fits(req("d"), running)
    assert Req("x", [1, 2], SamplingParams(), None, lora_name="a").cache_key() != \
        Req("x", [1, 2], SamplingParams(), None, lora_name="b").cache_key() != [1, 2]


@pytest.mark.cuda
@pytest.mark.skipif(RUNS_KERNELS, reason="the kernels run in this process")
def test_kernels_under_the_triton_interpreter():
    out = run_interpreted(__file__, "-k", "kernels_match")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_reference(dtype):
    step, slots, ref = _stacks(dtype, DEVICE, kernels=True)
    req_slots, lens = [0, 1, 2, -1, 0, 3, 1], [1, 1, 3, 2, 1, 1, 2]
    step.set_rows(req_slots, lens, DEVICE)
    n = sum(lens)
    x, y = torch.randn(n, IN), torch.randn(n, sum(SHARDS))
    want = _reference(x, y, [s for s, k in zip(req_slots, lens) for _ in range(k)], ref)
    got = slots(x.to(DEVICE, dtype), y.to(DEVICE, dtype).clone()).double().cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol * 10, rtol=tol), (got - want).abs().max()
    assert IN_INTERPRETER or DEVICE.type == "cuda"
    # As a decode CUDA graph runs them: the rows' slots from a static buffer alone (no groups from the host)
    step.clear()
    row_slots = torch.tensor([s for s, k in zip(req_slots, lens) for _ in range(k)], device=DEVICE)
    with step.decode_graph(row_slots, 4):
        got = slots(x.to(DEVICE, dtype), y.to(DEVICE, dtype).clone()).double().cpu()
    assert torch.allclose(got, want, atol=tol * 10, rtol=tol), (got - want).abs().max()
    assert step.groups is None and step.row_slots is None and not step.graph  # left as it was


def test_fixed_stacks_stay_put_and_refuse_higher_ranks(tmp_path):
    """Before decode graphs are captured every language-model linear gets its stacks at a fixed rank: loading
    and placing adapters afterwards writes into the same memory (what a graph replays), and an adapter of a
    higher rank is refused, naming the flag."""
    import transformers

    from tessera.layers.linear import Linear
    from tessera.layers.lora import AdapterError
    from tessera.layers.lora.manager import LoraManager
    from tessera.models.registry import load_model
    from tests.lora.lora_testing import make_adapter, make_text_checkpoint

    path = make_text_checkpoint(tmp_path / "base", "qwen2")
    model, config = load_model(path, torch.float32)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path)
    lora = LoraManager(model, type(model).weight_mapping(config), 2, None, torch.float32, torch.device("cpu"))
    lora.add("small", make_adapter(hf, tmp_path / "small", seed=1, r=2, targets=["q_proj"]))
    lora.fix_stacks(4)
    stacks = {n: m.lora for n, m in model.named_modules() if isinstance(m, Linear) and n.startswith("model.")}
    assert len(stacks) == 4 * config.num_layers and all(s is not None and s.rank == 4 for s in stacks.values())
    where = {n: (s.A.data_ptr(), s.Bt.data_ptr()) for n, s in stacks.items()}
    lora.add("four", make_adapter(hf, tmp_path / "four", seed=2, r=4, targets=["v_proj", "down_proj"]))
    lora.place(0, "four")
    lora.place(1, "small")
    assert {n: (s.A.data_ptr(), s.Bt.data_ptr()) for n, s in stacks.items()} == where
    assert stacks["model.layers.0.mlp.down_proj"].A[0].abs().sum() > 0
    with pytest.raises(AdapterError, match="rank 8 is above 4, .*--max-lora-rank"):
        lora.add("big", make_adapter(hf, tmp_path / "big", seed=3, r=8, targets=["q_proj"]))
    assert "big" not in lora.adapters
