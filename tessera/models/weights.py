"""Loads HF safetensors checkpoints (single file or sharded) into our modules by an explicit name mapping.

Each model declares a WeightMapping: prefix rules rename checkpoint names to our parameter names (or drop
them), and stacked rules route separate checkpoint tensors (q_proj, k_proj, ...) into shards of a fused
module (qkv_proj, see layers/linear.MergedLinear). Every parameter (every shard of a fused one) must be
loaded exactly from the checkpoint, and every checkpoint tensor must land somewhere or be dropped by a rule;
otherwise WeightLoadError lists what is missing and what is unexpected. A pre-quantized checkpoint's linears
arrive as one AffineWeight each (models/quantized_weights.py) and are checked by the same rules.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tessera.layers.quantization.affine import AffineWeight
from tessera.layers.quantization.checkpoint_formats import CheckpointFormatError
from tessera.models.quant_config import QuantConfig
from tessera.models.quantized_weights import QuantizedCheckpoint

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model: missing and/or unexpected tensors, or shape mismatches."""


@dataclass(frozen=True)
class WeightMapping:
    """How checkpoint tensor names map onto a model's parameters.

    prefix_rules: (checkpoint prefix, our prefix or None) pairs; the first rule whose prefix starts the
        name wins; None drops the tensor (e.g. lm_head.weight when embeddings are tied, or the vision tower
        of a language-model-only load). A name no rule matches is unexpected.
    stacked: (checkpoint module, our fused module, shard id) triples, matched as a whole dotted path
        segment after renaming: `...self_attn.k_proj.bias` -> shard "k" of `...self_attn.qkv_proj.bias`.
    ignore: regexes (re.search) of checkpoint names to drop silently (e.g. stale rotary buffers).
    stacked_prefix: stacked rules apply only to our names starting with it (e.g. "model.", so that an
        encoder module with its own separate q_proj/k_proj/v_proj keeps them).
    renames: (old, new) substrings replaced in every name after the prefix rules, before the stacked rules: a
        checkpoint saved with other module names (Cosmos3's Diffusers-style `.self_attn.to_q.`).
    fused: (checkpoint module, the modules it concatenates along its rows in equal parts) pairs, e.g. GLM-4's
        ("gate_up_proj", ("gate_proj", "up_proj")): such a tensor is split into those modules' tensors first,
        which then map like any other (so the stacked rules place them as shards).
    """

    prefix_rules: tuple[tuple[str, str | None], ...]
    stacked: tuple[tuple[str, str, str], ...] = ()
    ignore: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)
    stacked_prefix: str = ""
    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Mixture-of-experts checkpoints that keep each expert apart (`experts.3.gate_proj.weight`; Qwen3-Next,
    # Qwen3.5-MoE) for our stacked experts (layers/moe.StackedExperts): shard "3.gate" of `experts.gate_up_proj`.
    per_expert: bool = False

    def convert(self, name: str, tensor: torch.Tensor | AffineWeight) -> list[tuple[str, torch.Tensor | AffineWeight]]:
        """A checkpoint tensor as the tensors it stands for, before renaming: its `fused` split (split_fused). A
        family storing several of our parameters in one another way overrides it (Kimi-K2.5's fused, rope-permuted
        vision qkv)."""
        return self.split_fused(name, tensor)

    def split_fused(self, name: str, tensor: torch.Tensor | AffineWeight
                    ) -> list[tuple[str, torch.Tensor | AffineWeight]]:
        """The (name, tensor) pairs of the modules a `fused` checkpoint tensor concatenates; itself otherwise (also
        what a LoRA pair on such a module is split by, layers/lora/adapter.py)."""
        for fused_mod, parts in self.fused:
            segment = f".{fused_mod}."
            if segment in name:
                rows = tensor.shape[0] // len(parts)
                pieces = (tensor.rows(i * rows, rows) if isinstance(tensor, AffineWeight) else tensor[i * rows:][:rows]
                          for i in range(len(parts)))
                return [(name.replace(segment, f".{part}.", 1), piece) for part, piece in zip(parts, pieces)]
        return [(name, tensor)]

    def map_name(self, name: str) -> tuple[str, str | None] | None:
        """Checkpoint name -> (our parameter name, shard id or None); None = drop; KeyError = unexpected."""
        if any(re.search(p, name) for p in self.ignore):
            return None
        for ckpt_prefix, our_prefix in self.prefix_rules:
            if name.startswith(ckpt_prefix):
                if our_prefix is None:
                    return None
                ours = our_prefix + name[len(ckpt_prefix):]
                break
        else:
            raise KeyError(name)
        for old, new in self.renames:
            ours = ours.replace(old, new)
        if not ours.startswith(self.stacked_prefix):
            return ours, None
        if self.per_expert and (m := _PER_EXPERT.search(ours)):
            index, kind = m.groups()
            param = "down_proj" if kind == "down" else "gate_up_proj"
            return f"{ours[:m.start()]}.experts.{param}", f"{index}.{kind}"
        for ckpt_mod, our_mod, shard_id in self.stacked:
            segment = f".{ckpt_mod}."
            if segment in ours:
                return ours.replace(segment, f".{our_mod}.", 1), shard_id
        return ours, None


_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a local HF checkpoint directory (index-listed shards or one file)."""
    root = Path(model_path)
    index = root / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    if (root / SAFETENSORS_SINGLE).exists():
        return [root / SAFETENSORS_SINGLE]
    files = sorted(root.glob("*.safetensors"))
    if not files and (root / "model_index.json").exists() and (root / "transformer").is_dir():
        # A Diffusers pipeline (--model-type llm): its `transformer` component holds the understanding tower.
        return checkpoint_files(root / "transformer")
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (model_path must be a local HF checkpoint dir)")
    return files


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one tensor at a time, so peak host memory stays near one tensor.

    A progress bar over the shards goes to stderr when tessera logs at info level (the server does; tests
    and library use, which configure no logging, stay quiet; so does TQDM_DISABLE=1, set by --disable-tqdm)."""
    files = checkpoint_files(model_path)
    if logging.getLogger("tessera").isEnabledFor(logging.INFO) and not os.environ.get("TQDM_DISABLE"):
        from tqdm import tqdm

        files = tqdm(files, desc="Loading safetensors shards", unit="shard", dynamic_ncols=True)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _expected_entries(model: nn.Module) -> set[tuple[str, str | None]]:
    """(parameter name, shard id) pairs that must be loaded; tied parameters appear once."""
    expected: set[tuple[str, str | None]] = set()
    for name, _ in model.named_parameters():
        module_name, _, _ = name.rpartition(".")
        shard_ids = getattr(model.get_submodule(module_name), "shard_ids", None)
        if shard_ids is None:
            expected.add((name, None))
        else:
            expected.update((name, s) for s in shard_ids)
    return expected


@torch.no_grad()
def load_weights(model: nn.Module, model_path: str | Path, mapping: WeightMapping,
                 quant: QuantConfig | None = None) -> dict[str, str]:
    """Copies every checkpoint tensor into its parameter (casting to the parameter's dtype and device).

    With `quant` (a pre-quantized checkpoint) each quantized linear's stored tensors become one AffineWeight
    (models/quantized_weights.py); a module's are gathered (every shard of a fused one) and placed together
    (_place_quantized). Returns, per quantized weight (our name), what runs it ({} for a float checkpoint). Raises
    WeightLoadError naming missing parameters, unexpected checkpoint tensors, shape mismatches and
    inconsistent quantized tensors.
    """
    params = dict(model.named_parameters())
    expected = _expected_entries(model)
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    held: dict[str, dict[str | None, AffineWeight]] = {}  # our weight name -> its quantized shards so far
    placed: dict[str, str] = {}
    quantized = QuantizedCheckpoint(quant) if quant is not None else None
    for ckpt_name, tensor in _converted(mapping, _checkpoint_tensors(model_path, quantized)):
        try:
            target = mapping.map_name(ckpt_name)
        except KeyError:
            unexpected.append(ckpt_name)
            continue
        if target is None:
            continue
        name, shard_id = target
        # One expert of stacked experts (per_expert: shard "3.gate" of a whole [E, ...] parameter). Families that
        # register each expert's shard themselves (Kimi-K2.5, GLM-4.5V) take the general path below.
        if shard_id is not None and shard_id[0].isdigit() and (name, None) in expected and params[name].dim() == 3:
            if model.get_submodule(name.rpartition(".")[0]).load_expert(name.rpartition(".")[2], shard_id, tensor):
                loaded.add((name, None))  # every expert's tensor has come
            continue
        if (name, shard_id) not in expected:
            target_name = f"{name}[{shard_id}]" if shard_id else name
            unexpected.append(ckpt_name if target_name == ckpt_name else f"{ckpt_name} (-> {target_name})")
            continue
        try:
            if isinstance(tensor, AffineWeight):
                shards = held.setdefault(name, {})
                shards[shard_id] = tensor
                module = model.get_submodule(name.rpartition(".")[0])
                if set(shards) >= set(getattr(module, "shard_ids", None) or [None]):
                    placed[name] = _place_quantized(model, params, name, held.pop(name))
            else:
                _copy_into(model, params, name, shard_id, tensor)
                if quantized is not None and ckpt_name in quantized.dequantized:
                    placed[name] = f"dequantized to {str(params[name].dtype).removeprefix('torch.')}"
        except ValueError as e:
            mismatched.append(f"{ckpt_name}: {e}")
            continue
        loaded.add((name, shard_id))

    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing or unexpected or mismatched:
        raise WeightLoadError(
            f"checkpoint {model_path} does not match {type(model).__name__}:"
            + _listing("missing", missing) + _listing("unexpected", unexpected) + _listing("shape mismatch", mismatched)
        )
    return placed


def _copy_into(model: nn.Module, params: dict[str, nn.Parameter], name: str, shard_id: str | None,
               tensor: torch.Tensor) -> None:
    """One checkpoint tensor into parameter `name` (shard `shard_id` of a fused one); ValueError on a shape
    mismatch."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if shard_id is not None:
        module.load_shard(param_name, shard_id, tensor)  # fused modules (layers/linear.MergedLinear)
        return
    # Tensor-parallel modules take their rank's slice of the full checkpoint tensor themselves.
    load_param = getattr(module, "load_param", None)
    if load_param is not None:
        load_param(param_name, tensor)
    elif params[name].shape != tensor.shape:
        raise ValueError(f"checkpoint {tuple(tensor.shape)}, model {tuple(params[name].shape)}")
    else:
        params[name].copy_(tensor)


def _place_quantized(model: nn.Module, params: dict[str, nn.Parameter], name: str,
                     shards: dict[str | None, AffineWeight]) -> str:
    """A quantized linear's weight, all its shards at once; returns what runs it. A linear that runs int weights
    (`set_quantized`, `set_quantized_shards` of a fused one) takes the AffineWeights, a row-parallel one its
    rank's columns; otherwise the always-correct path: the float weight each stands for, through the float
    loaders."""
    module = model.get_submodule(name.rpartition(".")[0])
    if name.endswith(".weight") and None in shards and hasattr(module, "set_quantized"):
        weight = shards[None]
        full = getattr(module, "full_in_features", module.in_features)
        if weight.shape != (module.out_features, full):
            raise ValueError(f"checkpoint {weight.shape}, want {(module.out_features, full)}")
        module.set_quantized(weight if full == module.in_features else weight.columns(module.start, module.in_features))
        return module.quant_path
    if name.endswith(".weight") and None not in shards and hasattr(module, "set_quantized_shards"):
        module.set_quantized_shards(shards)
        return module.quant_path
    for shard_id, weight in shards.items():
        _copy_into(model, params, name, shard_id, weight.dequantize(torch.float32))
    return f"dequantized to {str(params[name].dtype).removeprefix('torch.')}"


def _checkpoint_tensors(model_path: str | Path, quantized: QuantizedCheckpoint | None
                        ) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
    """The checkpoint's tensors, a quantized module's grouped into one weight; a quantized module's tensors
    that contradict each other or the config raise WeightLoadError naming it."""
    tensors = iter_checkpoint(model_path)
    try:
        yield from tensors if quantized is None else quantized.stream(tensors)
    except CheckpointFormatError as e:
        raise WeightLoadError(f"checkpoint {model_path}: {e}") from None


def _converted(mapping: WeightMapping, tensors: Iterator[tuple[str, torch.Tensor | AffineWeight]]
               ) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
    for name, tensor in tensors:
        # Kimi's override reads plain tensors only; a quantized tensor takes the fused splits alone.
        yield from mapping.convert(name, tensor) if isinstance(tensor, torch.Tensor) else mapping.split_fused(name, tensor)


def _listing(title: str, names: list[str], limit: int = 20) -> str:
    if not names:
        return ""
    shown = "\n    ".join(names[:limit])
    more = f"\n    ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"\n  {title} ({len(names)}):\n    {shown}{more}"
