"""Linear layers whose parameters are allocated but not initialised (weights always come from a checkpoint).

MergedLinear stacks several projections of the same input (q/k/v, gate/up) into one matmul; the weight
loader fills each shard from the checkpoint's separate tensors via `load_shard`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers import cpu_gemv, half_linear
from tessera.layers.quantization.affine import AffineWeight
from tessera.layers.quantization.int_linear import PackedIntWeight
from tessera.platform import cpu_kernels
from tessera.platform.device import is_host

# A large float32 weight on a CPU with more than one torch thread: oneDNN's fused linear instead of MKL's sgemm,
# at any number of rows. MKL ran few-row products on one core even with two threads, and on this project's AMD
# EPYC its sgemm reached 77-95 GFLOP/s at 256-2,048 rows where oneDNN's reached 94-118: a 256-token prefill of
# bench-medium went from 340 to 473 tok/s (docs/benchmarks.md, "oneDNN for prefill products too"). Small
# (cache-resident) weights and one thread stay with F.linear, where oneDNN was level or slower. Measured on one
# 2-vCPU machine; on another CPU (an Intel one, where MKL is at home) it is a starting point, not a rule.
ONEDNN_MIN_WEIGHT = 1 << 19  # values in the weight
# On a CPU with AVX-512, oneDNN from ONEDNN_MIN_ROWS rows at every weight size and thread count: MKL does not
# take its AVX-512 paths on AMD's CPUs, and on an AVX-512 AMD EPYC oneDNN ran the vision tower's and demo-vl's
# small products (weights of 16K-180K values, 256-1,024 rows) 1.7-2.3x faster than F.linear on one thread and
# on two (docs/benchmarks.md, "AVX-512"). Below that many rows F.linear or our kernel (cpu_gemv) stays.
ONEDNN_MIN_ROWS = 16
_onednn_linear = cpu_kernels.onednn_linear()
_onednn_any_size = "avx512f" in cpu_kernels.cpu_flags()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through our CPU kernel (see cpu_gemv.py) or oneDNN (see ONEDNN_MIN_WEIGHT) where those measured
    faster; inference only. A 16-bit weight with float32 x (a bf16/fp16 model on a CPU) goes to half_linear.py."""
    if weight.dtype is not x.dtype and half_linear.applies(x, weight):
        return half_linear.half_linear(x, weight, bias, linear)
    if cpu_gemv.applies(x, weight, bias):
        return cpu_gemv.gemv(x, weight, bias)
    if (_onednn_linear is not None and x.dim() == 2
            and ((weight.numel() >= ONEDNN_MIN_WEIGHT and torch.get_num_threads() > 1)
                 or (_onednn_any_size and x.shape[0] >= ONEDNN_MIN_ROWS))
            and cpu_kernels.host_f32_inference(x, weight, contiguous=False) and x.is_contiguous()):
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.no_grad()
def keep_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Reallocates the weights of every Linear, embedding table and LM head in `dtype`, uninitialised, before
    the checkpoint is loaded into them: a float32-built model whose products read 16-bit weights (see
    half_linear.py) and whose tables give float32 rows (VocabEmbedding.like). Biases and norms stay in the
    build dtype. A tied LM head stays the embedding table's parameter."""
    new: dict[int, nn.Parameter] = {}  # old parameter -> its 16-bit replacement, so tied ones stay one
    for module in model.modules():
        if isinstance(module, (Linear, VocabEmbedding)):
            old = module.weight
            if id(old) not in new:
                new[id(old)] = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=old.device),
                                            requires_grad=old.requires_grad)
            module.weight = new[id(old)]


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features]. After set_quantized the weight is an
    int8 / int4 one packed for its kernel (`quantized`) and `weight` is None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quantized: PackedIntWeight | None = None
        self.quant_path = ""  # what runs the quantized weight ("" while float), for reports
        # LoRA stacks (layers/lora/slots.LoraSlots) once an adapter targets this layer: adds each row's adapter
        # product to the output, in place, during a step with adapter rows.
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, bias, dense=linear)
        return linear(x, self.weight, bias)

    @torch.no_grad()
    def set_quantized(self, weight: AffineWeight, path: str | None = None, bf16_activations: bool = False) -> None:
        """Replaces the float weight by `weight` (this module's [out_features, in_features]: a shard under tensor
        parallelism), packed now for the kernel chosen for this CPU (int_linear.PackedIntWeight; `path` forces
        one: "c", "torch" or "affine"; `bf16_activations` as there). Off the host the weight is kept dequantized
        in the model's dtype instead. The bias, if any, stays float."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {weight.shape}, want {(self.out_features, self.in_features)}")
        old = self.weight
        device = old.device if old is not None else (self.bias.device if self.bias is not None else torch.device("cpu"))
        if not is_host(device):
            dtype = old.dtype if old is not None else torch.get_default_dtype()
            self.weight = nn.Parameter(weight.dequantize(dtype).to(device), requires_grad=False)
            self.quant_path = f"int{weight.bits} dequantized to {str(dtype).removeprefix('torch.')} on {device}"
            return
        self.quantized = PackedIntWeight(weight, path, bf16_activations)
        self.quant_path = self.quantized.description
        self.weight = None  # frees the float weight (the module held the only reference after loading)


class MergedLinear(Linear):
    """Projections of one input concatenated along the output dim, in the order of `output_sizes`.

    Tensor parallel (column-parallel): `sources` gives, per shard, the first checkpoint row of this rank's
    part and the checkpoint's full row count; the shard loads rows [start, start + size) of the full tensor.
    """

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False,
                 sources: dict[str, tuple[int, int]] | None = None):
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_sizes = dict(output_sizes)
        self.sources = dict(sources or {})
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in self.output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    @property
    def shard_ids(self) -> list[str]:
        return list(self.output_sizes)

    @torch.no_grad()
    def load_shard(self, param_name: str, shard_id: str, loaded: torch.Tensor) -> None:
        """Copies one checkpoint tensor (e.g. k_proj.bias) into its rows of `param_name` (weight/bias)."""
        param = getattr(self, param_name)
        offset, size = self.shard_offsets[shard_id]
        if shard_id in self.sources:
            start, full = self.sources[shard_id]
            if loaded.shape[0] != full:
                raise ValueError(f"shard {shard_id!r} of {param_name}: checkpoint has {loaded.shape[0]} rows, "
                                 f"want {full}")
            loaded = loaded.narrow(0, start, size)
        want = (size, *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"shard {shard_id!r} of {param_name}: checkpoint shape {tuple(loaded.shape)}, want {want}")
        param[offset:offset + size].copy_(loaded)

    def set_quantized_shards(self, shards: dict[str, AffineWeight], path: str | None = None) -> None:
        """set_quantized from one AffineWeight per shard as the checkpoint holds it (q_proj, k_proj, ...: its
        full rows; under tensor parallelism this rank's rows are taken as load_shard takes them)."""
        if set(shards) != set(self.output_sizes):
            raise ValueError(f"quantized shards {sorted(shards)}, want {sorted(self.output_sizes)}")
        parts = []
        for shard_id, size in self.output_sizes.items():
            part = shards[shard_id]
            if shard_id in self.sources:
                start, full = self.sources[shard_id]
                if part.shape[0] != full:
                    raise ValueError(f"shard {shard_id!r}: checkpoint has {part.shape[0]} rows, want {full}")
                part = part.rows(start, size)
            parts.append(part)
        self.set_quantized(AffineWeight.cat_rows(parts), path)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Output [..., out_features] -> one view per shard, in order."""
        return y.split(list(self.output_sizes.values()), dim=-1)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]. The table may be 16-bit under float32 activations
    (keep_weights_in): `like` is an empty tensor in the activations' dtype and device, what the models cast
    their media inputs and embeddings to, and the rows looked up are cast to it."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.register_buffer("like", torch.empty(0), persistent=False)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight)
        return out if out.dtype == self.like.dtype else out.to(self.like.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._lookup(input_ids)


class RowParallelLinear(Linear):
    """Tensor parallel: this rank holds columns [start, start + in_features) of the weight (its share of the
    input features); partial outputs are summed over the ranks, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, start: int = 0,
                 full_in_features: int | None = None):
        super().__init__(in_features, out_features, bias)
        self.start, self.full_in_features = start, full_in_features or in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tessera.distributed.parallel_state import all_reduce

        part = self._product(x, None)
        if self.lora is not None:  # x A^T is linear in x's columns: the ranks' partial products sum to it
            part = self.lora(x, part)
        y = all_reduce(part)
        return y if self.bias is None else y + self.bias

    def set_quantized(self, weight: AffineWeight, path: str | None = None, bf16_activations: bool = False) -> None:
        """As Linear's; also takes the checkpoint's full [out_features, full_in_features] weight, of which this
        rank keeps its columns (they must fall on group boundaries)."""
        if weight.shape == (self.out_features, self.full_in_features) != (self.out_features, self.in_features):
            weight = weight.columns(self.start, self.in_features)
        super().set_quantized(weight, path, bf16_activations)

    @torch.no_grad()
    def load_param(self, param_name: str, loaded: torch.Tensor) -> None:
        param = getattr(self, param_name)
        if param_name == "weight":
            if loaded.shape != (self.out_features, self.full_in_features):
                raise ValueError(f"checkpoint {tuple(loaded.shape)}, want {(self.out_features, self.full_in_features)}")
            loaded = loaded.narrow(1, self.start, self.in_features)
        if loaded.shape != param.shape:
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
        param.copy_(loaded)


