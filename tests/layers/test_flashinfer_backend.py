"""The FlashInfer backend without a GPU: its device-built kv_indptr/kv_indices against a plain reading of the
slot table; its output, through a stand-in `flashinfer` module whose wrappers compute FlashInfer's attention
from the planned indptr/indices/masks/windows alone (tests/layers/flashinfer_fake.py), against torch_native
on random traffic; the order and arguments of its plan()/run() calls (plan once per step and layer kind, run
per layer, graph-mode decode planned outside the capture over static buffers); auto's choice of backend."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tessera.layers.attention import get_attention_backend, resolve_attention_backend
from tessera.layers.attention import flashinfer_backend as fib
from tessera.worker.cuda_graph import DecodeBuffers, DecodeInputs
from tests.layers import test_attention_backend as ref_module
from tests.layers.flashinfer_fake import fake_flashinfer
from tests.layers.test_attention_backend import HEAD_DIM, make_case
from tests.layers.test_triton_attention import CASES, _span_masks

SCALE = HEAD_DIM**-0.5


@pytest.fixture
def fake(monkeypatch):
    """The stand-in module in sys.modules; float32 allowed (the stand-in computes in float32 on the CPU, where
    torch_native's float32 output is the exact reference); a small workspace."""
    mod, rec = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fib.FlashInferAttentionBackend, "dtypes", frozenset({torch.float32, torch.float16}))
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(fib, "_capturing", lambda t: rec.capturing)
    monkeypatch.setattr(ref_module, "MAX_CTX", 48)
    return rec


def _qkv(fb, g, num_heads, num_kv_heads):
    t = int(fb.extend_lens.sum())
    return (torch.randn(t, num_heads, HEAD_DIM, generator=g), torch.randn(t, num_kv_heads, HEAD_DIM, generator=g),
            torch.randn(t, num_kv_heads, HEAD_DIM, generator=g))


