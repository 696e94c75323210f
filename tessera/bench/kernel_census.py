"""`python -m tessera.bench.kernel_census [--json]`: how many kernels one decode step launches per decoder layer
on the CUDA path, per family, counted on a CPU.

A batch-1 decode step on a GPU costs about a fixed time per kernel (launch, ramp-up, a tail on idle SMs), so
the count per layer is what to drive down (issue 48; SGLang's fused path launches nine: norm, QKV, rotary +
KV write, attention, O, add + norm, gate-up, SiLU-mul, down). The step counted is the one a CUDA graph captures
(worker/cuda_graph.py's padded decode forward, batch 1, Triton attention backend, bfloat16), run where the
GPU's path runs without a GPU: under Triton's interpreter (TRITON_INTERPRET=1; without it and without CUDA the
census reruns itself in a subprocess that sets it), where the layers take the same fused kernels as on CUDA
(layers/fused.py). Counted inside each decoder layer's forward:

- each Triton launch (its kernel's name);
- each aten operator that reaches a device kernel: every operator but views and allocations (which launch
  nothing), with the interpreter's own host copies inside a launch left out (worker/graph_safety.py's hook).

A bfloat16 model on a CPU runs no C kernel of ours (they take float32 only), so what runs is torch's operators
and the Triton kernels, as on a GPU. `--json` prints {"families": {name: {"kernels_per_layer": N,
"kernels": {kernel: count per layer}, "outside_layers": M, "layers": L}}, ...}; the names are the HF
model_type of each family's config. tests/bench/test_kernel_census.py fails when a count rises above the one
recorded there (figures beside SGLang's: docs/benchmarks.md, "Kernels per decoder layer").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Operators that allocate without writing (no kernel): torch.empty and its kin.
_NO_KERNEL = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                        _aten.new_empty.default, _aten.new_empty_strided.default})


def _text(**extra: Any) -> dict:
    """The shared tiny text sizes (2 layers, GQA 4/2, head_dim 16)."""
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, **extra)


def _configs() -> dict[str, Callable[[], Any]]:
    """model_type -> a tiny HF config of a family (the sizes do not change what a layer launches)."""
    import transformers as tf

    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    return {
        "qwen2": lambda: tf.Qwen2Config(**_text(), architectures=["Qwen2ForCausalLM"]),
        "qwen3": lambda: tf.Qwen3Config(**_text(head_dim=16), architectures=["Qwen3ForCausalLM"]),
        "qwen2_vl": lambda: tf.Qwen2VLConfig(text_config=_text(rope_parameters=mrope),
                                             vision_config=dict(vision, mlp_ratio=2),
                                             architectures=["Qwen2VLForConditionalGeneration"]),
        "qwen2_5_vl": lambda: tf.Qwen2_5_VLConfig(
            text_config=_text(rope_parameters=mrope),
            vision_config=dict(vision, intermediate_size=64, out_hidden_size=64, window_size=56,
                               fullatt_block_indexes=[0]),
            architectures=["Qwen2_5_VLForConditionalGeneration"]),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**_text(head_dim=16, sliding_window=8),
                                                   architectures=["Gemma3ForCausalLM"]),
    }


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The language model's layer list (not a vision tower's)."""
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == num_layers
                and not any(part in name for part in ("vision", "visual", "encoder", "tower"))):
            return module
    raise LookupError(f"{type(model).__name__}: no decoder layer list of {num_layers} layers")


class _Counter(TorchDispatchMode):
    """Counts, per decoder layer, the operators that reach a kernel and the Triton launches."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.layer: int | None = None
        self.per_layer: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.outside = 0

    def launched(self, kernel: str) -> None:
        self._add(f"triton:{kernel}")

    def _add(self, name: str) -> None:
        if self.layer is None:
            self.outside += 1
        else:
            self.per_layer[self.layer][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.state.suspended and func not in _NO_KERNEL and (not func.is_view or _copied(args, out)):
            self._add(str(func))
        return out


def _copied(args: tuple, out: Any) -> bool:
    """Whether an operator that may alias its input (`aten.to` is one) made a new tensor instead: a cast or a
    move, which is a kernel."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return (isinstance(out, torch.Tensor) and first is not None
            and out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr())


