"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the batch padded to its bucket.

A decode step (every request adds one token, no media, no custom masks) launches hundreds of small kernels
whose launch cost, not the GPU, bounds small batches. Capturing the whole model forward once per bucket and
replaying it turns those launches into one. A graph replays fixed addresses and shapes, so:

- the step's inputs are copied into static buffers (DecodeBuffers) sized for the largest bucket; a batch of
  bs requests runs the graph of the smallest bucket >= bs, its rows bs..bucket-1 padded: token 0 at position
  0, KV written to the pool's dummy slot 0, attending over one key through a slot-table row that is never a
  request's (the pad row, all slot 0), so padding never touches a real request's KV;
- the attention backend plans the batch from device tensors alone (ForwardBatch.decode_only; backends that
  can do so list "cuda_graph" in their features), and the ForwardBatch itself is built inside the capture,
  so its derived tensors are recomputed on every replay; a backend that must plan on the host (FlashInfer)
  does so in plan_graph_decode, called before every warm-up, capture and replay, outside the graph;
- logits land in the graph's own output buffer; the first bs rows are the step's.
- with LoRA (--enable-lora) every graph holds the adapter products of every slot: each row's slot is one more
  static input (-1 for the base model and for padding), the layers read it through LoraStep.decode_graph, and
  the stacks are fixed before capture (LoraManager.fix_stacks), so adapters placed later in their slots are
  replayed without a new capture.

With --enable-torch-compile the buckets up to --torch-compile-max-bs capture the model as torch.compile built
it (inductor, dynamic=False: one specialisation per bucket, as SGLang does) instead of its eager kernels; a
capture that fails that way is retried without compiling, and the status says so.

The sampler runs outside the graph, on those rows. Its work depends on per-request settings that change from
step to step (greedy or not, top-k/p, penalties, seeds, logprobs; later grammar masks), which a graph would
have to cover with one variant per combination or with worst-case work on every row; outside, a greedy batch
costs one argmax. Batches larger than the largest bucket, prefill and mixed steps, and steps with media run
eagerly, as does everything off CUDA.

An uncaptured DecodeGraphRunner runs the exact padded forward that a graph captures, eagerly: that is how
the padding is tested on a CPU (tests/worker/test_cuda_graph.py). A failed capture is never silent:
`try_capture` logs it as an error with its traceback and returns the reason, which the worker reports in
/get_server_info (WorkerInfo.cuda_graph_status) before decoding eagerly.
"""

from __future__ import annotations

import bisect
import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.config import ServerArgs
from tessera.layers.attention.base import BaseAttentionBackend
from tessera.models.base import TesseraModel
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.lora.manager import LoraManager
from tessera.platform.device import Platform, platform_of

logger = logging.getLogger("tessera.worker")

# The adapters' rank that LoRA stacks are fixed at for the graphs without --max-lora-rank, when no adapter
# loaded at start needs more (adapters loaded later above it are refused, naming the flag).
DEFAULT_LORA_RANK = 16
DEFAULT_MAX_BS = 160  # SGLang's default on large GPUs; batches beyond it are rare and launch-cost bound less


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every multiple of 8 up to max_bs, and max_bs itself. Padding wastes at
    most 7 rows (a decode step's cost grows slowly with the batch); each bucket costs a capture at startup
    and a little graph memory."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs: must be a positive integer, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


def pick_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds batch_size requests; None when it exceeds the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) and batch_size > 0 else None


@dataclass
class DecodeInputs:
    """One decode step's device inputs, bs = number of requests (= tokens)."""

    input_ids: torch.Tensor  # [bs] int64
    positions: torch.Tensor  # [bs] or [3, bs] int64
    out_cache_loc: torch.Tensor  # [bs] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    host_seq_lens: list[int] | None = None  # seq_lens on the host when the caller has them (saves a read back)
    lora_slots: torch.Tensor | None = None  # [bs] int64: each request's LoRA slot (-1: none); None: no adapters

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


