"""Pre-quantized checkpoints built offline from a float one: each scheme's tensors packed as the tool that writes
it packs them (AutoAWQ's WQLinear_GEMM.from_linear, AutoGPTQ's / GPTQModel's QuantLinear.pack, compressed-tensors'
pack_to_int32 and naive/float compressors, HF's fp8 block scales), written independently of the engine's
unpacking. Each build also writes the reference: the same float checkpoint with every quantized weight replaced
by the float weight it stands for, which HF transformers loads as the dequantized oracle.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_PACK_ORDER[i]
LANGUAGE_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Scheme:
    """method: awq | gptq | ct-pack | ct-naive | ct-fp8 | fp8-block; group None: per channel."""

    method: str
    bits: int = 4
    group: int | None = 32
    symmetric: bool = False
    v2: bool = False  # gptq: gptq_v2 (zeros stored as they are)
    strategy: str = "channel"  # fp8: tensor | channel | block


@dataclass(frozen=True)
class Truth:
    """The integer weight a quantizer chose: w = (q - zero) * scale, scale [out, groups], zero integral."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.q.shape[1] // self.scale.shape[1]
        return (self.q.float() - self.zero.repeat_interleave(g, 1)) * self.scale.repeat_interleave(g, 1)


def quantize_rtn(w: torch.Tensor, bits: int, group: int | None, symmetric: bool, half_scales: bool) -> Truth:
    """Round-to-nearest with integer zero points (what AWQ/GPTQ/compressed-tensors store)."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // (group or inp), group or inp)
    top = (1 << bits) - 1
    if symmetric:
        scale = g.abs().amax(-1) / ((top + 1) / 2 - 1)
        zero = torch.full_like(scale, float((top + 1) // 2))
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale.clamp_min(1e-8)).clamp(0, top)
    scale = scale.clamp_min(1e-8)
    if half_scales:
        scale = scale.half().float()
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, top).reshape(out, inp)
    return Truth(q.to(torch.int32), scale, zero)


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Consecutive values along `dim`, 32 / bits to a word from bit 0 up (GPTQ's and compressed-tensors')."""
    per = 32 // bits
    v = values.to(torch.int64) & ((1 << bits) - 1)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    v = torch.nn.functional.pad(v, (0, -cols % per)).reshape(rows, -1, per)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def pack_awq(t: Truth) -> dict[str, torch.Tensor]:
    def interleave(x: torch.Tensor) -> torch.Tensor:  # x [rows, out] -> [rows, out / 8]
        rows, out = x.shape
        words = torch.zeros(rows, out // 8, dtype=torch.int64)
        for col in range(out // 8):
            for i, src in enumerate(AWQ_PACK_ORDER):
                words[:, col] |= x[:, col * 8 + src].to(torch.int64) << (4 * i)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    return {"qweight": interleave(t.q.t()), "qzeros": interleave(t.zero.t().to(torch.int32)),
            "scales": t.scale.t().half().contiguous()}


def pack_gptq(t: Truth, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    inp = t.q.shape[1]
    group = inp // t.scale.shape[1]
    zeros = t.zero.to(torch.int32) - (0 if v2 else 1)  # v1 stores zero - 1 (wrapping to all ones at 0)
    return {"qweight": _pack(t.q.t(), bits, dim=0), "qzeros": _pack(zeros.t(), bits, dim=1),
            "scales": t.scale.t().half().contiguous(), "g_idx": (torch.arange(inp) // group).to(torch.int32)}


def pack_ct(t: Truth, bits: int, symmetric: bool, naive: bool) -> dict[str, torch.Tensor]:
    offset = 1 << (bits - 1)
    signed = t.q - offset
    out = {"weight_scale": t.scale.clone()}
    if naive:
        out["weight"] = signed.to(torch.int8)
    else:
        out["weight_packed"] = _pack(signed + offset, bits, dim=1)
        out["weight_shape"] = torch.tensor(list(t.q.shape))
    if not symmetric:
        zp = t.zero.to(torch.int32) - offset
        out["weight_zero_point"] = zp.to(torch.int8) if naive else _pack(zp + offset, bits, dim=0)
    return out


def quantize_fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] = (32, 32)) -> tuple[dict, torch.Tensor]:
    """(stored tensors, the float weight they stand for)."""
    w = w.float()
    out, inp = w.shape
    if strategy == "tensor":
        scale = w.abs().amax().reshape(1) / 448
        full = scale.expand(out, inp)
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        full = scale.expand(out, inp)
    else:
        b = w.reshape(out // block[0], block[0], inp // block[1], block[1])
        scale = b.abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    q = (w / full).to(torch.float8_e4m3fn)
    name = "weight_scale_inv" if strategy == "block" else "weight_scale"
    return {"weight": q, name: scale.float().contiguous()}, q.float() * full


def quantization_config(s: Scheme, ignore: list[str]) -> dict:
    """config.json's quantization_config as each tool writes it."""
    if s.method == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": s.group or -1,
                "zero_point": True, "modules_to_not_convert": ignore}
    if s.method == "gptq":
        return {"quant_method": "gptq", "bits": s.bits, "group_size": s.group or -1, "desc_act": False,
                "sym": s.symmetric, "checkpoint_format": "gptq_v2" if s.v2 else "gptq",
                "modules_to_not_convert": ignore}
    if s.method == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "modules_to_not_convert": ignore}
    if s.method == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": s.strategy, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        fmt = "float-quantized"
    else:
        weights = {"num_bits": s.bits, "type": "int", "symmetric": s.symmetric, "dynamic": False,
                   "strategy": "group" if s.group else "channel", "group_size": s.group, "actorder": None}
        acts, fmt = None, "naive-quantized" if s.method == "ct-naive" else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


def is_language_proj(name: str) -> bool:
    """A decoder layer's linear weight of the language model (the vision tower and lm_head stay float)."""
    parts = name.split(".")
    return (name.endswith(".weight") and len(parts) >= 3 and parts[-2] in LANGUAGE_PROJS
            and "visual" not in name and "vision" not in name)


def check_quantization_report(report: str, scheme: str, dtype: str = "float32") -> None:
    """/get_server_info's effective.quantization: the scheme, then what runs the linears: dequantized to the
    compute dtype, or int kernels where the linears take the int weights."""
    assert report.startswith(scheme + ", "), report
    paths = report[len(scheme) + 2:].split(", ")
    assert all(p == f"dequantized to {dtype}" or "int" in p for p in paths), report


def save_tiny_qwen3(path: Path) -> Path:
    """A tiny random text-only Qwen3 saved to `path` (sized to a tokenizer there, if any); norms random, so a
    dropped one shows, weights wider than HF's init, so greedy choices are not decided by noise."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = 128
    if (path / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        vocab = (len(AutoTokenizer.from_pretrained(path)) + 63) // 64 * 64
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.5 + torch.rand_like(p) if "norm" in n else torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


def quantize_checkpoint(src: Path, dst: Path, ref: Path, scheme: Scheme, ignore: list[str],
                        target=is_language_proj) -> list[str]:
    """Writes `dst` (the quantized checkpoint) and `ref` (the dequantized float one) from the float checkpoint
    `src`; returns the quantized module names."""
    for d in (dst, ref):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    quantized, reference, modules = {}, {}, []
    for name, w in tensors.items():
        if not target(name):
            quantized[name] = reference[name] = w
            continue
        module = name.removesuffix(".weight")
        modules.append(module)
        if scheme.method in ("ct-fp8", "fp8-block"):
            stored, deq = quantize_fp8(w, "block" if scheme.method == "fp8-block" else scheme.strategy)
        else:
            ct = scheme.method.startswith("ct")
            t = quantize_rtn(w, scheme.bits, scheme.group, scheme.symmetric, half_scales=not ct)
            if scheme.method == "awq":
                stored = pack_awq(t)
            elif scheme.method == "gptq":
                stored = pack_gptq(t, scheme.bits, scheme.v2)
            else:
                stored = pack_ct(t, scheme.bits, scheme.symmetric, naive=scheme.method == "ct-naive")
            deq = t.dequantize()
        quantized.update({f"{module}.{k}": v for k, v in stored.items()})
        reference[name] = deq.to(w.dtype)
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return modules
