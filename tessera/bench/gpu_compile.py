"""`python -m tessera.bench.gpu_compile`: every Triton kernel of the package compiled for real GPU targets
(sm_80, sm_90) on a machine without a GPU, with the arguments its launcher really passes.

Nothing is launched. The launchers (TritonAttentionBackend's init_forward_metadata + forward) run on small CPU
tensors while every `@triton.jit` kernel of the package is replaced by a recorder; triton's own binder turns
each recorded launch into the signature, constexprs and specialisation attributes (e.g. 16-byte divisibility)
a GPU launch would compile, and identical ones compile once per target with triton's compiler and ptxas.
A kernel that no driven launcher reaches counts as a failure, so a new kernel cannot go unchecked.

The steps come from the family table, not from a list of cases: each family's default-constructed HF config
(transformers' defaults are mostly the flagship's sizes) and the shipped demo checkpoints, read through
ModelConfig, give head_dim, heads, KV heads, sliding windows and whether custom masks occur; every one runs
in bf16, fp16 and fp32, as prefill, extend over a cached prefix, custom-mask extend (families that need
them), decode planned on the host (int32) and decode planned the CUDA-graph way (int64 device tensors).
A compiled kernel whose shared memory exceeds the target's limit is a failure too.

    python -m tessera.bench.gpu_compile [--arch 80,90] [--jobs 2]

Prints one line per failure and `N of M compiled`; exits 0 only when all compile.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import multiprocessing
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Opt-in shared memory per block (CUDA programming guide, compute capabilities table).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PACKAGE = Path(__file__).resolve().parents[1]
# The slot table's width (context length + 8, as the worker's) sets a launch argument's alignment; beyond
# this the table would only cost memory here (any power of two + 8 aligns alike).
MAX_CONTEXT = 1 << 17


@dataclass(frozen=True)
class Shape:
    """The attention shape of one model: what a launch's arguments depend on."""

    source: str  # the family or checkpoint it came from
    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # distinct per-layer sliding windows (None = full attention)
    custom_masks: bool
    context_length: int


@dataclass
class Launch:
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict
    label: str


@dataclass
class Case:
    """One unique compilation: a kernel, a target, what triton's binder made of a launch."""

    module: str
    name: str
    arch: int
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict
    labels: list[str] = field(default_factory=list)

    def summary(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.signature.items() if v.startswith("*"))
        names = list(self.signature)
        consts = " ".join(f"{names[path[0]]}={v}" for path, v in self.constexprs.items())
        return f"{args} {consts}"


# ---- kernels and recording -----------------------------------------------------------------------------
def discover_kernels() -> dict[str, Any]:
    """Every `@triton.jit` function in the package's sources, as "module:name" -> JITFunction."""
    from triton.runtime.jit import JITFunction

    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        # Launched kernels are named *_kernel; other jit functions are helpers they call (compiled with them).
        names = [n for n in re.findall(r"^@triton\.jit\b.*\n(?:@.*\n)*def (\w+)", text, flags=re.M)
                 if n.endswith("_kernel")]
        if not names:
            continue
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mod = importlib.import_module(module)
        for name in names:
            fn = getattr(mod, name)
            if not isinstance(fn, JITFunction):
                raise TypeError(f"{module}.{name} is decorated @triton.jit but is a {type(fn).__name__}")
            found[f"{module}:{name}"] = fn
    return found


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch and runs nothing."""

    def __init__(self, kernel: Any, launches: list[Launch], label: Callable[[], str]):
        self.kernel, self.launches, self.label = kernel, launches, label

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs, self.label()))
        return launch


@contextmanager
def recording(kernels: dict[str, Any], launches: list[Launch], label: Callable[[], str]) -> Iterator[None]:
    """Replaces every module-level reference to the kernels (in the package's loaded modules) by recorders."""
    by_id = {id(fn): fn for fn in kernels.values()}
    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(PACKAGE.name):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in by_id:
                patched.append((mod, attr, value))
                setattr(mod, attr, _Recorder(value, launches, label))
    try:
        yield
    finally:
        for mod, attr, value in patched:
            setattr(mod, attr, value)


# ---- shapes and steps --------------------------------------------------------------------------------
def family_configs() -> Iterator[tuple[str, Any]]:
    """(name, default HF config) for every row of the family table."""
    from transformers import CONFIG_MAPPING

    from tessera.models.families import FAMILIES

    for family in FAMILIES.values():
        model_type = next((mt for f in FAMILIES.values() if f.architecture == family.architecture
                           for mt in f.model_types), None)
        if model_type is None:
            raise ValueError(f"family {family.name}: no model_type in the family table to build its config from")
        extra = {"vision_config": {"model_type": family.vision_model_type}} if family.vision_model_type else {}
        yield family.name, CONFIG_MAPPING[model_type](**extra)


def shipped_configs() -> Iterator[tuple[str, Any]]:
    """The demo checkpoints' configs (the shapes the tests and the CPU benchmarks serve)."""
    from transformers import AutoConfig

    from tessera.config import ASSETS_DIR

    for path in sorted(ASSETS_DIR.glob("*/config.json")):
        yield path.parent.name, AutoConfig.from_pretrained(str(path.parent))


def shapes() -> list[Shape]:
    """One Shape per distinct attention shape (families sharing one are driven once, under all their names)."""
    from tessera.models.config import ModelConfig

    by_shape: dict[tuple, list[str]] = {}
    for source, hf_config in [*family_configs(), *shipped_configs()]:
        cfg = ModelConfig.from_hf(hf_config)
        masks = cfg.family.bidirectional_mm_spans or "custom_mask" in cfg.family.backend_needs
        key = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
               tuple(sorted(set(cfg.sliding_windows), key=lambda w: w or 0)), masks,
               min(cfg.max_position_embeddings, MAX_CONTEXT))
        by_shape.setdefault(key, []).append(source)
    return [Shape(", ".join(sources), *key) for key, sources in by_shape.items()]


