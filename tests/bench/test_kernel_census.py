"""`python -m tessera.bench.kernel_census`: the kernels one decode step launches per decoder layer on the CUDA path,
counted on this CPU (Triton interpreter). A count above the one recorded here fails: a change that adds a kernel
to a layer says so here and in docs/benchmarks.md ("Kernels per decoder layer")."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tessera.bench.kernel_census import _Counter
from tessera.worker.graph_safety import LaunchState

# model_type -> kernels per decoder layer when recorded. SGLang's fused Qwen2/Llama layer: 9 (norm, QKV, rotary +
# KV write, attention, O, add + norm, gate-up, SiLU-mul, down); Qwen3's q/k norms ride in the rotary kernel.
# Gemma-3: its four (1 + w) norms as norm, norm-add-norm, norm-add (one kernel each), GELU-mul: 10. At batch 1
# decode attention is split-KV (a second, combining kernel): one more each.
RECORDED = {"qwen2": 10, "qwen3": 10, "qwen2_vl": 10, "qwen2_5_vl": 10, "gemma3_text": 11}
QWEN2_VL_TARGET = 10  # issue 48


def test_no_family_launches_more_kernels_per_layer_than_recorded() -> None:
    out = subprocess.run([sys.executable, "-m", "tessera.bench.kernel_census", "--json"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    families = report["families"]
    assert sorted(families) == sorted(RECORDED)
    counts = {name: fam["kernels_per_layer"] for name, fam in families.items()}
    risen = {name: (n, RECORDED[name]) for name, n in counts.items() if n > RECORDED[name]}
    assert not risen, f"kernels per layer (now, recorded) rose: {risen}"
    assert counts["qwen2_vl"] <= QWEN2_VL_TARGET
    fused = families["qwen2_vl"]["kernels"]
    assert fused["triton:_rmsnorm_kernel"] == 2 and fused["triton:_rotary_store_kernel"] == 1
    assert fused["triton:_gated_mul_kernel"] == 1
    assert fused["triton:decode_split_kernel"] == 1 and fused["triton:decode_reduce_kernel"] == 1
    assert all(fam["layers"] == 2 and fam["outside_layers"] > 0 for fam in families.values())


def test_the_counter_counts_kernels_not_views_or_allocations() -> None:
    counter = _Counter(LaunchState())
    x = torch.randn(4, 6)
    with torch.inference_mode(), counter:  # as the census runs a step
        counter.layer = 0
        y = (x + 1).view(6, 4).t()  # one kernel, two views
        torch.empty(3)
        assert x.float() is x  # `to` that aliases: no kernel
        x.to(torch.bfloat16)  # a cast: a kernel
        _ = y * 2  # a second kernel
        counter.layer = None
        _ = x.sum()  # outside any layer
    assert dict(counter.per_layer[0]) == {"aten.add.Tensor": 1, "aten.to.dtype": 1, "aten.mul.Tensor": 1}
    assert counter.outside == 1
    counter.layer = 0
    counter.launched("some_kernel")
    assert counter.per_layer[0]["triton:some_kernel"] == 1
