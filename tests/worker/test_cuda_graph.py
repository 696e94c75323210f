"""Decode CUDA graphs without a GPU: bucket choice, the static buffers' layout and padding, and the padded
forward that a graph captures (run eagerly) against the worker's ordinary forward on real scheduler steps.

The same comparison runs with the Triton backend under TRITON_INTERPRET=1 (in a subprocess), whose
decode plan for these batches is built from device tensors alone: that is the path a graph replays.
On a CUDA machine the last test captures the graphs and compares replayed logits to eager ones."""

from __future__ import annotations

import contextlib
import logging
import tempfile

import pytest
import torch

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.config import ServerArgs
from tessera.messages.sampling import SamplingParams
from tessera.scheduler.kv_manager import KVManager
from tessera.scheduler.policy import SchedulePolicy
from tessera.scheduler.req import Req
from tessera.scheduler.speculative import Speculator, accepted_prefix
from tessera.platform.device import platform_of
from tessera.scheduler.step_input import build_forward_input
from tessera.cache.kv_pool import TokenToKVPool
from tessera.worker.cuda_graph import (
    DecodeBuffers,
    DecodeGraphRunner,
    DecodeInputs,
    capture_batch_sizes,
    pick_bucket,
)

from tests.kernel_device import DEVICE, HAS_CUDA, IN_INTERPRETER, RUNS_KERNELS, run_interpreted
from tests.processed_chat import scene_question


def test_capture_batch_sizes_and_buckets() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(64)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert [pick_bucket(n, sizes) for n in (1, 3, 5, 8, 9, 33, 64)] == [1, 4, 8, 8, 16, 40, 64]
    assert pick_bucket(65, sizes) is None and pick_bucket(0, sizes) is None
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def _inputs(bs: int, base: int, mrope: bool) -> DecodeInputs:
    n = torch.arange(bs) + base
    return DecodeInputs(input_ids=n + 100, positions=torch.stack([n, n + 1, n + 2]) if mrope else n,
                        out_cache_loc=n + 200, req_pool_indices=n % 5, seq_lens=n + 300)


@pytest.mark.parametrize("mrope", [False, True])
def test_buffers_pad_every_row_past_the_batch(mrope) -> None:
    buf = DecodeBuffers(max_bs=8, mrope=mrope, pad_row=7, device=torch.device("cpu"))
    buf.load(_inputs(6, 10, mrope), bucket=8)  # a larger step first: its rows must not leak into the next
    buf.load(_inputs(3, 20, mrope), bucket=4)
    fb = buf.batch(4, torch.zeros(8, 16, dtype=torch.int64))
    assert fb.decode_only and fb.host_seq_lens is None  # planned from device tensors alone
    assert fb.input_ids.tolist() == [120, 121, 122, 0]
    assert fb.out_cache_loc.tolist() == [220, 221, 222, 0]  # padding writes the dummy slot
    assert fb.req_pool_indices.tolist() == [0, 1, 2, 7]  # padding reads through the pad row
    assert fb.seq_lens.tolist() == [320, 321, 322, 1] and fb.extend_lens.tolist() == [1] * 4
    assert fb.logits_indices.tolist() == [0, 1, 2, 3]
    assert fb.extend_start_loc.tolist() == [0, 1, 2, 3] and fb.prefix_lens.tolist() == [319, 320, 321, 0]
    want_pos = [[20, 21, 22, 0], [21, 22, 23, 0], [22, 23, 24, 0]] if mrope else [20, 21, 22, 0]
    assert fb.positions.tolist() == want_pos
    # The buffers are shared: a batch over a bucket is a view, so a graph captured over it sees new steps.
    assert fb.input_ids.data_ptr() == buf.input_ids.data_ptr()


