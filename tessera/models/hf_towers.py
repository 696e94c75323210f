"""Encoders taken from transformers (vision and audio towers), built empty for our weight loader to fill."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch


def build_transformers_tower(target: str, sub_config: Any) -> torch.nn.Module:
    """transformers' encoder `module:Class` on the current default device/dtype, parameters uninitialised
    (the checkpoint fills them), SDPA attention."""
    from transformers.initialization import no_init_weights

    module_name, class_name = target.split(":")
    tower_cls = getattr(importlib.import_module(module_name), class_name)
    # _from_config writes dtype/attn settings into the config it gets; keep the caller's config untouched.
    cfg = copy.deepcopy(sub_config)
    with no_init_weights():
        tower = tower_cls._from_config(cfg, dtype=torch.get_default_dtype(), attn_implementation="sdpa")
    return tower.eval()


class PatchMatmul(torch.nn.Module):
    """A patch embed's Conv3d as one matrix multiply, for inputs that are exactly one kernel each.

    Qwen-VL towers view their pixel rows as [N, C, t, p, p] and convolve with kernel = stride = (t, p, p):
    every output is one dot product over a whole input, i.e. a [N, C*t*p*p] x [C*t*p*p, E] matmul. On a CPU,
    oneDNN's convolution over N such tiny images took 18% of demo-vl's tower (64 images) where the matmul
    takes under 1%. The parameters stay the conv's own (same names and shapes), so checkpoints load as before.
    """

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.kernel_size = tuple(conv.kernel_size)
        self._conv = conv.forward  # for inputs that are not one kernel each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.kernel_size:
            return self._conv(x)
        out_channels = self.weight.shape[0]
        y = torch.nn.functional.linear(x.reshape(x.shape[0], -1), self.weight.reshape(out_channels, -1), self.bias)
        return y.view(x.shape[0], out_channels, 1, 1, 1)


def patch_embed_as_matmul(tower: torch.nn.Module) -> None:
    """Swaps tower.patch_embed.proj for a PatchMatmul when it is a Conv3d with kernel == stride, no padding."""
    embed = getattr(tower, "patch_embed", None)
    conv = getattr(embed, "proj", None)
    if (isinstance(conv, torch.nn.Conv3d) and conv.kernel_size == conv.stride and conv.padding == (0, 0, 0)
            and conv.dilation == (1, 1, 1) and conv.groups == 1):
        embed.proj = PatchMatmul(conv)