@dataclass
class Step:
    name: str
    seq_lens: list[int]
    ext_lens: list[int]
    spans: list[tuple[int, int] | None] | None = None  # per request: a bidirectional span (custom mask)
    graph: bool = False  # planned as the CUDA-graph runner plans a decode batch


def steps(shape: Shape) -> list[Step]:
    out = [Step("prefill", [40], [40]), Step("extend-prefix", [50, 7], [10, 1]),
           Step("decode", [3, 45, 7], [1, 1, 1]), Step("graph-decode", [3, 45, 7], [1, 1, 1], graph=True)]
    if shape.custom_masks:
        out.append(Step("masked-extend", [20, 9], [12, 1], spans=[(4, 10), None]))
    return out


def _batch(shape: Shape, step: Step, dtype: torch.dtype):
    """A step's ForwardBatch, KV pool and q/k/v, built as the worker (or the graph runner) builds them."""
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.layers.forward_batch import ForwardBatch
    from tessera.worker.cuda_graph import DecodeBuffers

    n = len(step.seq_lens)
    pad_row = n + 1
    req_to_token = torch.zeros((n + 2, shape.context_length + 8), dtype=torch.int64)
    slot = 1
    for row, seq in enumerate(step.seq_lens):
        req_to_token[row, :seq] = torch.arange(slot, slot + seq)
        slot += seq
    pool = TokenToKVPool(slot + 1, 1, shape.num_kv_heads, shape.head_dim, dtype=dtype, device="cpu")
    rows = list(range(n))
    if step.graph:
        buffers = DecodeBuffers(n, mrope=False, pad_row=pad_row, device=torch.device("cpu"))
        buffers.seq_lens[:n] = torch.tensor(step.seq_lens)
        buffers.req_pool_indices[:n] = torch.tensor(rows)
        fb = buffers.batch(n, req_to_token)
    else:
        masks = None
        if step.spans:
            masks = []
            for seq, ext, span in zip(step.seq_lens, step.ext_lens, step.spans):
                q_pos, k_pos = torch.arange(seq - ext, seq)[:, None], torch.arange(seq)[None, :]
                lo, hi = span or (0, 0)
                inside = (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
                masks.append((k_pos <= q_pos) | inside if span else None)
        locs = torch.cat([req_to_token[r, s - e:s] for r, s, e in zip(rows, step.seq_lens, step.ext_lens)])
        fb = ForwardBatch(
            input_ids=torch.zeros(len(locs), dtype=torch.int64), positions=torch.zeros(len(locs), dtype=torch.int64),
            out_cache_loc=locs, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(step.seq_lens),
            extend_lens=torch.tensor(step.ext_lens), req_to_token=req_to_token, custom_masks=masks,
            host_seq_lens=list(step.seq_lens), host_extend_lens=list(step.ext_lens), host_req_pool_indices=rows)
    t = int(fb.extend_lens.sum())
    qkv = [torch.randn(t, heads, shape.head_dim).to(dtype) for heads in
           (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads)]
    return fb, pool, qkv


def drive_triton_attention(shape: Shape, dtype: torch.dtype, note: Callable[[str], None]) -> None:
    """TritonAttentionBackend over every step of a shape, each with every sliding window the shape has."""
    from tessera.layers.attention.triton_backend import TritonAttentionBackend

    for step in steps(shape):
        for window in shape.windows:
            note(f"{shape.source} {str(dtype).removeprefix('torch.')} {step.name}"
                 + (f" window={window}" if window else ""))
            fb, pool, (q, k, v) = _batch(shape, step, dtype)
            backend = TritonAttentionBackend()
            backend.init_forward_metadata(fb)
            backend.forward(q, k, v, 0, fb, pool, shape.head_dim ** -0.5, window)


def drive_triton_ops(shape: Shape, dtype: torch.dtype, note: Callable[[str], None]) -> None:
    """The decoder layer's fused kernels (layers/triton_ops.py) at the shape's sizes: the norms with and
    without a residual, SwiGLU, and the rotary + KV write of a decode and a prefill step."""
    from tessera.layers import triton_ops

    hidden = shape.num_heads * shape.head_dim
    for step in steps(shape)[:3]:
        note(f"{shape.source} {str(dtype).removeprefix('torch.')} fused ops {step.name}")
        fb, pool, _ = _batch(shape, step, dtype)
        t = int(fb.extend_lens.sum())
        x, residual = torch.randn(t, hidden).to(dtype), torch.randn(t, hidden).to(dtype)
        weight = torch.ones(hidden, dtype=dtype)
        triton_ops.rmsnorm(x, None, weight, 1e-6)
        triton_ops.rmsnorm(x, residual, weight, 1e-6)
        triton_ops.rmsnorm(x, None, weight, 1e-6, gemma=True)
        triton_ops.gemma_norm_add(x, residual, weight, weight, 1e-6)
        triton_ops.gemma_norm_add(x, residual, weight, None, 1e-6)
        triton_ops.silu_and_mul(torch.randn(t, 2 * 4 * hidden).to(dtype))
        triton_ops.gelu_tanh_and_mul(torch.randn(t, 2 * 4 * hidden).to(dtype))
        qkv = torch.randn(t, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim).to(dtype)
        cos = torch.randn(t, shape.head_dim // 2).to(dtype)
        k_buf, v_buf = pool.get_kv(0)
        norm_w = torch.ones(shape.head_dim, dtype=dtype)
        for qk_norm in (None, (norm_w, norm_w, 1e-6, False), (norm_w, norm_w, 1e-6, True)):  # Qwen3's, Gemma's
            triton_ops.rotary_store_kv(qkv, cos, cos.clone(), k_buf, v_buf, fb.out_cache_loc, shape.num_heads,
                                       shape.num_kv_heads, shape.head_dim, qk_norm)


def drive_lora(shape: Shape, dtype: torch.dtype, note: Callable[[str], None]) -> None:
    """The LoRA kernels (layers/lora/triton_lora.py) at the shape's QKV and O sizes, rank 8 and 64, a decode
    batch and a prefill's rows over 8 slots."""
    from tessera.layers.lora import triton_lora

    hidden = shape.num_heads * shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    for rank in (8, 64):
        for rows in (1, 40):
            note(f"{shape.source} {str(dtype).removeprefix('torch.')} LoRA rank {rank}, {rows} rows")
            x, slots = torch.randn(rows, hidden).to(dtype), torch.zeros(rows, dtype=torch.int64)
            for sr, out in ((3 * rank, qkv), (rank, hidden)):  # merged QKV's stacked shards; O
                xa = triton_lora.lora_shrink(x, torch.zeros(8, sr, hidden, dtype=dtype), slots)
                triton_lora.lora_expand(torch.zeros(rows, out, dtype=dtype), xa, torch.zeros(8, sr, out, dtype=dtype),
                                        slots)


@functools.cache
def moe_sizes() -> dict[str, tuple[int, int, int, int]]:
    """MoE family name -> (hidden, expert intermediate, experts, top-k) of its default config."""
    texts = [(source, hf_config.get_text_config()) for source, hf_config in family_configs()]
    return {source: (t.hidden_size, getattr(t, "moe_intermediate_size", None) or t.intermediate_size,
                     getattr(t, "num_local_experts", None) or t.num_experts, t.num_experts_per_tok)
            for source, t in texts if getattr(t, "num_local_experts", None) or getattr(t, "num_experts", None)}


def drive_moe(shape: Shape, dtype: torch.dtype, note: Callable[[str], None]) -> None:
    """layers/moe_triton.py at each MoE family's sizes, 3 and 200 rows (both block sizes), both weight placements."""
    from tessera.layers.decoder import GatedActivation
    from tessera.layers.moe_triton import triton_grouped_experts

    for source in (s for s in shape.source.split(", ") if s in moe_sizes()):
        hidden, inter, _, k = moe_sizes()[source]
        w13, w2 = torch.empty(4, hidden, 2 * inter, dtype=dtype), torch.empty(4, inter, hidden, dtype=dtype)
        for rows, on_input in ((3, False), (3, True), (200, False), (200, True)):
            note(f"{source} {str(dtype).removeprefix('torch.')} MoE {rows} rows")
            x, ids, weights = torch.zeros(rows, hidden, dtype=dtype), torch.arange(rows * k).view(rows, k) % 4, \
                torch.ones(rows, k, dtype=dtype)
            triton_grouped_experts(x, w13, w2, ids, weights, GatedActivation("silu"), on_input)


DRIVERS: tuple[Callable[[Shape, torch.dtype, Callable[[str], None]], None], ...] = (
    drive_triton_attention, drive_triton_ops, drive_lora, drive_moe)


def record_launches(kernels: dict[str, Any]) -> list[Launch]:
    launches: list[Launch] = []
    label = [""]
    with recording(kernels, launches, lambda: label[0]), torch.inference_mode():
        for shape in shapes():
            for dtype in DTYPES:
                for drive in DRIVERS:
                    drive(shape, dtype, lambda s: label.__setitem__(0, s))
    return launches


# ---- binding and compiling ---------------------------------------------------------------------------
@functools.cache
def _binder(kernel: Any, arch: int) -> tuple[Any, Callable]:
    """Triton's own argument binder for a kernel and target (what JITFunction.run calls before compiling)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def bind(launch: Launch, arch: int) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) as triton's launcher would derive them for this target:
    pointer dtypes, ints as i32/i64 (1 becomes a constexpr, multiples of 16 get a divisibility attribute,
    unless the kernel says do_not_specialize), constexpr kwargs as constexprs."""
    kernel = launch.kernel
    backend, binder = _binder(kernel, arch)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    options = {k: v for k, v in launch.kwargs.items() if k not in kernel.arg_names}
    return signature, constexprs, attrs, options


def collect(kernels: dict[str, Any], launches: list[Launch], archs: list[int]) -> list[Case]:
    names = {id(fn): key for key, fn in kernels.items()}
    cases: dict[str, Case] = {}
    for launch in launches:
        module, name = names[id(launch.kernel)].split(":")
        for arch in archs:
            sig, consts, attrs, options = bind(launch, arch)
            key = repr((module, name, arch, sig, sorted(consts.items()), sorted(attrs.items()), sorted(options.items())))
            case = cases.setdefault(key, Case(module, name, arch, sig, consts, attrs, options))
            case.labels.append(launch.label)
    return list(cases.values())


def compile_case(case: Case) -> tuple[bool, str]:
    """(ok, message): compiles one case; a failure's message is the compiler's most telling line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(case.module), case.name)
    try:
        compiled = triton.compile(ASTSource(fn, case.signature, case.constexprs, case.attrs),
                                  target=GPUTarget("cuda", case.arch, 32), options=case.options)
    except Exception as e:  # noqa: BLE001 - any compiler error is this case's result
        return False, _error_line(e)
    shared, limit = compiled.metadata.shared, SHARED_LIMIT.get(case.arch)
    if limit is not None and shared > limit:
        return False, f"shared memory {shared / 1024:.1f} KiB > the sm_{case.arch} limit {limit // 1024} KiB"
    return True, f"shared {shared} B"


def _error_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def run(archs: list[int], jobs: int, out=sys.stdout, recorded: tuple[dict, list[Launch]] | None = None) -> int:
    """Records (unless given `recorded`: kernels and their launches), compiles and reports; returns the
    number of failures."""
    t0 = time.perf_counter()
    if recorded is None:
        kernels = discover_kernels()
        recorded = kernels, record_launches(kernels)
    kernels, launches = recorded
    cases = collect(kernels, launches, archs)
    failures = [f"{key}: no launcher drives it (add one to DRIVERS)" for key, fn in kernels.items()
                if not any(launch.kernel is fn for launch in launches)]
    t1 = time.perf_counter()
    if jobs > 1 and len(cases) > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(compile_case, cases))
    else:
        results = [compile_case(c) for c in cases]
    for case, (ok, message) in zip(cases, results):
        if not ok:
            failures.append(f"{case.name} sm_{case.arch} [{case.summary()}] ({case.labels[0]}; "
                            f"{len(case.labels)} launches): {message}")
    for line in failures:
        print(f"FAIL {line}", file=out)
    compiled = sum(ok for ok, _ in results)
    print(f"{compiled} of {len(cases)} compiled ({len(launches)} launches recorded in {t1 - t0:.1f} s, "
          f"compiled in {time.perf_counter() - t1:.1f} s, sm_{', sm_'.join(map(str, archs))})", file=out)
    return len(failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.bench.gpu_compile", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    ns = parser.parse_args(argv)
    try:
        archs = [int(a) for a in ns.arch.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--arch: expected comma-separated integers such as 80,90, got {ns.arch!r}")
    if not archs:
        parser.error("--arch: at least one compute capability")
    if ns.jobs < 1:
        parser.error(f"--jobs: must be a positive integer, got {ns.jobs}")
    return 1 if run(archs, ns.jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
