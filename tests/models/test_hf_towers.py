"""PatchMatmul: a Qwen-VL patch embed's Conv3d computed as one matmul gives the conv's output."""

from __future__ import annotations

import torch

from tessera.models.hf_towers import PatchMatmul, patch_embed_as_matmul


class _Embed(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 16, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=bias)


class _Tower(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.patch_embed = _Embed(bias)


def test_matmul_equals_the_conv_and_keeps_its_parameters() -> None:
    torch.manual_seed(0)
    for bias in (False, True):
        tower = _Tower(bias)
        conv = tower.patch_embed.proj
        x = torch.randn(37, 3, 2, 4, 4)
        want = conv(x)
        names = dict(tower.named_parameters())
        patch_embed_as_matmul(tower)
        assert isinstance(tower.patch_embed.proj, PatchMatmul)
        assert dict(tower.named_parameters()).keys() == names.keys()  # checkpoints load unchanged
        got = tower.patch_embed.proj(x)
        assert got.shape == want.shape == (37, 16, 1, 1, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        bigger = torch.randn(2, 3, 4, 8, 8)  # not one kernel per input: the conv itself runs
        torch.testing.assert_close(tower.patch_embed.proj(bigger), conv(bigger))


def test_other_convs_are_left_alone() -> None:
    tower = _Tower(False)
    tower.patch_embed.proj = torch.nn.Conv3d(3, 16, kernel_size=(2, 4, 4), stride=(1, 2, 2))
    patch_embed_as_matmul(tower)
    assert isinstance(tower.patch_embed.proj, torch.nn.Conv3d)