def random_model(config, device: torch.device) -> nn.Module:
    """The family's model as the worker builds it for a GPU (Triton backend), random weights in bfloat16."""
    from tessera.layers.attention import get_attention_backend

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = config.family.model_class().build(config, get_attention_backend("triton"))
    finally:
        torch.set_default_dtype(old)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval().requires_grad_(False)


def census_of(model_type: str, make_config: Callable[[], Any], device: torch.device) -> dict:
    """One family's counts over a batch-1 padded decode step (what a CUDA graph captures)."""
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.models.config import ModelConfig
    from tessera.worker.cuda_graph import DecodeGraphRunner, DecodeInputs
    from tessera.worker.graph_safety import LaunchState, launches_exempt

    config = ModelConfig.from_hf(make_config())
    model = random_model(config, device)
    layout = model.kv_layout
    pool = TokenToKVPool(32, layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype=torch.bfloat16,
                         device=device)
    req_to_token = torch.zeros(3, 32, dtype=torch.int64, device=device)
    req_to_token[0, :10] = torch.arange(1, 11, device=device)
    mrope = config.positions == "mrope"
    runner = DecodeGraphRunner(model, pool, req_to_token, [1], pad_row=2, mrope=mrope)
    lens = torch.tensor([9], device=device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    inputs = DecodeInputs(input_ids=torch.tensor([5], device=device),
                          positions=lens.expand(3, -1).clone() if mrope else lens.clone(),
                          out_cache_loc=req_to_token[rows, lens], req_pool_indices=rows, seq_lens=lens + 1)
    layers = _decoder_layers(model, config.num_layers)
    state = LaunchState()
    counter = _Counter(state)
    state.launched = counter.launched
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(counter, "layer", i)))
        hooks.append(layer.register_forward_hook(lambda _m, _a, _o: setattr(counter, "layer", None)))
    try:
        with torch.inference_mode(), launches_exempt(state), counter:
            runner.forward(inputs, bucket=1)
    finally:
        for h in hooks:
            h.remove()
    per_layer = [counter.per_layer[i] for i in range(len(layers))]
    worst = max(per_layer, key=lambda c: sum(c.values()))
    return {"kernels_per_layer": sum(worst.values()), "kernels": dict(sorted(worst.items())),
            "outside_layers": counter.outside, "layers": len(layers)}


def run(families: list[str] | None = None) -> dict:
    configs = _configs()
    unknown = sorted(set(families or ()) - set(configs))
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; choose from {sorted(configs)}")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out = {name: census_of(name, make, device) for name, make in configs.items() if not families or name in families}
    where = "cuda" if device.type == "cuda" else "cpu, Triton interpreter"
    return {"families": out, "device": where, "dtype": "bfloat16", "batch_size": 1,
            "step": "padded decode forward (the CUDA-graph step), Triton attention backend"}


def markdown(report: dict) -> str:
    lines = ["| family | kernels per decoder layer | of them Triton | per step outside the layers |", "|---|---|---|---|"]
    for name, fam in report["families"].items():
        triton_n = sum(n for k, n in fam["kernels"].items() if k.startswith("triton:"))
        lines.append(f"| {name} | {fam['kernels_per_layer']} | {triton_n} | {fam['outside_layers']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.bench.kernel_census", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--families", default="", help="comma-separated model_types (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads TRITON_INTERPRET when it is imported: a fresh interpreter with it set.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, "-m", "tessera.bench.kernel_census", *(argv or sys.argv[1:])],
                              env=env).returncode
    report = run([f for f in args.families.split(",") if f] or None)
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
