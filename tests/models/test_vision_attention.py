"""Our Qwen-VL vision attention (and Qwen2-VL's QuickGELU MLP) swapped into transformers' towers gives the
towers' own output on a mixed batch: repeated and unique image sizes plus a video, for Qwen2-VL, Qwen2.5-VL
(windowed and full blocks) and Qwen3-VL; the CUDA varlen path's inputs are checked on CPU with a stand-in
kernel, and on a GPU for real (skipped without CUDA)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

from tessera.models import vision_attention
from tessera.models.hf_towers import QuickGeluMlp, batch_vision_attention
from tessera.models.vision_attention import (
    PlanCache,
    VarlenVisionAttention,
    plan_segments,
)
from tests.models import qwen2_5_vl_testing, qwen2_vl_testing, qwen3_vl_testing

# (t, h, w) in patches: two equal images side by side, a third equal one later, unique sizes, a 3-frame video
# (3 attention segments of equal length), an image as big as a 2.5-VL window and one smaller than it.
GRIDS = [[1, 4, 6], [1, 4, 6], [1, 8, 8], [3, 4, 4], [1, 6, 4], [1, 4, 6], [1, 2, 2], [1, 10, 6]]


def _tower(family: str) -> torch.nn.Module:
    """transformers' tower with random weights, norms and biases (so a wrong swap cannot match by chance)."""
    from tessera.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration

    model_cls, cfg = {
        "qwen2_vl": (Qwen2VLForConditionalGeneration, qwen2_vl_testing.tiny_vl_config()),
        "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration,
                       qwen2_5_vl_testing.tiny_qwen2_5_vl_config(qwen2_5_vl_testing.SPECS["gqa"])),
        "qwen3_vl": (Qwen3VLForConditionalGeneration,
                     qwen3_vl_testing.tiny_qwen3_vl_config(qwen3_vl_testing.SPECS["gqa"])),
    }[family]
    # The tower class our model builds from transformers; Qwen2-VL builds its own (checked against this one).
    target = model_cls.vision_tower or "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel"
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    cfg = cfg.vision_config
    torch.manual_seed(0)
    tower = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if "norm" in name or name.endswith("bias") or ".ln_" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=g) if name.endswith("weight")
                            else 0.1 * torch.randn(param.shape, generator=g))
    return tower


def _outputs(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid)
    return [out.pooler_output, *getattr(out, "deepstack_features", [])]


def _batch(tower: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = tower.config
    grid = torch.tensor(GRIDS)
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(2)), grid


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_swapped_tower_equals_transformers(family: str) -> None:
    reference = _tower(family)
    pixels, grid = _batch(reference)
    ours = copy.deepcopy(reference)
    batch_vision_attention(ours)
    assert all(isinstance(block.attn, VarlenVisionAttention) for block in ours.blocks)
    assert isinstance(ours.blocks[0].mlp, QuickGeluMlp) == (family == "qwen2_vl")
    # Same parameter names and shapes: checkpoints load into the swapped tower unchanged.
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    want, got = _outputs(reference, pixels, grid), _outputs(ours, pixels, grid)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert w.abs().max() > 0.1  # not a degenerate tower
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    if family == "qwen2_vl":  # with gradients on (out= matmuls cannot record them), the plain form runs
        torch.testing.assert_close(ours(pixels, grid_thw=grid).pooler_output.detach(), want[0], rtol=0, atol=1e-5)
    # One image alone gives the rows it got inside the batch: no attention across items.
    alone = _outputs(ours, pixels[:24], grid[:1])[0]  # first image: 4x6 patches
    torch.testing.assert_close(alone, got[0][:6], rtol=0, atol=1e-5)