class _FakeCuda:
    """torch.cuda's capture API without a GPU: torch.cuda.graph raises on the `fail_at`-th capture, as a
    capture does when the model does something a graph cannot hold."""

    def __init__(self, monkeypatch, fail_at: int):
        self.captures = 0
        # Like torch's, the stand-ins refuse what is not theirs: a stream waits only on a stream, and a capture
        # takes a CUDAGraph, the pool handle and a stream (not None: the runner captures on a side stream).
        self.pool = ("pool",)
        fake = self

        class Stream:
            def wait_stream(self, other) -> None:
                if not isinstance(other, Stream):
                    raise TypeError(f"wait_stream expects a Stream, got {type(other).__name__}")

        class CUDAGraph:
            pass

        self.Stream, self.CUDAGraph, stream = Stream, CUDAGraph, Stream()
        for name, value in {"graph_pool_handle": lambda: fake.pool, "Stream": Stream,
                            "current_stream": lambda: stream, "stream": self.stream,
                            "CUDAGraph": CUDAGraph, "synchronize": lambda *a: None, "graph": self.graph}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        self.fail_at = fail_at

    def stream(self, s):
        if not isinstance(s, self.Stream):
            raise TypeError(f"torch.cuda.stream expects a Stream, got {type(s).__name__}")
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        if not isinstance(graph, self.CUDAGraph) or pool is not self.pool or not isinstance(stream, self.Stream):
            raise TypeError(f"torch.cuda.graph({graph!r}, pool={pool!r}, stream={stream!r})")
        self.captures += 1
        if self.captures == self.fail_at:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
        yield


def test_a_failed_capture_is_an_error_with_its_reason_and_keeps_no_graphs(monkeypatch, caplog) -> None:
    fake = _FakeCuda(monkeypatch, fail_at=2)  # the largest bucket captures, the next one fails
    req_to_token = torch.zeros(4, 16, dtype=torch.int64)
    runs = []

    def model(fb, pool):
        runs.append(fb.batch_size)
        return torch.zeros(fb.batch_size, 8)

    runner = DecodeGraphRunner(model, TokenToKVPool(8, 1, 1, 4), req_to_token, [1, 2, 4], pad_row=3, mrope=False,
                               platform=platform_of("cuda"))  # its capture API faked above
    with caplog.at_level(logging.INFO, logger="tessera.worker"):
        reason = runner.try_capture()
    assert reason is not None and reason.startswith("decode batch size 2: RuntimeError: CUDA error: operation not")
    assert "\n" not in reason and "more detail" in reason
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and reason in errors[0].getMessage() and errors[0].exc_info is not None
    assert fake.captures == 2 and runs == [4, 4, 4, 2, 2]  # two warm-up runs before each capture
    assert not runner.captured and runner.outputs == {}  # bucket 4's graph is dropped too
    fake.fail_at = 0
    assert runner.try_capture() is None and sorted(runner.graphs) == [1, 2, 4]


def test_a_miscompiled_model_fails_the_capture_before_any_graph(monkeypatch) -> None:
    """torch.compile's output is checked against the model's on the padding batch before capturing: logits that
    differ (here the compiled function adds 1) fail the capture, naming torch.compile, so the worker recaptures
    without it (capture_decode_graphs)."""
    fake = _FakeCuda(monkeypatch, fail_at=0)
    runs = []

    def model(fb, pool):
        runs.append(fb.batch_size)
        return torch.arange(fb.batch_size * 8, dtype=torch.float32).view(fb.batch_size, 8)

    runner = DecodeGraphRunner(model, TokenToKVPool(8, 1, 1, 4), torch.zeros(4, 16, dtype=torch.int64), [1, 2, 4],
                               pad_row=3, mrope=False, platform=platform_of("cuda"), compile_max_bs=2)
    monkeypatch.setattr(DecodeGraphRunner, "_model_for",
                        lambda self, bucket: (lambda fb, pool: model(fb, pool) + (bucket <= 2)))
    reason = runner.try_capture()
    assert reason is not None and "torch.compile's logits differ from the model's at batch 1" in reason
    assert fake.captures == 0 and not runner.captured
    runner.compile_max_bs = 0  # what capture_decode_graphs does next
    assert runner.try_capture() is None and sorted(runner.graphs) == [1, 2, 4]


def test_the_worker_reports_why_it_has_no_graphs(monkeypatch, caplog) -> None:
    from tessera.frontend.model_info import ModelInfo
    from tessera.models.config import eos_token_ids
    from tessera.worker.model_worker import ModelWorker

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=512, max_running_requests=4, device="cpu",
                                 attention_backend="triton")
    info = ModelInfo.load(args)
    worker = ModelWorker(args, eos_token_ids(info.config), info.config)
    assert worker.graph_runner is None and worker.info.cuda_graph_status == "off: device cpu"
    assert worker.info.cuda_graph_batch_sizes == ()
    # As on a GPU whose capture fails: the worker decodes eagerly and says why.
    fake = _FakeCuda(monkeypatch, fail_at=1)

    def capture(runner) -> None:
        runner._capturing = runner.sizes[-1]
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=fake.pool, stream=torch.cuda.Stream()):
            pass

    monkeypatch.setattr(DecodeGraphRunner, "capture", capture)
    worker.device = torch.device("cuda", 0)
    worker.platform = platform_of(worker.device)
    with caplog.at_level(logging.ERROR, logger="tessera.worker"):
        assert worker._capture_decode_graphs("triton") is None
    assert worker.cuda_graph_status.startswith("capture failed, decode runs eagerly: decode batch size 4: "
                                               "RuntimeError: CUDA error"), worker.cuda_graph_status
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    worker.args = args.replace(disable_cuda_graph=True)
    assert worker._capture_decode_graphs("triton") is None and worker.cuda_graph_status == "off: --disable-cuda-graph"