class VocabParallelEmbedding(VocabEmbedding):
    """Tensor parallel: this rank holds vocabulary rows [start, start + rows) (the vocab padded to a multiple
    of the ranks); ids outside them embed to zero and the ranks' results are summed. The same shard is the
    LM head's when embeddings are tied (see ParallelLMHead)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 0, size: int = 1):
        per = -(-vocab_size // size)
        super().__init__(per, hidden_size)
        self.vocab_size, self.start, self.rows, self.tp_size = vocab_size, rank * per, per, size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        from tessera.distributed.parallel_state import all_reduce

        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill(outside[:, None], 0))

    @torch.no_grad()
    def load_param(self, param_name: str, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != self.weight.shape[1:]:
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, want {(self.vocab_size, *self.weight.shape[1:])}")
        part = loaded[self.start:self.start + self.rows]
        self.weight.zero_()  # padding rows past the vocabulary stay zero
        self.weight[: part.shape[0]].copy_(part)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden -> logits over this rank's vocabulary shard, gathered from all ranks into the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from tessera.distributed.parallel_state import all_gather_last_dim

        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]


def count_parameters(model: nn.Module, tp_size: int) -> int:
    """The whole model's parameter count from one rank's modules: a tensor-parallel shard counts as the
    checkpoint tensor it is cut from (a vocabulary shard as the true vocabulary; a KV head replicated on every
    rank once), a replicated module (norms, the vision tower) once, a packed int weight as its float weight."""
    total, seen = 0, set()
    for m in model.modules():
        fresh = [p for p in m.parameters(recurse=False) if id(p) not in seen]  # a tied LM head counts once
        seen.update(id(p) for p in fresh)
        own = sum(p.numel() for p in fresh)
        if getattr(m, "quantized", None) is not None:
            own += m.in_features * m.out_features
        if tp_size == 1 or not (fresh or getattr(m, "quantized", None) is not None):
            pass
        elif isinstance(m, VocabParallelEmbedding):
            own = m.vocab_size * m.weight.shape[1]
        elif isinstance(m, RowParallelLinear):
            own = m.out_features * m.full_in_features + (m.out_features if m.bias is not None else 0)
        elif hasattr(m, "full_parameter_count"):  # a module that shards itself (layers/moe.StackedExperts)
            own = m.full_parameter_count()
        elif isinstance(m, MergedLinear) and m.sources:
            rows = sum(m.sources[k][1] if k in m.sources else size for k, size in m.output_sizes.items())
            own = rows * (m.in_features + (1 if m.bias is not None else 0))
        total += own
    return total
