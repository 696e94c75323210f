"""Encoders taken from transformers (vision and audio towers), built empty for our weight loader to fill."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch

from tessera.layers.linear import linear


def build_transformers_tower(target: str, sub_config: Any, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' encoder `module:Class` on the current default device/dtype, parameters uninitialised
    (the checkpoint fills them), SDPA attention (or the one named, for towers without SDPA)."""
    from transformers.initialization import no_init_weights

    module_name, class_name = target.split(":")
    tower_cls = getattr(importlib.import_module(module_name), class_name)
    # _from_config writes dtype/attn settings into the config it gets; keep the caller's config untouched.
    cfg = copy.deepcopy(sub_config)
    with no_init_weights():
        tower = tower_cls._from_config(cfg, dtype=torch.get_default_dtype(), attn_implementation=attn_implementation)
    return tower.eval()


def buffers_as_parameters(tower: torch.nn.Module) -> None:
    """Re-registers the tower's persistent buffers as (frozen) parameters: transformers saves them with the
    weights (Gemma 4's standardize bias/scale, clipped linears' bounds) and our loader fills parameters."""
    for module in tower.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and name not in module._non_persistent_buffers_set:
                del module._buffers[name]
                module.register_parameter(name, torch.nn.Parameter(buf, requires_grad=False))


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
        y = linear(x.reshape(x.shape[0], -1), self.weight.reshape(out_channels, -1), self.bias)
        return y.view(x.shape[0], out_channels, 1, 1, 1)


def patch_embed_as_matmul(tower: torch.nn.Module) -> None:
    """Swaps tower.patch_embed.proj for a PatchMatmul when it is a Conv3d with kernel == stride, no padding."""
    embed = getattr(tower, "patch_embed", None)
    conv = getattr(embed, "proj", None)
    if (isinstance(conv, torch.nn.Conv3d) and conv.kernel_size == conv.stride and conv.padding == (0, 0, 0)
            and conv.dilation == (1, 1, 1) and conv.groups == 1):
        embed.proj = PatchMatmul(conv)


class QuickGeluMlp(torch.nn.Module):
    """fc2(quick_gelu(fc1(x))) of Qwen2-VL's vision MLP, with its own fc1/fc2 (same names: checkpoints load
    unchanged), computed in row chunks with the activation in place.

    quick_gelu(h) = h * sigmoid(1.702 h) = silu(1.702 h) / 1.702: one in-place scale and one in-place silu on
    fc1's output, and the 1/1.702 applied to fc2's narrow output together with its bias. transformers' three ops each
    allocate a [tokens, 4 * dim] tensor; on demo-vl's 64 images (15k tokens) those allocations and passes
    made the MLP ~45% of the tower. Chunks of rows keep fc1's output in the cache for fc2.
    """

    ROWS = 1024
    ALPHA = 1.702

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = original.fc1, original.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's ops when gradients are recorded (out= matmuls do not record them), and in bf16/fp16, where the
        # folded form rounds at other points than transformers' h * sigmoid(1.702 h): it moved a tiny model's
        # logprobs by 0.05 against HF in bf16, 0.0006 with HF's ops (tests/engine/test_engine_device_dtype.py).
        # 16-bit weights under float32 x (a bf16/fp16 model on a CPU) take the same ops: linear() widens them.
        # A LoRA adapter on fc2 (layers/lora) is added by its forward, which the folded form goes around.
        if ((torch.is_grad_enabled() and self.fc1.weight.requires_grad) or x.dtype != torch.float32
                or self.fc2.weight.dtype != torch.float32 or getattr(self.fc2, "lora", None) is not None):
            h = self.fc1(x)
            return self.fc2(h * torch.sigmoid(self.ALPHA * h))
        out = x.new_empty(*x.shape[:-1], self.fc2.out_features)
        rows_in, rows_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for start in range(0, rows_in.shape[0], self.ROWS):
            h = self.fc1(rows_in[start:start + self.ROWS]).mul_(self.ALPHA)
            torch.nn.functional.silu(h, inplace=True)
            dst = rows_out[start:start + self.ROWS]
            # fc2 through linear() (oneDNN where it measured faster than MKL's addmm), its 1/1.702 and bias
            # added in one pass over the narrow output.
            y = linear(h, self.fc2.weight)
            if self.fc2.bias is None:
                torch.mul(y, 1 / self.ALPHA, out=dst)
            else:
                torch.add(self.fc2.bias, y, alpha=1 / self.ALPHA, out=dst)
        return out


def batch_vision_attention(tower: torch.nn.Module) -> None:
    """Swaps every block's attention of a Qwen-VL tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `tower.blocks[i]
    .attn` with `qkv`/`proj`) for VarlenVisionAttention, and Qwen2-VL's QuickGELU MLP for QuickGeluMlp.
    Parameter names and shapes stay transformers' own."""
    from transformers.activations import QuickGELUActivation

    from tessera.models.vision_attention import PlanCache, VarlenVisionAttention

    plans = PlanCache()
    for block in tower.blocks:
        attn = block.attn
        if not all(hasattr(attn, name) for name in ("qkv", "proj", "num_heads", "head_dim", "scaling")):
            raise TypeError(f"{type(attn).__name__} is not a Qwen-VL vision attention module")
        block.attn = VarlenVisionAttention.replacing(attn, plans)
        mlp = block.mlp
        if isinstance(getattr(mlp, "act", None), QuickGELUActivation) and hasattr(mlp, "fc1"):
            block.mlp = QuickGeluMlp(mlp)
