"""A decode step of the shared decoder stack as one C call on a CPU (platform/csrc/cpu_decode_stack.c).

The layer-by-layer path (layers/decoder.py) crosses from Python into a kernel about ten times per layer; each
crossing (the module call, a torch.empty, the operand checks, ctypes) costs 20-40 us, which on bench-medium at
batch 1 came to about a quarter of the step and on demo-vl to most of it. When a step is all decode rows, few
enough for the gemv kernels, in float32 on the host, this module hands the whole stack to the C driver, which
calls the same kernels in the same order (so the numbers are those of the layer-by-layer path; products over
small weights, which that path leaves to torch, run in our gemv here). Figures: docs/benchmarks.md, "The
decode stack in one C call".

It applies to DecoderModel's own blocks (DecoderLayer with SwiGLU, with or without QK-norm and biases) on one
rank, with float32, bfloat16 / float16 (kept in 16 bits) or our C-packed int8 / int4 weights, and the torch_native
backend reading the pool in place, and with LoRA adapter rows (float32 stacks: each row's adapter product is
added in C, layers/lora/slots.py's layout). Anything else runs the layers as before. TESSERA_DECODE_STACK=0 turns
it off. `run_rows` is the same call for a caller that knows its rows' KV slots itself (the STANDALONE draft).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
from torch import nn

from tessera.layers import cpu_gemv
from tessera.layers.attention import cpu_decode
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import Linear, MergedLinear
from tessera.cache.kv_pool import TokenToKVPool
from tessera.platform import cpu_kernels
from tessera.platform.device import is_host

_P, _L = ctypes.c_void_p, ctypes.c_long
W_F32, W_BF16, W_F16, W_INT8, W_INT4 = range(5)
_KIND_KERNEL = {W_F32: "gemv", W_BF16: "gemv_bf16", W_F16: "gemv_f16", W_INT8: "int8_gemv", W_INT4: "int4_gemv"}
_STEP_KERNELS = ("decode_stack", "rmsnorm", "rotary", "silu_mul", "decode_attention")


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _L), ("w", _P), ("scale", _P), ("zs", _P), ("bias", _P), ("n", _L), ("k", _L),
                ("group", _L)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _Weight),
                ("o", _Weight), ("gate_up", _Weight), ("down", _Weight), ("k_cache", _P), ("v_cache", _P),
                ("window", _L)]


class _Lora(ctypes.Structure):
    _fields_ = [("A", _P), ("Bt", _P), ("width", _L)]


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("f32", "bf16", "f16", "int8", "int4", "rmsnorm", "rotary", "silu_mul",
                                         "attention")]


def enabled() -> bool:
    return os.environ.get("TESSERA_DECODE_STACK", "1") != "0"


def _weight(linear: nn.Module) -> tuple[_Weight, int, tuple] | None:
    """The C descriptor of one projection, its kind, and the tensors it points into (kept alive with it); None
    where the driver cannot run it (the layer-by-layer path then runs the whole step)."""
    bias = linear.bias
    if bias is not None and not cpu_kernels.host_f32_inference(bias):
        return None
    b = bias.data_ptr() if bias is not None else None
    n, k = linear.out_features, linear.in_features
    q = getattr(linear, "quantized", None)
    if q is not None:
        if q.path != "c":
            return None
        kind = W_INT8 if q.bits == 8 else W_INT4
        return _Weight(kind, q.q.data_ptr(), q.scale.data_ptr(), q.zs.data_ptr(), b, n, k, q.group_size), kind, \
            (q.q, q.scale, q.zs, bias)
    w = linear.weight
    kind = {torch.float32: W_F32, torch.bfloat16: W_BF16, torch.float16: W_F16}.get(w.dtype)
    if kind is None or not (is_host(w.device) and w.is_contiguous() and tuple(w.shape) == (n, k)):
        return None
    return _Weight(kind, w.data_ptr(), None, None, b, n, k, 0), kind, (w, bias)


@dataclass
class _Plan:
    """What the driver reads of one model: its layer table (weights and, per pool, the K/V buffers)."""

    layers: ctypes.Array
    kernels: _Kernels
    keep: list  # tensors the table points into
    linears: list  # the projections, in table order
    sources: list  # their weight objects when the table was made: a replaced weight rebuilds it
    final_norm: torch.Tensor
    dims: tuple[int, int, int, int, int]  # H, Hq, Hkv, D, I
    eps: float
    scale: float
    pool_key: tuple | None = None
    lora: ctypes.Array | None = None  # the LoRA table, 4 per layer, for the stacks in lora_key
    lora_key: tuple | None = None


def _linears(model: nn.Module) -> list[nn.Module]:
    return [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _sources(linears: list[nn.Module]) -> list:
    """Each projection's weight object (its packed int weight once quantized). Read from the modules' dicts: this
    runs every step, and nn.Module's attribute fallback costs ~1 us a lookup."""
    return [lin.quantized if lin.quantized is not None else lin._parameters["weight"] for lin in linears]


