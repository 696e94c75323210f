"""Pre-quantized storage formats unpack to the weights their writers packed: AWQ GEMM, GPTQ v1/v2 at 4 and 8
bits, compressed-tensors pack-quantized / naive int8 (symmetric and with zero points), fp8 per tensor, per
channel and per block. The packers (tests/models/quant_fixtures.py) follow the tools' published code, apart
from the engine's unpacking; where compressed-tensors is installed its own compressors are checked too."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.quantization import checkpoint_formats as fmt
from tests.models.quant_fixtures import pack_awq, pack_ct, pack_gptq, quantize_fp8, quantize_rtn

OUT, IN = 48, 64


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed))


def _check(aw, truth) -> None:
    assert aw.q.dtype == torch.uint8 and aw.shape == (OUT, IN)
    assert torch.equal(aw.q.long(), truth.q.long())
    assert torch.equal(aw.dequantize(), truth.dequantize())


@pytest.mark.parametrize("group", [16, None])
def test_awq_gemm(group):
    t = quantize_rtn(_weight(), 4, group, symmetric=False, half_scales=True)
    p = pack_awq(t)
    assert p["qweight"].shape == (IN, OUT // 8) and p["scales"].shape == (IN // (group or IN), OUT)
    aw = fmt.awq_gemm(p["qweight"], p["qzeros"], p["scales"])
    assert aw.group_size == (group or IN)
    _check(aw, t)


@pytest.mark.parametrize("bits,symmetric,v2", [(4, False, False), (4, True, False), (8, False, True),
                                               (8, True, False)])
def test_gptq(bits, symmetric, v2):
    t = quantize_rtn(_weight(1), bits, 32, symmetric, half_scales=True)
    p = pack_gptq(t, bits, v2)
    assert p["qweight"].shape == (IN * bits // 32, OUT)
    _check(fmt.gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, v2), t)


def test_gptq_v1_zero_of_zero_reads_back_as_its_writers_do():
    """v1 stores zero - 1: a zero of 0 wraps to all ones and every v1 reader adds 1 back (2**bits)."""
    t = quantize_rtn(_weight(2), 4, 32, symmetric=False, half_scales=True)
    t.zero[0, 0] = 0
    p = pack_gptq(t, 4, v2=False)
    aw = fmt.gptq(p["qweight"], p["qzeros"], p["scales"], None, 4, v2=False)
    assert aw.zero[0, 0] == 16 and torch.equal(aw.zero[1:], t.zero[1:])


def test_gptq_act_order_g_idx_is_refused():
    t = quantize_rtn(_weight(), 4, 32, symmetric=True, half_scales=True)
    p = pack_gptq(t, 4, v2=False)
    with pytest.raises(fmt.CheckpointFormatError, match="act-order"):
        fmt.gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"].flip(0), 4, v2=False)


@pytest.mark.parametrize("bits,group,symmetric,naive", [(4, 16, True, False), (4, None, False, False),
                                                        (8, 32, False, False), (8, None, True, True),
                                                        (8, 16, False, True)])
def test_compressed_tensors_int(bits, group, symmetric, naive):
    t = quantize_rtn(_weight(3), bits, group, symmetric, half_scales=False)
    p = pack_ct(t, bits, symmetric, naive)
    if naive:
        aw = fmt.ct_naive_int8(p["weight"], p["weight_scale"], p.get("weight_zero_point"))
    else:
        aw = fmt.ct_pack_quantized(p["weight_packed"], p["weight_scale"], p["weight_shape"],
                                   p.get("weight_zero_point"), bits)
    _check(aw, t)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8(strategy):
    stored, deq = quantize_fp8(_weight(4), strategy, block=(16, 32))
    scale = stored.get("weight_scale", stored.get("weight_scale_inv"))
    assert torch.equal(fmt.fp8_dequantize(stored["weight"], scale, (16, 32)), deq)


def test_fp8_block_scale_shape_is_checked():
    stored, _ = quantize_fp8(_weight(), "block", block=(16, 32))
    with pytest.raises(fmt.CheckpointFormatError, match="blocks"):
        fmt.fp8_dequantize(stored["weight"], stored["weight_scale_inv"], (32, 32))


@pytest.mark.parametrize("bits,strategy,symmetric", [(4, "group", True), (4, "group", False), (8, "channel", False)])
def test_compressed_tensors_own_compressor(bits, strategy, symmetric):
    """compressed-tensors' PackedQuantizationCompressor packs; the engine unpacks to its decompress()."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = 16 if strategy == "group" else None
    t = quantize_rtn(_weight(5), bits, group, symmetric, half_scales=False)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    dense = {"weight": t.dequantize(), "weight_scale": t.scale,
             "weight_zero_point": (t.zero - (1 << (bits - 1))).to(torch.int8)}
    packed = PackedQuantizationCompressor.compress(dense, scheme)
    aw = fmt.ct_pack_quantized(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"],
                               packed.get("weight_zero_point"), bits)
    _check(aw, t)
    assert torch.equal(aw.dequantize(), PackedQuantizationCompressor.decompress(packed, scheme)["weight"].float())
