"""Our layers inside a transformers model (the Transformers backend's): its text decoder's `nn.Linear`s and
RMSNorms become ours over the same parameters, and sibling projections that transformers calls on one input
(q/k/v, gate/up) run as one product.

A decode step of a small model is bound by per-operator costs: our few-row C products and C RMSNorm, and one
product instead of three for q/k/v, are what native families get from their own files (figures:
docs/benchmarks.md, "The Transformers backend beside native Qwen2-VL").
"""

from __future__ import annotations

import torch

from tessera.layers.linear import Linear, linear
from tessera.layers.norm import RMSNorm

# Sibling projections transformers' attention and MLP modules call on the same input, one after another.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _RowsLinear(Linear):
    """Our Linear over transformers' [batch, seq, features] activations: the product runs on the rows (our CPU
    kernels take 2-D x), or comes from its siblings' one product (`fused`, set by fuse_siblings)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.fused: _FusedSiblings | None = None
        self.fused_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused.output(self.fused_index, x) if self.fused is not None else None
        if y is None:
            y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], self.out_features)


class _RowsRMSNorm(RMSNorm):
    """Our RMSNorm (its CPU kernel) over any [..., hidden] activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


def _as_our_rmsnorm(module: torch.nn.Module) -> RMSNorm | None:
    """Our RMSNorm over `module`'s weight where `module` computes what it computes (weight * x / rms(x)) on a
    probe; None for anything else (Gemma's 1 + weight, Cohere's layer norm, norms with a bias)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float)
            or getattr(module, "bias", None) is not None or list(module.children())):
        return None
    ours = _RowsRMSNorm(weight.shape[0], eps)
    ours.weight = weight
    probe = torch.randn(2, 3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        try:
            same = torch.allclose(module(probe), ours(probe), rtol=1e-4, atol=1e-5)
        except (TypeError, RuntimeError):
            same = False
    return ours if same else None


def adopt_our_layers(hf_model: torch.nn.Module) -> str:
    """Every torch.nn.Linear of the text decoder and the LM head becomes our Linear over the same parameters: its
    few-row products run in our CPU kernels (a decode step's), and --torchao-config can quantize it
    (int_linear.quantize_linears). The decoder's RMSNorms become ours where they compute the same (one C call
    instead of about ten torch operators). Returns the decoder's module path + "." (where those linears are)."""
    decoder = hf_model.get_decoder()
    prefix = next(name for name, module in hf_model.named_modules() if module is decoder)
    head = hf_model.get_output_embeddings()
    for parent in [*decoder.modules(), hf_model]:
        for child_name, child in parent.named_children():
            if parent is hf_model and child is not head:
                continue
            ours: torch.nn.Module | None = None
            if type(child) is torch.nn.Linear:
                ours = _RowsLinear(child.in_features, child.out_features, bias=child.bias is not None)
                ours.weight = child.weight
                ours.bias = child.bias
            elif "Norm" in type(child).__name__:
                ours = _as_our_rmsnorm(child)
            if ours is not None:
                setattr(parent, child_name, ours)
    return prefix + "."


class _FusedSiblings:
    """One product for sibling _RowsLinears: the first member called with an input computes every member's
    output (their weights are views of one stacked weight), the others take theirs while the input is the same
    tensor; a member called with another input computes its own. Float weights only (fuse before nothing)."""

    def __init__(self, members: list[_RowsLinear]):
        self.weight = torch.cat([m.weight for m in members]).detach()
        biases = [m.bias for m in members]
        self.bias = torch.cat([b if b is not None else self.weight.new_zeros(m.out_features)
                               for b, m in zip(biases, members)]).detach() if any(b is not None for b in biases) \
            else None
        self.sizes = [m.out_features for m in members]
        start = 0
        for i, m in enumerate(members):  # the members' parameters become views of the stacked ones
            m.weight = torch.nn.Parameter(self.weight[start:start + m.out_features], requires_grad=False)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(self.bias[start:start + m.out_features], requires_grad=False)
            m.fused, m.fused_index = self, i
            start += m.out_features
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor] = []

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for x, as rows [tokens, out_features]; None when x is not the input the product
        was run on (the identity of the tensor transformers passes to each sibling)."""
        if index == 0:
            self.input = x
            y = linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
            self.outputs = [part.contiguous() for part in y.split(self.sizes, dim=-1)]
        if self.input is not x:
            return None
        out = self.outputs[index]
        if index == len(self.sizes) - 1:
            self.input, self.outputs = None, []
        return out


def fuse_siblings(root: torch.nn.Module) -> int:
    """Stacks every group of SIBLINGS under `root` that are float _RowsLinears of one input width; returns how
    many groups."""
    count = 0
    for module in root.modules():
        for names in SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if all(isinstance(m, _RowsLinear) and m.quantized is None and m.fused is None for m in members) and \
                    len({m.in_features for m in members}) == 1:
                _FusedSiblings(members)
                count += 1
    return count