def _build(model: nn.Module) -> _Plan | None:
    """The plan for a DecoderModel whose layers are all its own blocks with SwiGLU (the model checks that:
    DecoderModel.plain_blocks), or None where any of their parts is outside what the driver runs."""
    if not all(cpu_kernels.available(k) for k in _STEP_KERNELS):
        return None
    layers = list(model.layers)
    if not layers:
        return None
    first = layers[0].self_attn
    H = model.norm.weight.shape[0]
    Hq, Hkv, D = first.num_heads, first.num_kv_heads, first.head_dim
    I = layers[0].mlp.gate_up_proj.out_features // 2
    eps = model.norm.eps
    if (D % 8 or D > cpu_decode.MAX_HEAD_DIM or Hq % Hkv or Hq // Hkv > cpu_decode.MAX_GROUP
            or model.norm.weight.dtype is not torch.float32):
        return None
    table = (_Layer * len(layers))()
    keep, kinds = [], set()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(attn.o_proj) is Linear and type(mlp.down_proj) is Linear
                and type(attn.qkv_proj) is MergedLinear and type(mlp.gate_up_proj) is MergedLinear
                and (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (Hq, Hkv, D)
                and mlp.gate_up_proj.out_features == 2 * I and attn.scaling == first.scaling):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if any(n.eps != eps or n.weight.dtype is not torch.float32 or not n.weight.is_contiguous() for n in norms):
            return None
        ws = []
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            got = _weight(lin)
            if got is None:
                return None
            ws.append(got[0])
            kinds.add(got[1])
            keep.extend(got[2])
        qn = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        kn = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        table[i] = _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                          qn, kn, *ws, None, None, attn.sliding_window or 0)
        keep.extend(n.weight for n in norms)
    int4 = {lin.quantized.kernel for lin in _linears(model) if lin.quantized is not None and lin.quantized.bits == 4}
    if len(int4) > 1:  # one int4 kernel per table; a model never mixes them (its weights come from one source)
        return None
    names = {**_KIND_KERNEL, W_INT4: int4.pop() if int4 else "int4_gemv"}
    if not all(cpu_kernels.available(names[k]) for k in kinds):
        return None
    fns = cpu_kernels.addresses()
    kernels = _Kernels(*(fns.get(names[k]) for k in range(5)), fns["rmsnorm"], fns["rotary"],
                       fns["silu_mul"], fns["decode_attention"])
    linears = _linears(model)
    return _Plan(table, kernels, keep, linears, _sources(linears), model.norm.weight, (H, Hq, Hkv, D, I), eps,
                 first.scaling)


def _plan_for(model: nn.Module) -> _Plan | None:
    plan = model.__dict__.get("_decode_stack_plan", False)
    if plan is None or (plan is not False and all(a is b for a, b in zip(plan.sources, _sources(plan.linears)))):
        return plan
    plan = _build(model)
    model.__dict__["_decode_stack_plan"] = plan
    return plan


def _attach_pool(plan: _Plan, pool: TokenToKVPool) -> bool:
    """Points the layer table at this pool's K/V buffers (when they moved); False where their layout does not
    suit the driver (float32 [slots, Hkv, D], contiguous). Keyed by every buffer's address: a new pool may
    reuse a freed one's memory for some layers and not others."""
    key = tuple(t.data_ptr() for kv in zip(pool.k_buffers, pool.v_buffers) for t in kv)
    if plan.pool_key == key:
        return True
    _, _, Hkv, D, _ = plan.dims
    bufs = list(zip(pool.k_buffers, pool.v_buffers))
    if len(bufs) < len(plan.layers) or not all(
            cpu_kernels.host_f32_inference(t) and t.dim() == 3 and tuple(t.shape[1:]) == (Hkv, D)
            for kv in bufs for t in kv):
        return False
    for i in range(len(plan.layers)):
        plan.layers[i].k_cache, plan.layers[i].v_cache = bufs[i][0].data_ptr(), bufs[i][1].data_ptr()
    plan.pool_key = key
    return True


