"""Qwen2-VL's vision tower, our own: patch embedding, 2D rotary ViT blocks, patch merger.

The same computation and parameter names as transformers' `Qwen2VisionTransformerPretrainedModel` (checkpoints
load unchanged; tests/models/test_vision_attention.py holds it to transformers' output), written here because
importing transformers' modeling stack (torch._dynamo, DTensor, generation utilities) cost every scheduler
process and tensor-parallel rank ~2.5 s of CPU at start-up, for a tower of a few dozen lines. Attention and
the QuickGELU MLP are the batched versions the transformers towers get too (vision_attention.py,
hf_towers.QuickGeluMlp).

Input: every item's pixel rows concatenated ([patches, C * temporal_patch * patch * patch]) and grid_thw
([items, 3], in patches). Each temporal frame attends within itself; the output is the merged embeddings
[patches / merge**2, hidden_size] in the input's order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.linear import Linear
from tessera.models.hf_towers import PatchMatmul, QuickGeluMlp
from tessera.models.vision_attention import PlanCache, VarlenVisionAttention

LAYER_NORM_EPS = 1e-6  # transformers' Qwen2-VL tower hard-codes it

# transformers' ACT2FN names -> the function, for the MLP activations a Qwen2-VL vision config may name.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding (kernel == stride, no bias), computed as one matmul (hf_towers.PatchMatmul:
    every input is exactly one kernel); `proj.weight` keeps the conv's shape, so checkpoints load unchanged."""

    def __init__(self, embed_dim: int, in_channels: int, temporal_patch_size: int, patch_size: int):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = PatchMatmul(nn.Conv3d(in_channels, embed_dim, kernel, stride=kernel, bias=False))

    def forward(self, pixel_rows: torch.Tensor) -> torch.Tensor:
        x = pixel_rows.view(-1, self.proj.weight.shape[1], *self.proj.kernel_size).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionMlp(nn.Module):
    """fc2(act(fc1(x))); Qwen2-VL's quick_gelu gets QuickGeluMlp's in-place form instead (see build_vision_mlp)."""

    def __init__(self, dim: int, hidden_dim: int, act: str):
        super().__init__()
        if act not in _ACTIVATIONS and act != "quick_gelu":
            raise NotImplementedError(f"vision_config.hidden_act={act!r}: supported are quick_gelu, "
                                      f"{', '.join(_ACTIVATIONS)}")
        self.fc1 = Linear(dim, hidden_dim, bias=True)
        self.fc2 = Linear(hidden_dim, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_ACTIVATIONS[self.act](self.fc1(x)))


def build_vision_mlp(dim: int, hidden_dim: int, act: str) -> nn.Module:
    mlp = VisionMlp(dim, hidden_dim, act)
    return QuickGeluMlp(mlp) if act == "quick_gelu" else mlp


class VisionBlock(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, mlp_hidden_dim: int, act: str, plans: PlanCache):
        super().__init__()
        head_dim = embed_dim // num_heads
        self.norm1 = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self.attn = VarlenVisionAttention(Linear(embed_dim, 3 * embed_dim, bias=True),
                                          Linear(embed_dim, embed_dim, bias=True), num_heads, head_dim,
                                          head_dim**-0.5, plans)
        self.mlp = build_vision_mlp(embed_dim, mlp_hidden_dim, act)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, position_embeddings)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each merge x merge block of patches (consecutive rows) concatenated -> MLP."""

    def __init__(self, dim: int, context_dim: int, spatial_merge_size: int):
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size**2
        self.ln_q = nn.LayerNorm(context_dim, eps=LAYER_NORM_EPS)
        self.mlp = nn.Sequential(Linear(self.hidden_size, self.hidden_size, bias=True), nn.GELU(),
                                 Linear(self.hidden_size, dim, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2VisionTower(nn.Module):
    """`forward(pixel_rows, grid_thw)` -> merged embeddings [patches / merge**2, hidden_size]."""

    inv_freq: torch.Tensor

    def __init__(self, vision_config):
        super().__init__()
        c = vision_config
        embed_dim, num_heads = int(c.embed_dim), int(c.num_heads)
        self.spatial_merge_size = int(c.spatial_merge_size)
        self.patch_embed = PatchEmbed(embed_dim, int(c.in_channels), int(c.temporal_patch_size), int(c.patch_size))
        plans = PlanCache()  # one host read of cu_seqlens per tower call, shared by the blocks
        mlp_hidden = int(embed_dim * c.mlp_ratio)
        self.blocks = nn.ModuleList(VisionBlock(embed_dim, num_heads, mlp_hidden, c.hidden_act, plans)
                                    for _ in range(int(c.depth)))
        self.merger = PatchMerger(int(c.hidden_size), embed_dim, self.spatial_merge_size)
        # Axial 2D RoPE: head_dim // 4 frequencies per axis (h, then w), the angles repeated over both halves.
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        axis_dim = (embed_dim // num_heads) // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float) / axis_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def position_ids(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, 2] (h, w) of every patch, in the processor's order: merge x merge blocks of patches are
        consecutive rows, frames repeat the image's positions."""
        m = self.spatial_merge_size
        ids = []
        for t, h, w in grid_thw.tolist():
            hpos = torch.arange(h)[:, None].expand(h, w)
            wpos = torch.arange(w)[None, :].expand(h, w)
            hw = torch.stack([p.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten() for p in (hpos, wpos)], -1)
            ids.append(hw.repeat(t, 1))
        return torch.cat(ids).to(self.inv_freq.device)

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [patches, head_dim] in float32: h angles then w angles, that pair twice."""
        freqs = self.position_ids(grid_thw)[..., None].float() * self.inv_freq  # [patches, 2, head_dim // 4]
        emb = freqs.flatten(1)
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
        """Start of every frame's patches (each frame of each item attends within itself), then the total."""
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        return F.pad(frames.cumsum(0, dtype=torch.int32), (1, 0))

    def forward(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid_thw = grid_thw.to("cpu", torch.long)
        cu_seqlens = self.cu_seqlens(grid_thw).to(self.inv_freq.device)
        position_embeddings = self.rotary(grid_thw)
        x = self.patch_embed(pixel_rows)
        for block in self.blocks:
            x = block(x, cu_seqlens, position_embeddings)
        return self.merger(x)