def _policy(max_running: int) -> SchedulePolicy:
    alloc = PagedTokenAllocator(2048, 4)
    kv = KVManager(ReqToTokenPool(max_running + 1, 512), alloc, RadixCache(alloc, 4), 4)
    return SchedulePolicy(kv, max_running, chunked_prefill_size=64)


def _requests(info, with_image: bool = True) -> list[Req]:
    """An image request (M-RoPE positions continue with a delta when it decodes) and text requests of
    different lengths, finishing at different steps so that decode batches of 4, 3, 2 and 1 occur."""
    reqs = []
    if with_image:
        image = scene_question(info)
        reqs.append(Req("img", list(image.input_ids), SamplingParams(max_new_tokens=7, temperature=0),
                        image.mm_inputs))
    tok = info.tokenizer
    for i, (text, n) in enumerate([("a red circle", 5), ("two blue squares and a triangle", 3), ("hi", 6)]):
        # Under Triton's interpreter a prompt token costs ~0.1 s (a program per token and layer): no template.
        prompt = text if IN_INTERPRETER else info.apply_chat_template([{"role": "user", "content": text}])
        ids = tok(prompt)["input_ids"]
        reqs.append(Req(f"t{i}", list(ids), SamplingParams(max_new_tokens=n, temperature=0), None))
    return reqs


def _apply_greedy_step(policy, batch, logits: torch.Tensor) -> None:
    """What the scheduler does after a step: cache the prefilled prompt, append each sampling row's greedy
    token (a verify step's up to its first rejected draft, freeing the rest), finish requests at their
    max_new_tokens."""
    for s in batch.reqs:
        if s.is_prefill:
            policy.kv.cache_prefill(s.req)
    tokens = logits.argmax(-1).tolist()
    for s in [s for s in batch.reqs if s.samples]:
        mine, tokens = tokens[:1 + len(s.draft)], tokens[1 + len(s.draft):]
        if s.draft:
            mine = mine[:accepted_prefix(s.draft, mine) + 1]
            policy.kv.truncate(s.req, s.start + len(mine))
        for tok in mine:
            s.req.output_ids.append(tok)
            if len(s.req.output_ids) >= s.req.sampling_params.max_new_tokens:
                held = s.req.kv_len
                s.req.kv_len = min(held, s.req.seq_len)
                policy.finish(s.req, allocated_len=held)
                break


class _RecordedDrafts:
    """Drafts from a recorded run's outputs, every third token wrong: verify steps accept and reject."""

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = {rid: [t + 1 if i % 3 == 1 else t for i, t in enumerate(out)] for rid, out in outputs.items()}

    def propose(self, reqs, limits):
        return [self.outputs[r.rid][len(r.output_ids):len(r.output_ids) + k] for r, k in zip(reqs, limits)]

    def release(self, rid):
        pass


def _random_adapter(tmp: str) -> str:
    """A PEFT adapter of rank 4 on every linear of demo-vl's language model, random (tessera.bench.lora)."""
    from pathlib import Path

    from tessera.bench.lora import write_random_adapter
    from tessera.config import resolve_model_path
    from tessera.models.registry import load_model

    model, _ = load_model(resolve_model_path("demo-vl"), dtype="float32", language_model_only=True)
    return str(write_random_adapter(model, Path(tmp) / "random", rank=4, seed=3, scale=0.2))


