"""An adapter's tensors mapped onto our modules, checked against their shapes, held on the host.

PEFT saves `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] per targeted
module, named as transformers names it. The model's own checkpoint mapping (models/weights.WeightMapping)
turns `<module>.weight` into our parameter and shard: `...self_attn.k_proj` is shard "k" of our merged
`qkv_proj`, `...mlp.up_proj` shard "up" of `gate_up_proj`. Under tensor parallelism a column-parallel
shard keeps its rows of B (as the base weight keeps its rows) and a row-parallel layer its columns of A
(its partial product is summed over the ranks with the base layer's). The linear layers take adapters: ours,
and in the encoders (transformers' own towers) torch's nn.Linear too (layers/lora/slots.attach_encoder_lora);
anything else is refused with the module named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tessera.layers.linear import Linear, MergedLinear, RowParallelLinear, VocabEmbedding
from tessera.layers.lora.config import ADAPTER_WEIGHTS, AdapterError, LoraAdapterConfig, read_adapter_config

PEFT_PREFIX = "base_model.model."


def on_token_rows(model: nn.Module, module: str) -> bool:
    """Whether our module `module` runs on a step's token rows (each row adds its own request's adapter: LoRA
    slots) rather than on an encoder call's rows (one adapter per call: EncoderLora); the model says
    (TesseraModel.lora_on_token_rows: its decoder, `model.` in every decoder-only family)."""
    return model.lora_on_token_rows(module)


@dataclass
class LoraAdapter:
    """One adapter on the host: per our module name, per shard (in the module's shard order; one entry for a
    plain linear), (A [r, in], B [out, r] times the scaling) or None where that shard is not targeted."""

    name: str
    path: str
    config: LoraAdapterConfig
    modules: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
    rank: int  # the largest rank of any module

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for shards in self.modules.values() for p in shards if p
                   for t in p)


def load_adapter(name: str, path: str | Path, model: nn.Module, mapping, max_rank: int | None = None,
                 encoders: bool = True) -> LoraAdapter:
    """Reads and checks the adapter at `path` against `model` (whose checkpoint names `mapping` maps).
    AdapterError names the adapter and the first problem: a refused config field, a tensor of a module we do not
    have or do not adapt (embeddings, the LM head, MoE experts; the encoders' linears where `encoders` is False),
    a wrong shape, a rank above `max_rank`."""
    config = read_adapter_config(path, name)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others: list[str] = []  # refused after the LoRA pairs' modules, whose refusal says more
    try:
        with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
            for key in sorted(f.keys(), key=lambda k: "lora_embedding_" not in k):  # the clearest refusal first
                split = _split_key(name, key)
                if split is None:
                    others.append(key)
                else:
                    pairs.setdefault(split[0], {})[split[1]] = f.get_tensor(key)
    except (OSError, RuntimeError, ValueError) as e:
        if isinstance(e, AdapterError):
            raise
        raise AdapterError(f"adapter {name!r}: cannot read {ADAPTER_WEIGHTS}: {e}") from None
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA tensors")
    pairs = _split_fused(pairs, mapping)
    modules: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    top = 0
    for module_path, tensors in sorted(pairs.items()):
        if set(tensors) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(tensors)).pop()
            raise AdapterError(f"adapter {name!r}: {module_path}: no {missing}.weight")
        target, shard, linear = _our_module(name, module_path, model, mapping, encoders)
        a, b = tensors["lora_A"].float(), tensors["lora_B"].float()
        rank = a.shape[0]
        want_rank, _ = config.rank_alpha(module_path)
        full_in, full_out = _full_shape(linear, shard)
        if a.dim() != 2 or b.dim() != 2 or rank != want_rank or a.shape[1] != full_in or tuple(b.shape) != (full_out, rank):
            raise AdapterError(f"adapter {name!r}: {module_path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                               f"want [{want_rank}, {full_in}] / [{full_out}, {want_rank}] (r from the config)")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"adapter {name!r}: {module_path}: rank {rank} is above --max-lora-rank {max_rank}")
        a, b = _this_rank(linear, shard, a, b)
        shards = modules.setdefault(target, [None] * len(_shard_ids(linear)))
        shards[_shard_ids(linear).index(shard)] = (a.contiguous(), (b * config.scaling(module_path, rank)).contiguous())
        top = max(top, rank)
    if others:
        key = others[0]
        why = ("base-model weights saved with the adapter (a resized vocabulary?) are not supported"
               if key.endswith(".base_layer.weight") else f"unexpected (want {PEFT_PREFIX}<module>.lora_A/B.weight)")
        raise AdapterError(f"adapter {name!r}: {key}: {why}")
    return LoraAdapter(name, str(path), config, modules, top)


def _split_fused(pairs: dict[str, dict[str, torch.Tensor]], mapping) -> dict[str, dict[str, torch.Tensor]]:
    """A pair on a checkpoint module that concatenates several along its rows (WeightMapping.fused: GLM-4's
    gate_up_proj) as that pair on each part: the same A, B's rows in equal parts."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path, tensors in pairs.items():
        b = tensors.get("lora_B")
        for part, piece in mapping.split_fused(path + ".weight", b) if b is not None else [(path + ".weight", b)]:
            out[part.removesuffix(".weight")] = tensors if piece is None else {**tensors, "lora_B": piece}
    return out


def _split_key(name: str, key: str) -> tuple[str, str] | None:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "lora_A"); None for a tensor of no LoRA pair;
    AdapterError for the kinds of LoRA refused."""
    if "lora_embedding_" in key:
        raise AdapterError(f"adapter {name!r}: {key}: LoRA on embeddings is not supported")
    if "lora_magnitude_vector" in key:
        raise AdapterError(f"adapter {name!r}: {key}: DoRA is not supported")
    for kind in ("lora_A", "lora_B"):
        tail = f".{kind}.weight"
        if key.endswith(tail) and key.startswith(PEFT_PREFIX):
            return key[len(PEFT_PREFIX):-len(tail)], kind
    return None


def _our_module(name: str, module_path: str, model: nn.Module, mapping,
                encoders: bool) -> tuple[str, str | None, Linear | nn.Linear]:
    try:
        target = mapping.map_name(module_path + ".weight")
    except KeyError:
        target = None
    if target is None:
        raise AdapterError(f"adapter {name!r}: {module_path}: no such module in {type(model).__name__}")
    param, shard = target
    ours = param.rpartition(".")[0]
    try:
        module = model.get_submodule(ours)
    except AttributeError:
        raise AdapterError(f"adapter {name!r}: {module_path}: no such module in {type(model).__name__}") from None
    if isinstance(module, VocabEmbedding):
        raise AdapterError(f"adapter {name!r}: {module_path}: LoRA on embeddings and the LM head is not supported")
    refusal = getattr(module, "lora_refusal", None)  # a layer that says why it takes none (the MoE router)
    if refusal:
        raise AdapterError(f"adapter {name!r}: {module_path}: {refusal}")
    rows = on_token_rows(model, ours)
    # transformers' own towers keep torch's nn.Linear: an encoder's adapter is added by a forward hook there
    if not isinstance(module, Linear) and (rows or type(module) is not nn.Linear):
        raise AdapterError(f"adapter {name!r}: {module_path}: LoRA on {type(module).__name__} is not supported "
                           f"(only on linear layers)")
    if not rows and not encoders:
        raise AdapterError(f"adapter {name!r}: {module_path}: LoRA on the vision tower is not supported with "
                           f"--mm-enable-dp-encoder")
    if isinstance(module, MergedLinear) != (shard is not None):
        raise AdapterError(f"adapter {name!r}: {module_path}: does not map onto {ours}")
    return ours, shard, module


def _shard_ids(linear: Linear) -> list[str | None]:
    return linear.shard_ids if isinstance(linear, MergedLinear) else [None]


def _full_shape(linear: Linear, shard: str | None) -> tuple[int, int]:
    """(in, out) of the checkpoint's weight this adapter module pairs with (the full one under TP)."""
    full_in = linear.full_in_features if isinstance(linear, RowParallelLinear) else linear.in_features
    if isinstance(linear, MergedLinear):
        assert shard is not None
        out = linear.sources[shard][1] if shard in linear.sources else linear.output_sizes[shard]
        return full_in, out
    return full_in, linear.out_features


def _this_rank(linear: Linear, shard: str | None, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part: B's rows of a column-parallel shard, A's columns of a row-parallel layer."""
    if isinstance(linear, MergedLinear) and shard in linear.sources:
        start, _ = linear.sources[shard]
        b = b.narrow(0, start, linear.output_sizes[shard])
    if isinstance(linear, RowParallelLinear) and linear.in_features != linear.full_in_features:
        a = a.narrow(1, linear.start, linear.in_features)
    return a, b