def _lora_table(plan: _Plan, fb: ForwardBatch) -> tuple[ctypes.Array | None, int, int] | None:
    """(the LoRA table, the step's row slots' address, the number of slots) for a step with adapter rows,
    (None, 0, 0) without; None where the driver cannot run its adapters (the layers run the step then)."""
    if not fb.lora_rows:
        return None, 0, 0
    from tessera.layers.lora.slots import LoraSlots  # a step with adapter rows: the module is loaded already

    stacks = [lin.lora for lin in plan.linears]
    if not all(s is None or type(s) is LoraSlots for s in stacks) or not cpu_kernels.available("gemv"):
        return None
    step = next((s.step for s in stacks if s is not None), None)
    if step is None or not (step.groups is not None or step.graph):  # graph: a decode graph's padded step
        return None, 0, 0
    rows = step.row_slots
    if step.kernels or rows is None or not (rows.dtype is torch.int64 and is_host(rows.device)
                                            and rows.is_contiguous() and rows.shape == fb.input_ids.shape):
        return None
    key = tuple((s.A.data_ptr(), s.Bt.data_ptr(), s.A.shape[1]) if s is not None and s.rank else None
                for s in stacks)
    if plan.lora_key != key:
        if not all(s is None or not s.rank or (s.A.dtype is torch.float32 and s.Bt.dtype is torch.float32
                                               and is_host(s.A.device) and s.A.is_contiguous()
                                               and s.Bt.is_contiguous()) for s in stacks):
            return None
        plan.lora = (_Lora * len(stacks))(*(_Lora(*k) if k else _Lora() for k in key))
        plan.lora_key = key
    return plan.lora, rows.data_ptr(), max(s.num_slots for s in stacks if s is not None)


def run(model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        pool: TokenToKVPool) -> torch.Tensor | None:
    """The final-norm hidden states [M, H] of a decode step through the C driver, or None where it does not
    apply (nothing was written then: the caller runs the layers). `model` is a DecoderModel whose layers are
    all its own blocks with SwiGLU (it asks only then); the backend's metadata for `fb` must have been
    initialised (DecoderModel.forward does so first)."""
    plan = _checked_plan(model, x, cos, sin, fb.out_cache_loc)
    if plan is None:
        return None
    lora = _lora_table(plan, fb)
    if lora is None:
        return None
    paged = model.attn_backend.paged_decode_plan(fb, pool, plan.dims[1])
    if paged is None:
        return None
    return _launch(plan, x, cos, sin, fb.out_cache_loc, *paged, pool, lora)


def run_rows(model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor,
             slots: torch.Tensor, lens: torch.Tensor, pool: TokenToKVPool) -> torch.Tensor | None:
    """As run, for a caller that knows each row's KV slots itself (slots [M, >= max(lens)] int64, the first
    lens[i] read; the row's new K/V goes to loc[i], which is its last read slot) and so needs no ForwardBatch
    and no attention-backend plan: STANDALONE's draft model, whose few forwards per step cost mostly that
    planning (worker/draft_model.py). No LoRA rows. None where the driver does not apply."""
    plan = _checked_plan(model, x, cos, sin, loc)
    if plan is None or not (slots.dtype is torch.int64 and lens.dtype is torch.int64 and slots.stride(1) == 1
                            and lens.is_contiguous() and is_host(slots.device) and is_host(lens.device)
                            and cpu_decode.pool_readable(plan.dims[1], pool)):
        return None
    return _launch(plan, x, cos, sin, loc, slots, lens, pool, (None, 0, 0))


def _checked_plan(model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  loc: torch.Tensor) -> _Plan | None:
    m = x.shape[0]
    if not (enabled() and x.dim() == 2 and 0 < m <= cpu_gemv.max_rows()
            and cpu_kernels.host_f32_inference(x) and cpu_kernels.host_f32_inference(cos, sin, contiguous=False)):
        return None
    plan = _plan_for(model)
    # cos, sin: any row stride (M-RoPE's are transposed views), contiguous along the head dim
    if (plan is None or cos.shape != (m, plan.dims[3] // 2) or sin.shape != cos.shape
            or cos.stride() != sin.stride() or cos.stride(1) != 1):
        return None
    if not (loc.dtype is torch.int64 and is_host(loc.device) and loc.is_contiguous() and loc.shape == (m,)):
        return None
    return plan


def _launch(plan: _Plan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor,
            slots: torch.Tensor, lens: torch.Tensor, pool: TokenToKVPool, lora: tuple) -> torch.Tensor | None:
    if not _attach_pool(plan, pool):
        return None
    m = x.shape[0]
    H, Hq, Hkv, D, I = plan.dims
    out = torch.empty(m, H, dtype=torch.float32)
    rc = cpu_kernels.call("decode_stack", ctypes.byref(plan.kernels), plan.layers, len(plan.layers),
                          plan.final_norm.data_ptr(), x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          cos.stride(0), loc.data_ptr(), slots.data_ptr(), slots.stride(0), lens.data_ptr(), m, H,
                          Hq, Hkv, D, I, plan.eps, plan.scale, torch.get_num_threads(), *lora)
    if rc != 0:
        raise MemoryError(f"decode stack: no scratch memory for {m} rows")
    return out
