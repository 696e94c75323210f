"""Where the kernel tests run: on the GPU when there is one (tensors built on it), else on the CPU, where
Triton's kernels run only under TRITON_INTERPRET=1 (each kernel test file reruns itself so, in a subprocess).

Tests that need a GPU or Triton carry the `cuda` marker: `pytest -m cuda` on a GPU machine runs them all
(../shared/gpu/device-run.sh does, after the GPU check)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.forward_batch import ForwardBatch

HAS_CUDA = torch.cuda.is_available()
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNELS = HAS_CUDA or IN_INTERPRETER
DEVICE = torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu")


def batch_to(fb: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The same batch with its tensors on `device` (host copies and flags kept)."""
    values = {}
    for f in dataclasses.fields(fb):
        if not f.init:
            continue
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device)
        elif f.name == "custom_masks" and value is not None:
            value = [None if m is None else m.to(device) for m in value]
        values[f.name] = value
    return ForwardBatch(**values)


def pool_to(pool: TokenToKVPool, device: torch.device) -> TokenToKVPool:
    """Moves the pool's buffers to `device` in place; returns it."""
    pool.k_buffers = [b.to(device) for b in pool.k_buffers]
    pool.v_buffers = [b.to(device) for b in pool.v_buffers]
    pool.device = torch.device(device)
    return pool


def run_interpreted(test_file: str, *pytest_args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`pytest test_file` in a subprocess under TRITON_INTERPRET=1 (set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file],
                          env=env, capture_output=True, text=True, timeout=timeout)
