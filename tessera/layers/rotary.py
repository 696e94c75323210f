"""Rotary position embeddings: plain (neox-style, rotate-half) RoPE and Qwen2-VL's M-RoPE.

cos/sin are computed once per forward (`get_cos_sin`) and shared by every layer (`apply_rotary`). Both may
rotate only the first `rotary_dim` dims of a head (partial rotary, GLM-4: the rest pass through), and
`apply_rotary` also rotates adjacent pairs (2i, 2i+1) instead of halves (GLM-4's rotate_half_llm).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.platform import cpu_kernels


class RotaryEmbedding(nn.Module):
    """RoPE over `rotary_dim` dims (default the full head_dim) with inverse frequencies theta^(-2i/rotary_dim).

    With `mrope_section` (M-RoPE) the rotary_dim/2 frequencies are split into consecutive sections;
    section s takes its angle from position row s % 3 (temporal, height, width), as in transformers'
    Qwen2VLRotaryEmbedding. sum(mrope_section) must equal rotary_dim // 2.
    With `mrope_interleaved` (Qwen3-VL) the rows alternate t, h, w over the frequencies instead
    (see _interleaved_rows).
    """

    inv_freq: torch.Tensor  # [head_dim // 2] float32
    section_rows: torch.Tensor  # [head_dim // 2] long, M-RoPE only

    def __init__(self, head_dim: int, rope_theta: float, mrope_section: list[int] | None = None,
                 mrope_interleaved: bool = False, rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, f"rotary dims {rotary_dim} of a {head_dim} head"
        self.head_dim = head_dim
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = list(mrope_section) if mrope_section else None
        if self.mrope_section is not None:
            if sum(self.mrope_section) != rotary_dim // 2:
                raise ValueError(f"rope_parameters.mrope_section={self.mrope_section} must sum to the rotary dims "
                                 f"// 2 = {rotary_dim // 2}")
            # Which position row (t, h, w) drives each frequency.
            if mrope_interleaved:
                rows = _interleaved_rows(self.mrope_section)
            else:
                rows = [i % 3 for i, n in enumerate(self.mrope_section) for _ in range(n)]
            self.register_buffer("section_rows", torch.tensor(rows, dtype=torch.long), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] or [3, T] long -> (cos, sin), each [T, rotary_dim // 2] in `dtype`.

        A [T] input to an M-RoPE embedding means text positions (all three rows equal); a [3, T] input to a
        plain RoPE uses row 0. Angles are computed in float32, then cast, like transformers.
        """
        if self.mrope_section is None:
            pos = positions[0] if positions.dim() == 2 else positions
            freqs = pos.float()[:, None] * self.inv_freq
        else:
            pos = positions.expand(3, -1) if positions.dim() == 1 else positions
            # row-major [T, head_dim // 2], as the C rotary kernel and the decode stack read cos and sin
            freqs = pos.index_select(0, self.section_rows).t().contiguous().float() * self.inv_freq
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rope_inv_freq(rope_type: str, rope_theta: float, head_dim: int, text_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling): theta^(-2i/d) for "default", transformers' own
    RoPE initialisers for the scaled types (llama3, ...), so the frequencies are HF's exactly."""
    if rope_type == "default":
        return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_parameters.rope_type={rope_type!r} is unknown")
    if rope_type == "dynamic":
        raise NotImplementedError("rope_parameters.rope_type='dynamic' is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text_config, None)
    return inv_freq.float(), float(scaling)


def _interleaved_rows(section: list[int]) -> list[int]:
    """Qwen3-VL's interleaved M-RoPE (transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies):
    frequency j takes row 1 (h) when j % 3 == 1 and j < 3 * section[1], row 2 (w) when j % 3 == 2 and
    j < 3 * section[2], and row 0 (t) otherwise, so t keeps the tail beyond the interleaved part."""
    rows = [0] * sum(section)
    for row, offset in ((1, 1), (2, 2)):
        for j in range(offset, min(3 * section[row], len(rows)), 3):
            rows[j] = row
    return rows


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R // 2] with R <= D -> x with its first R dims rotated (the rest as they are),
    same dtype. Dims i and i + R/2 rotate together (rotate-half), or with `pairs` dims 2i and 2i + 1."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin, pairs), x[..., rot:]), dim=-1)
    out = None if pairs else rotary_kernel(x, cos, sin)
    if out is not None:
        return out
    cos, sin = cos[:, None, :], sin[:, None, :]
    if pairs:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """apply_rotary as one pass of our C kernel (platform/csrc/cpu_rotary.c, bit-identical to the operators) instead
    of ~8 operators: float32 inference on a CPU, x [T, H, D] and cos, sin [T, D // 2] with any row and head
    strides but a contiguous last dim. None where it does not apply (the caller keeps torch's form)."""
    if not (x.dim() == 3 and cos.shape == sin.shape == (x.shape[0], x.shape[-1] // 2)
            and cos.stride() == sin.stride() and x.stride(-1) == cos.stride(-1) == 1
            and cpu_kernels.takes("rotary") and cpu_kernels.host_f32_inference(x, cos, sin, contiguous=False)):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    cpu_kernels.call("rotary", x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                     cos.stride(0), out.data_ptr(), *x.shape, torch.get_num_threads())
    return out