class DecodeBuffers:
    """Static input tensors for max_bs requests; a bucket's graph reads their first `bucket` rows."""

    def __init__(self, max_bs: int, mrope: bool, pad_row: int, device: torch.device):
        self.max_bs, self.pad_row = max_bs, pad_row

        def longs(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.input_ids = longs(max_bs)
        self.positions = longs(3, max_bs) if mrope else longs(max_bs)
        self.out_cache_loc = longs(max_bs)  # padding: the dummy slot 0
        self.req_pool_indices = longs(max_bs, fill=pad_row)
        self.seq_lens = longs(max_bs, fill=1)  # padding: one key, slot 0
        self.extend_lens = longs(max_bs, fill=1)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.lora_slots = longs(max_bs, fill=-1)  # padding and the base model's rows: no adapter

    def load(self, inputs: DecodeInputs, bucket: int) -> None:
        """Copies the step into rows [0, bs) and resets rows [bs, bucket) to padding (a previous, larger
        step left its values there)."""
        bs = inputs.batch_size
        assert bs <= bucket <= self.max_bs, (bs, bucket, self.max_bs)
        self.input_ids[:bs].copy_(inputs.input_ids)
        self.positions[..., :bs].copy_(inputs.positions)
        self.out_cache_loc[:bs].copy_(inputs.out_cache_loc)
        self.req_pool_indices[:bs].copy_(inputs.req_pool_indices)
        self.seq_lens[:bs].copy_(inputs.seq_lens)
        if inputs.lora_slots is not None:
            self.lora_slots[:bs].copy_(inputs.lora_slots)
        else:
            self.lora_slots[:bs].fill_(-1)
        if bs < bucket:
            self.lora_slots[bs:bucket].fill_(-1)
            self.input_ids[bs:bucket].zero_()
            self.positions[..., bs:bucket].zero_()
            self.out_cache_loc[bs:bucket].zero_()
            self.req_pool_indices[bs:bucket].fill_(self.pad_row)
            self.seq_lens[bs:bucket].fill_(1)

    def batch(self, bucket: int, req_to_token: torch.Tensor, lora: bool = False) -> ForwardBatch:
        """The ForwardBatch over the first `bucket` rows (views: a graph captured over it reads the buffers).
        lora: rows may have adapters (their slots in lora_slots)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bucket], positions=self.positions[..., :bucket],
            out_cache_loc=self.out_cache_loc[:bucket], req_pool_indices=self.req_pool_indices[:bucket],
            seq_lens=self.seq_lens[:bucket], extend_lens=self.extend_lens[:bucket], req_to_token=req_to_token,
            logits_indices=self.logits_indices[:bucket], decode_only=True, lora_rows=lora)


class DecodeGraphRunner:
    """Runs decode steps of up to max(sizes) requests padded to a bucket: replaying that bucket's CUDA graph
    once `capture()` succeeded, else the same padded forward eagerly."""

    def __init__(self, model: TesseraModel, pool: TokenToKVPool, req_to_token: torch.Tensor, sizes: list[int],
                 pad_row: int, mrope: bool, platform: Platform | None = None, lora: LoraManager | None = None,
                 compile_max_bs: int = 0):
        assert not req_to_token[pad_row].any(), "the padding row of the slot table must hold only slot 0"
        self.model, self.pool, self.req_to_token = model, pool, req_to_token
        self.platform = platform or platform_of(req_to_token.device)  # what captures the graphs
        self.sizes = sizes
        self.mrope = mrope
        self.buffers = DecodeBuffers(sizes[-1], mrope, pad_row, req_to_token.device)
        self.graphs: dict[int, object] = {}  # bucket -> its captured graph (replay())
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's logits [bucket, vocab]
        # The model's attention backends (held by its modules, not submodules), for plan_graph_decode.
        modules = model.modules() if isinstance(model, torch.nn.Module) else ()
        found = {id(b): b for m in modules for b in vars(m).values() if isinstance(b, BaseAttentionBackend)}
        self.backends = list(found.values())
        self._capturing: int | None = None  # the bucket being captured, for the error message
        self.lora = lora  # its adapters' products are part of every step (see the module docstring)
        self.compile_max_bs = compile_max_bs  # buckets up to this run the torch.compile'd model (0: none)
        self._compiled: object | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, batch_size: int, positions: torch.Tensor) -> int | None:
        """The bucket for a decode step, or None when it must run eagerly (too large, or positions of another
        shape than the buffers')."""
        if positions.dim() != (2 if self.mrope else 1):
            return None
        return pick_bucket(batch_size, self.sizes)

    @torch.inference_mode()
    def forward(self, inputs: DecodeInputs, bucket: int) -> torch.Tensor:
        """Logits [bs, vocab] of the step (a view of the graph's output buffer when replayed: valid until
        the next step)."""
        self.buffers.load(inputs, bucket)
        lens = inputs.host_seq_lens
        self._plan(bucket, None if lens is None else list(lens) + [1] * (bucket - inputs.batch_size))
        graph = self.graphs.get(bucket)
        if graph is None:
            with self._lora_rows(bucket):
                logits = self._model_for(bucket)(self._batch(bucket), self.pool)
        else:
            graph.replay()
            logits = self.outputs[bucket]
        return logits[:inputs.batch_size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (the smaller ones reuse its memory pool). Each is run eagerly
        twice before its capture: Triton compiles and cuBLAS picks its kernels outside the graph. The buffers
        hold padding throughout, so these runs only write the dummy KV slot."""
        def step(bucket: int) -> None:
            with self._lora_rows(bucket):
                self.outputs[bucket] = self._model_for(bucket)(self._batch(bucket), self.pool)

        if self.compile_max_bs:
            self._check_compiled()
        steps = {bucket: (lambda b=bucket: step(b)) for bucket in self.sizes}
        # Backends that plan on the host (FlashInfer) plan each bucket before every run, outside the graph.
        self.graphs = self.platform.capture_graphs(
            steps, warmup=2, before=self._before_run)

    def _check_compiled(self) -> None:
        """Runs each compiled bucket once beside the model itself on the padding batch (what the warm-ups run)
        and raises when the logits differ: a miscompiled model must cost the compile, not the answers."""
        for bucket in [b for b in self.sizes if b <= self.compile_max_bs]:
            outs = []
            for model in (self.model, self._model_for(bucket)):
                self._before_run(bucket)
                with self._lora_rows(bucket):
                    outs.append(model(self._batch(bucket), self.pool).float())
            want, got = outs
            # float32 agrees closely; 16-bit activations round differently once inductor fuses them
            tol = 1e-4 if self.pool.k_buffers[0].dtype == torch.float32 else 5e-2
            if not (torch.isfinite(got).all() and torch.allclose(got, want, atol=tol, rtol=tol)):
                diff = (got - want).abs().nan_to_num(float("inf")).max().item()
                raise RuntimeError(f"torch.compile's logits differ from the model's at batch {bucket} "
                                   f"(max difference {diff:.3g})")

    def _model_for(self, bucket: int):
        """The model, or for buckets up to compile_max_bs the model compiled once by torch.compile (its
        specialisations per bucket are made by the warm-up runs, before the capture)."""
        if bucket > self.compile_max_bs:
            return self.model
        if self._compiled is None:
            dynamo = torch._dynamo.config
            dynamo.cache_size_limit = max(dynamo.cache_size_limit, len(self.sizes) + 8)  # a specialisation per bucket
            backend = os.environ.get("TESSERA_TORCH_COMPILE_BACKEND", "inductor")  # tests: "eager" (dynamo only)
            mode = os.environ.get("TESSERA_TORCH_COMPILE_MODE", "max-autotune-no-cudagraphs")  # SGLang's
            self._compiled = torch.compile(self.model, dynamic=False, backend=backend,
                                           **({"mode": mode} if backend == "inductor" else {}))
        return self._compiled

    def _batch(self, bucket: int) -> ForwardBatch:
        return self.buffers.batch(bucket, self.req_to_token, lora=self.lora is not None)

    def _lora_rows(self, bucket: int) -> AbstractContextManager:
        if self.lora is None:
            return nullcontext()
        return self.lora.step.decode_graph(self.buffers.lora_slots[:bucket], self.lora.num_slots)

    def _before_run(self, bucket: int) -> None:
        self._capturing = bucket
        self._plan(bucket, [1] * bucket)

    def _plan(self, bucket: int, host_seq_lens: list[int] | None) -> None:
        fb = self._batch(bucket)
        for backend in self.backends:
            backend.plan_graph_decode(fb, self.sizes[-1], host_seq_lens)

    def try_capture(self) -> str | None:
        """capture(); when it fails: an ERROR log line with the traceback, no graphs kept (a partial set would
        replay some buckets and not others, hiding the failure), and the reason returned."""
        try:
            self.capture()
        except Exception as e:  # any failure: the worker still serves, eagerly, and says why
            self.graphs.clear()
            self.outputs.clear()
            message = " / ".join(line.strip() for line in str(e).splitlines() if line.strip())[:500]
            reason = f"decode batch size {self._capturing}: {type(e).__name__}: {message}"
            logger.error("CUDA graph capture failed at %s; decode runs eagerly", reason, exc_info=True)
            return reason
        return None


def decode_graphs_off(args: ServerArgs, platform: Platform, model: TesseraModel, backend_name: str,
                      keeps_request_state: bool, tp_size: int) -> str | None:
    """Why a worker's decode steps run without CUDA graphs (logged where graphs could run), or None."""
    why_not = None
    if args.disable_cuda_graph:
        why_not = "--disable-cuda-graph"
    elif not platform.supports_graphs:
        why_not = f"device {platform.kind}"
    elif "cuda_graph" not in model.attn_backend.features:
        why_not = f"attention backend {backend_name} plans on the host"
    elif not type(model).cuda_graph_decode:
        why_not = f"{type(model).__name__} has host-side work in its decode step"
    elif keeps_request_state:
        why_not = f"{type(model).__name__} reads per-request state the graph inputs do not carry"
    elif tp_size > 1:
        why_not = "tensor parallelism (collectives are not captured)"
    if why_not and platform.supports_graphs:
        logger.info("CUDA graphs off: %s", why_not)
    return why_not


def graph_max_bs(args: ServerArgs) -> int:
    """The largest decode batch a graph is captured for."""
    return min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, args.max_running_requests)


def capture_decode_graphs(runner: DecodeGraphRunner, platform: Platform,
                          device: torch.device) -> tuple[DecodeGraphRunner | None, str]:
    """Captures `runner`'s graphs: (None, "capture failed, ...") when a capture failed (logged there as an
    error), else (runner, "captured", with torch.compile's part); the status is /get_server_info's."""
    failure = runner.try_capture()  # logged there, as an error
    compiled = ""
    if failure is not None and runner.compile_max_bs:  # torch.compile's failure must not cost the graphs
        platform.synchronize(device)
        runner.compile_max_bs, runner._compiled = 0, None
        compiled, failure = f" without torch.compile (it failed: {failure})", runner.try_capture()
    elif runner.compile_max_bs:
        compiled = f", torch.compile up to batch {runner.compile_max_bs}"
    if failure is not None:
        platform.synchronize(device)
        return None, f"capture failed, decode runs eagerly: {failure}"
    logger.info("CUDA graphs captured for decode batch sizes %s%s", runner.sizes, compiled)
    return runner, "captured" + compiled