def run_padded_against_eager(attention_backend: str, with_image: bool = True,
                             device: torch.device = torch.device("cpu"),
                             drafts: dict[str, list[int]] | None = None,
                             lora_dir: str | None = None, compile_max_bs: int = 0) -> tuple[list[int], dict[str, list[int]]]:
    """Drives two workers through the same scheduler steps: one eager, one whose decode steps run the padded
    forward a graph captures (uncaptured: run eagerly). Asserts equal logits every step; returns the padded
    steps' batch sizes and the outputs. drafts: speculative decoding with these outputs (a run's, recorded) as
    drafts, every third token wrong; verify steps are decode rows, so they take the padded forward too.
    lora_dir: a folder for a random adapter; requests then use it, the bundled demo adapter and none, mixed."""
    from tessera.config import ASSETS_DIR
    from tessera.frontend.model_info import ModelInfo
    from tessera.models.config import eos_token_ids
    from tessera.scheduler.lora_slots import LoraSlotTable
    from tessera.worker.lora_step import lora_rows
    from tessera.worker.model_worker import ModelWorker

    lora = {} if lora_dir is None else dict(lora_paths=[f"random={_random_adapter(lora_dir)}",
                                                        f"unsure={ASSETS_DIR / 'lora' / 'demo-vl-unsure'}"],
                                            max_loras_per_batch=2)
    args = ServerArgs.for_engine("demo-vl", max_total_tokens=2048, max_running_requests=4, device=str(device),
                                 attention_backend=attention_backend, disable_cuda_graph=True, **lora)
    info = ModelInfo.load(args)
    eos = eos_token_ids(info.config)
    eager, padded = ModelWorker(args, eos, info.config), ModelWorker(args, eos, info.config)
    padded.use_decode_mirror = False  # as on CUDA, where graphs run
    if padded.lora is not None:
        padded.lora.fix_stacks(8)  # as before a capture
    table = LoraSlotTable(2, ["random", "unsure"]) if lora else None
    # Buckets 1, 2, 4: a batch of 3 gets a pad row (up to 16 with drafts: 4 requests x 4 verify rows).
    padded.graph_runner = padded.decode_graph_runner(max_bs=4 if drafts is None else 16)
    padded.graph_runner.compile_max_bs = compile_max_bs
    padded_sizes: list[int] = []
    runner_forward = padded.graph_runner.forward

    def spy(inputs: DecodeInputs, bucket: int) -> torch.Tensor:
        padded_sizes.append(inputs.batch_size)
        return runner_forward(inputs, bucket)

    padded.graph_runner.forward = spy  # type: ignore[method-assign]
    policy = _policy(max_running=4)
    if drafts is not None:
        policy.speculator = Speculator(_RecordedDrafts(drafts), 3, disable_batch_size=8, context_length=512)
    reqs = _requests(info, with_image)
    for r, name in zip(reqs, ["random", None, "unsure", "random"] if lora else []):
        r.lora_name = name
    for r in reqs:
        policy.add(r)
    model_class = info.config.family.model_class()
    while (batch := policy.next_batch()) is not None:
        fi = build_forward_input(batch, model_class, info.config, policy.kv)
        if table is not None:
            table.fill(fi, batch)
        with lora_rows(eager.lora, fi):
            want = eager.forward(fi)
        with lora_rows(padded.lora, fi):
            got = padded.forward(fi)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        _apply_greedy_step(policy, batch, want)
    assert all(len(r.output_ids) == r.sampling_params.max_new_tokens for r in reqs)
    assert padded.req_to_token[padded.pad_row].eq(0).all()  # the scheduler never wrote the pad row
    return padded_sizes, {r.rid: r.output_ids for r in reqs}


@pytest.mark.skipif(IN_INTERPRETER, reason="the torch_native run belongs to the parent process")
def test_padded_decode_equals_eager_decode_torch_native() -> None:
    sizes, outputs = run_padded_against_eager("torch_native")
    assert 3 in sizes and 1 in sizes, sizes  # a padded bucket (3 -> 4) and an exact one ran
    # Speculative verify steps (up to 4 requests x 4 rows, sharing their table rows) take the graphs' path too.
    sizes, with_drafts = run_padded_against_eager("torch_native", drafts=outputs)
    assert with_drafts == outputs and max(sizes) > 4, sizes