def test_own_qwen2_vl_tower_equals_transformers() -> None:
    """Qwen2VisionTower (ours, what Qwen2-VL builds) loads transformers' tower's state dict as it is and gives
    its output on the mixed batch (repeated and unique sizes, a 3-frame video), in float32 and bfloat16."""
    from tessera.models.qwen2_vl_vision import Qwen2VisionTower

    reference = _tower("qwen2_vl")
    pixels, grid = _batch(reference)
    ours = Qwen2VisionTower(reference.config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)  # same names and shapes
    want = _outputs(reference, pixels, grid)[0]
    with torch.no_grad():
        got = ours(pixels, grid)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours(pixels, grid).detach(), want, rtol=0, atol=1e-5)  # gradients on: plain MLP
    with torch.no_grad():  # each frame of the video attends within itself only: a frame alone gives its rows
        video = slice(24 + 24 + 64, 24 + 24 + 64 + 48)
        frame = ours(pixels[video][:16], torch.tensor([[1, 4, 4]]))
    torch.testing.assert_close(frame, got[(24 + 24 + 64) // 4:][:4], rtol=0, atol=1e-5)
    reference, ours = reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    want = _outputs(reference, pixels.to(torch.bfloat16), grid)[0].float()
    with torch.no_grad():
        got = ours(pixels.to(torch.bfloat16), grid).float()
    assert (got - want).abs().max() <= 0.005 * want.abs().max()


def test_plan_batches_consecutive_equal_segments() -> None:
    cu = torch.tensor([0, 24, 48, 112, 128, 144, 160, 160, 184, 188])  # includes an empty segment
    plan = plan_segments(cu)
    assert plan.calls == ((0, 2, 24), (48, 1, 64), (112, 3, 16), (160, 1, 24), (184, 1, 4))
    assert plan.max_len == 64 and plan.cu_seqlens.dtype == torch.int32
    many = torch.arange(0, 64 * 100 + 1, 64)  # 100 windows of 64 tokens: capped per call on a CPU
    calls = plan_segments(many).calls
    assert sum(count for _, count, _ in calls) == 100
    assert max(count * seg_len for _, count, seg_len in calls) <= vision_attention.CPU_TOKENS_PER_CALL
    cache = PlanCache()
    assert cache.get(cu) is cache.get(cu)  # the blocks of one tower call share one host read
    assert cache.get(cu.clone()) is not cache.get(cu)


def test_varlen_kernel_path_gets_packed_inputs(monkeypatch) -> None:
    """The CUDA path, on CPU: a stand-in kernel with varlen_attn's contract ([tokens, heads, head_dim] q/k/v,
    int32 cu_seqlens, the max length) computed segment by segment gives transformers' tower output."""
    seen = []

    def kernel(q, k, v, cu, max_len):
        assert q.shape == k.shape == v.shape and q.dim() == 3 and q.is_contiguous()
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == q.shape[0]
        bounds = cu.tolist()
        assert max_len == max(b - a for a, b in zip(bounds, bounds[1:]))
        seen.append(len(bounds) - 1)
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):
            out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        return out

    monkeypatch.setattr(vision_attention, "_cuda_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(vision_attention, "uses_varlen_kernel", lambda q: True)
    reference = _tower("qwen2_5_vl")
    pixels, grid = _batch(reference)
    ours = copy.deepcopy(reference)
    batch_vision_attention(ours)
    torch.testing.assert_close(_outputs(ours, pixels, grid)[0], _outputs(reference, pixels, grid)[0],
                               rtol=0, atol=1e-5)
    num_frames = int(grid[:, 0].sum())
    assert num_frames in seen and len(set(seen)) == 2  # full blocks: one segment per frame; windowed: more
    assert len(seen) == len(ours.blocks)  # one kernel call per block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_tower_uses_one_varlen_call() -> None:
    reference = _tower("qwen2_vl")
    pixels, grid = _batch(reference)
    reference = reference.to("cuda", torch.bfloat16)
    ours = copy.deepcopy(reference)
    batch_vision_attention(ours)
    assert vision_attention.uses_varlen_kernel(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    pixels, grid = pixels.to("cuda", torch.bfloat16), grid.to("cuda")
    want, got = _outputs(reference, pixels, grid)[0].float(), _outputs(ours, pixels, grid)[0].float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