def test_kv_indices_equal_a_plain_reading_of_the_slot_table() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_rows, width = 9, int(torch.randint(1, 40, (1,), generator=g))
        req_to_token = torch.randint(0, 1000, (num_rows, width), generator=g)
        b = int(torch.randint(1, 7, (1,), generator=g))
        rows = torch.randperm(num_rows, generator=g)[:b]
        lens = torch.randint(1, width + 1, (b,), generator=g)
        indptr = torch.full((b + 1,), -7, dtype=torch.int32)
        indices = torch.full((int(lens.sum()) + 1 + trial % 3,), -7, dtype=torch.int32)  # room past the end
        fib.fill_kv_indices(req_to_token, rows, lens, min(int(lens.max()) + trial % 2, width), indptr, indices)
        want = [int(req_to_token[r, j]) for r, n in zip(rows.tolist(), lens.tolist()) for j in range(n)]
        assert indptr.tolist() == [0] + torch.cumsum(lens, 0).tolist()
        assert indices[:len(want)].tolist() == want
        assert all(x == -7 for x in indices[len(want):-1].tolist())  # only the last element takes the overflow


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
def test_matches_torch_native(fake, heads, case, window) -> None:
    num_heads, num_kv_heads = heads
    seq_lens, ext_lens, spans = CASES[case]
    masks = _span_masks(seq_lens, ext_lens, spans) if spans else None
    outs = []
    for name in ("torch_native", "flashinfer"):
        pool, fb, g = make_case(seq_lens, ext_lens, num_kv_heads, masks=masks, seed=3)
        q, k, v = _qkv(fb, g, num_heads, num_kv_heads)
        backend = get_attention_backend(name)
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, 0, fb, pool, SCALE, window))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
    decode = all(e == 1 for e in ext_lens) and not spans
    (_, wrapper), = fake.of("init")
    assert type(wrapper).__name__ == ("BatchDecodeWithPagedKVCacheWrapper" if decode else
                                      "BatchPrefillWithPagedKVCacheWrapper")
    assert not wrapper.use_cuda_graph and wrapper.use_tensor_cores == (decode and num_heads // num_kv_heads >= 4)
    (_, _, planned), = fake.of("plan")
    assert planned["window_left"] == (window - 1 if window else -1) and planned["sm_scale"] == SCALE
    if not decode:
        assert planned["causal"] == (masks is None) and (planned["custom_mask"] is None) == (masks is None)


def test_plan_once_per_step_and_kind_run_per_layer(fake) -> None:
    """Four layers alternating a window and none (Gemma-3's pattern): two wrappers, each planned once per step
    with its window, runs in layer order; a new step plans again; masks go to plan() for the whole batch."""
    seq_lens, ext_lens, spans = CASES["span_masks"]
    masks = _span_masks(seq_lens, ext_lens, spans)
    backend = get_attention_backend("flashinfer")
    ref = get_attention_backend("torch_native")
    for step in range(2):
        pool, fb, g = make_case(seq_lens, ext_lens, 2, masks=masks, seed=step)
        q, k, v = _qkv(fb, g, 4, 2)
        backend.init_forward_metadata(fb)
        for layer, window in enumerate([None, 5, None, 5]):
            out = backend.forward(q, k, v, 0, fb, pool, SCALE, window)
            torch.testing.assert_close(out, ref.forward(q, k, v, 0, fb, pool, SCALE, window), atol=2e-5, rtol=0)
    assert [c[0] for c in fake.calls] == ["init", "plan", "run", "init", "plan", "run", "run", "run"] + \
        ["plan", "run", "plan", "run", "run", "run"]
    plans = fake.of("plan")
    assert [p[2]["window_left"] for p in plans] == [-1, 4, -1, 4]
    assert plans[0][1] is plans[2][1] and plans[1][1] is plans[3][1]  # wrappers are kept across steps
    # One mask for all requests: the masked ones as given, the causal one spelled out.
    want = torch.cat([((torch.arange(s)[None] <= torch.arange(s - e, s)[:, None]) if m is None else m).reshape(-1)
                      for m, s, e in zip(masks, seq_lens, ext_lens)])
    assert all(torch.equal(p[2]["custom_mask"], want) and p[2]["causal"] is False for p in plans)
    runs = fake.of("run")
    assert [r[1] for r in runs[:4]] == [plans[0][1], plans[1][1], plans[0][1], plans[1][1]]


def test_forward_plans_without_init_forward_metadata(fake) -> None:
    pool, fb, g = make_case([7, 3], [2, 1], 2, seed=1)
    q, k, v = _qkv(fb, g, 4, 2)
    out = get_attention_backend("flashinfer").forward(q, k, v, 0, fb, pool, SCALE)
    want = get_attention_backend("torch_native").forward(q, k, v, 0, fb, pool, SCALE)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    assert [c[0] for c in fake.calls] == ["init", "plan", "run"]


def _graph_step(backend, buffers, bucket, req_to_token, pool, layers, host_lens):
    """What DecodeGraphRunner does for one bucket: plan outside the graph, then the model's forward over a
    fresh ForwardBatch on the same static inputs."""
    backend.plan_graph_decode(buffers.batch(bucket, req_to_token), buffers.max_bs, host_lens)
    fb = buffers.batch(bucket, req_to_token)
    backend.init_forward_metadata(fb)
    return [backend.forward(q, k, v, 0, fb, pool, SCALE, w) for q, k, v, w in layers]


def test_graph_decode_planned_outside_the_capture_over_static_buffers(fake) -> None:
    """Warm-up (kinds learned, planned on the spot), warm-up, capture (nothing planned: a plan() while
    fake.capturing fails), then replays of new steps: planned before each, run from the static buffers,
    equal to torch_native over the same requests; the buffers of buckets 4 and 2 are views of one set."""
    seq_lens = [9, 30, 4]
    pool, fb, g = make_case(seq_lens, [1, 1, 1], 2, seed=5)
    pad_row = 6  # make_case's requests use rows 5, 1, 7
    req_to_token = fb.req_to_token.clone()
    req_to_token[pad_row] = 0
    buffers = DecodeBuffers(max_bs=4, mrope=True, pad_row=pad_row, device=torch.device("cpu"))
    backend = get_attention_backend("flashinfer")
    layers = [(*_qkv(buffers.batch(4, req_to_token), g, 4, 2), w) for w in (None, 3)]
    for _ in range(2):
        _graph_step(backend, buffers, 4, req_to_token, pool, layers, [1] * 4)
    assert [c[0] for c in fake.calls] == ["init", "plan", "run", "init", "plan", "run"] + ["plan", "plan", "run", "run"]
    fake.capturing = True
    captured = len(fake.calls)
    fb4 = buffers.batch(4, req_to_token)
    backend.init_forward_metadata(fb4)
    for q, k, v, w in layers:
        backend.forward(q, k, v, 0, fb4, pool, SCALE, w)
    assert [c[0] for c in fake.calls[captured:]] == ["run", "run"]
    with pytest.raises(RuntimeError, match="capturing"):  # a kind first seen inside the capture
        backend.forward(*layers[0][:3], 0, fb4, pool, SCALE, 2)
    fake.capturing = False
    ref = get_attention_backend("torch_native")
    for bs, bucket in ((3, 4), (2, 2)):
        lens = torch.tensor(seq_lens[:bs])
        rows = fb.req_pool_indices[:bs]
        buffers.load(DecodeInputs(torch.zeros(bs, dtype=torch.long), torch.zeros(3, bs, dtype=torch.long),
                                  req_to_token[rows, lens - 1], rows, lens), bucket)
        host = seq_lens[:bs] + [1] * (bucket - bs)
        before = len(fake.of("plan"))
        q, k, v = _qkv(buffers.batch(bucket, req_to_token), g, 4, 2)
        got = _graph_step(backend, buffers, bucket, req_to_token, pool, [(q, k, v, None), (q, k, v, 3)], host)
        assert len(fake.of("plan")) == before + 2
        _, eager_fb, _ = make_case(seq_lens[:bs], [1] * bs, 2, seed=5)
        for out, w in zip(got, (None, 3)):
            want = ref.forward(q[:bs], k[:bs], v[:bs], 0, eager_fb, pool, SCALE, w)
            torch.testing.assert_close(out[:bs], want, atol=2e-5, rtol=0)
    graph_wrappers = [c[1] for c in fake.of("init") if c[1].use_cuda_graph]
    assert len(graph_wrappers) == 4  # (bucket 4, bucket 2) x (no window, window 3)
    ptrs = {(w.buffers[0].untyped_storage().data_ptr(), w.buffers[1].data_ptr(),
             w.buffers[2].untyped_storage().data_ptr()) for w in graph_wrappers}
    assert len(ptrs) == 1  # every bucket's wrappers over the same static buffers


@pytest.mark.slow  # two demo-vl workers driven through a schedule: ~20 s of CPU
def test_padded_runner_forward_plans_each_step(fake, monkeypatch) -> None:
    """DecodeGraphRunner (not captured) through the worker on real scheduler steps with a stand-in flashinfer:
    logits equal the eager worker's, and each padded step planned through plan_graph_decode."""
    from tests.worker.test_cuda_graph import run_padded_against_eager

    calls = []
    real = fib.FlashInferAttentionBackend.plan_graph_decode
    monkeypatch.setattr(fib.FlashInferAttentionBackend, "plan_graph_decode",
                        lambda self, fb, max_bs, host=None: (calls.append(host), real(self, fb, max_bs, host))[1])
    sizes, outputs = run_padded_against_eager("flashinfer", with_image=False)
    assert len(calls) == len(sizes) and 3 in sizes
    assert all(h is not None and len(h) in (1, 2, 4) for h in calls)
    # Speculative verify steps: decode rows sharing their request's table row, planned the same way.
    calls.clear()
    sizes, with_drafts = run_padded_against_eager("flashinfer", with_image=False, drafts=outputs)
    assert with_drafts == outputs and len(calls) == len(sizes) and max(sizes) > 4


def test_auto_keeps_triton_on_cuda_even_when_flashinfer_is_importable(monkeypatch) -> None:
    """FlashInfer is chosen by name only, until it has run on a GPU (issue 48)."""
    real = importlib.util.find_spec
    for have_flashinfer, have_triton, dtype, want in [
            (True, True, None, "triton"), (True, True, torch.bfloat16, "triton"),
            (True, True, torch.float32, "triton"), (False, True, torch.float16, "triton"),
            (True, False, torch.bfloat16, "torch_native"), (False, False, None, "torch_native")]:
        present = {"flashinfer": have_flashinfer, "triton": have_triton}

        def find_spec(name, *args, present=present):  # any spec stands for an installed package
            return (real("torch") if present[name] else None) if name in present else real(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        assert resolve_attention_backend("auto", "cuda", dtype) == want
        assert resolve_attention_backend("auto", "cpu", dtype) == "torch_native"
        assert resolve_attention_backend("flashinfer", "cpu") == "flashinfer"


def test_missing_flashinfer_and_float32_are_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as when not installed
    with pytest.raises(ImportError, match=r"tessera\[cuda\]"):
        get_attention_backend("flashinfer")
    mod, _ = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tessera.models.registry import load_model

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM._from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_backend='flashinfer' runs .*bfloat16.*float32"):
        load_model(tmp_path, torch.float32, attention_backend="flashinfer")