@pytest.mark.skipif(IN_INTERPRETER, reason="the torch_native run belongs to the parent process")
@pytest.mark.parametrize("stack", ["1", "0"], ids=["c_stack", "layers"])
def test_padded_decode_with_lora_equals_eager_torch_native(tmp_path, stack, monkeypatch) -> None:
    """Adapter rows in the graphs' padded forward: two adapters and the base model in one batch, each row's
    adapter read from the static row-slot buffer, against the eager worker's LoRA path: through the CPU decode
    stack, and layer by layer (the stacked product over every slot, as a graph without the kernels runs it)."""
    monkeypatch.setenv("TESSERA_DECODE_STACK", stack)
    sizes, outputs = run_padded_against_eager("torch_native", with_image=False, lora_dir=str(tmp_path))
    assert 3 in sizes and 1 in sizes, sizes
    if stack == "1":  # the adapters change the tokens (once is enough)
        _, plain = run_padded_against_eager("torch_native", with_image=False)
        assert outputs["t0"] != plain["t0"] and outputs["t1"] == plain["t1"]  # t1 ran on the base model


@pytest.mark.skipif(IN_INTERPRETER, reason="the torch_native run belongs to the parent process")
def test_padded_decode_through_torch_compile_equals_eager(monkeypatch) -> None:
    """--enable-torch-compile: the buckets up to torch_compile_max_bs run the model through torch.compile (here
    dynamo with the eager backend: the traced program, not inductor's code, which only a GPU run checks) and
    give the eager worker's logits; the larger buckets run the model itself."""
    monkeypatch.setenv("TESSERA_TORCH_COMPILE_BACKEND", "eager")
    compiled: list[int] = []
    real = DecodeGraphRunner._model_for

    def spy(self, bucket):
        model = real(self, bucket)
        if model is not self.model:
            compiled.append(bucket)
        return model

    monkeypatch.setattr(DecodeGraphRunner, "_model_for", spy)
    sizes, _ = run_padded_against_eager("torch_native", with_image=False, compile_max_bs=2)
    assert set(compiled) == {1, 2} and 3 in sizes, (compiled, sizes)  # bucket 4 (3 rows) ran uncompiled


@pytest.mark.slow  # a second interpreter process: ~12 s of CPU
@pytest.mark.cuda
@pytest.mark.skipif(RUNS_KERNELS, reason="the kernels run in this process")
def test_padded_decode_equals_eager_decode_triton_interpreted() -> None:
    out = run_interpreted(__file__, "-k", "triton_kernels")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_padded_decode_with_triton_kernels() -> None:
    sizes, outputs = run_padded_against_eager("triton", with_image=HAS_CUDA, device=DEVICE)  # interpreted: text only
    assert 3 in sizes and 1 in sizes, sizes
    if not HAS_CUDA:  # interpreted: ~40 s a run; the verify rows' padded path is the torch_native test's
        assert run_padded_against_eager("torch_native", with_image=False)[1] == outputs
        return
    sizes, with_drafts = run_padded_against_eager("triton", with_image=True, device=DEVICE, drafts=outputs)
    assert with_drafts == outputs and max(sizes) > 4, sizes
    # Adapter rows through the Triton kernels, as the graphs run them (interpreted: test_lora_products).
    with tempfile.TemporaryDirectory() as tmp:
        sizes, _ = run_padded_against_eager("triton", with_image=False, device=DEVICE, lora_dir=tmp)
    assert 3 in sizes, sizes


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_replayed_graphs_equal_eager_on_cuda() -> None:
    """Never run on a GPU so far (none at hand when it was written)."""
    from tessera.frontend.model_info import ModelInfo
    from tessera.models.config import eos_token_ids
    from tessera.worker.model_worker import ModelWorker

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=2048, max_running_requests=4, device="cuda",
                                 attention_backend="triton", dtype="float32")
    info = ModelInfo.load(args)
    eos = eos_token_ids(info.config)
    graphs = ModelWorker(args, eos, info.config)
    eager = ModelWorker(args.replace(disable_cuda_graph=True), eos, info.config)
    assert graphs.graph_runner is not None and graphs.graph_runner.captured and eager.graph_runner is None
    assert graphs.info.cuda_graph_batch_sizes == (1, 2, 4) and graphs.info.cuda_graph_status == "captured"
    policy = _policy(max_running=4)
    for r in _requests(info):
        policy.add(r)
    replays = 0
    while (batch := policy.next_batch()) is not None:
        fi = build_forward_input(batch, info.config.family.model_class(), info.config, policy.kv)
        replays += graphs._graph_bucket(fi, graphs._custom_masks(fi)) is not None
        want, got = eager.forward(fi), graphs.forward(fi)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        _apply_greedy_step(policy, batch, want)
    assert replays > 0
