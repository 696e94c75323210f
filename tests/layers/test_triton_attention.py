"""The Triton backend against torch_native on the same paged pools: prefill with and without a cached
prefix, ragged decode, custom (bidirectional-span) masks, sliding windows, GQA/MQA/MHA, head dims that are
not powers of two. On a machine without CUDA the kernels run in Triton's interpreter, in a subprocess that
sets TRITON_INTERPRET=1 before triton is imported."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.attention import get_attention_backend
from tests.kernel_device import DEVICE, RUNS_KERNELS, batch_to, pool_to, run_interpreted
from tests.layers.test_attention_backend import make_case

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(RUNS_KERNELS, reason="the kernels run in this process")
def test_under_the_triton_interpreter() -> None:
    out = run_interpreted(__file__)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1].split("passed")[0]


def _span_masks(seq_lens, ext_lens, spans):
    masks = []
    for seq, ext, span in zip(seq_lens, ext_lens, spans):
        if span is None:
            masks.append(None)
            continue
        q = torch.arange(seq - ext, seq)[:, None]
        k = torch.arange(seq)[None, :]
        lo, hi = span
        masks.append((k <= q) | ((q >= lo) & (q < hi) & (k >= lo) & (k < hi)))
    return masks


CASES = {
    "prefill_with_prefix": ([5, 40, 7], [5, 33, 3], None),
    "decode_ragged": ([3, 45, 7, 1], [1, 1, 1, 1], None),
    "mixed": ([9, 6, 38], [1, 6, 20], None),
    "span_masks": ([12, 9, 40], [12, 1, 35], [(2, 8), None, (10, 30)]),
}


def _both_backends(heads, case, window, dtype=torch.float32, graph_plan=False, split_kv=True):
    """(torch_native's output in float32, triton's) on identical pools and batches. graph_plan: the batch
    as the CUDA-graph runner hands it over (decode_only, int64 lengths and rows read on the device)."""
    import tests.layers.test_attention_backend as ref_module

    num_heads, num_kv_heads = heads
    seq_lens, ext_lens, spans = CASES[case]
    masks = _span_masks(seq_lens, ext_lens, spans) if spans else None
    old_ctx = ref_module.MAX_CTX
    ref_module.MAX_CTX = 48
    try:
        outs = []
        for name in ("torch_native", "triton"):
            pool, fb, g = make_case(seq_lens, ext_lens, num_kv_heads, masks=masks, seed=3)
            pool.k_buffers[0], pool.v_buffers[0] = pool.k_buffers[0].to(dtype), pool.v_buffers[0].to(dtype)
            pool.dtype = dtype
            t = int(fb.extend_lens.sum())
            q, k, v = (torch.randn(t, n, 8, generator=g).to(dtype).to(DEVICE)
                       for n in (num_heads, num_kv_heads, num_kv_heads))
            pool, fb = pool_to(pool, DEVICE), batch_to(fb, DEVICE)
            if name == "torch_native":  # the reference computes in float32 from the same rounded values
                pool.k_buffers[0], pool.v_buffers[0] = pool.k_buffers[0].float(), pool.v_buffers[0].float()
                pool.dtype = torch.float32
                q, k, v = q.float(), k.float(), v.float()
            elif graph_plan:
                assert fb.seq_lens.dtype == fb.req_pool_indices.dtype == torch.int64
                fb.decode_only = True
            backend = get_attention_backend(name)
            backend.split_kv = split_kv
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, k, v, 0, fb, pool, 8**-0.5, window))
    finally:
        ref_module.MAX_CTX = old_ctx
    return outs[0], outs[1]


@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize(("case", "split_kv"), [(c, True) for c in sorted(CASES)]
                         + [(c, False) for c in sorted(CASES) if "decode" in c])  # only decode steps split
@pytest.mark.parametrize("window", [None, 4])
def test_triton_matches_torch_native(heads, case, window, split_kv) -> None:
    """Decode steps of few requests take the split-KV kernels (on a CPU, UNKNOWN_UNITS SMs assumed), or the
    one-kernel decode; extends are the same either way."""
    ref, out = _both_backends(heads, case, window, split_kv=split_kv)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_split_kv_choice() -> None:
    from tessera.layers.attention.triton_backend import MAX_SPLITS, UNKNOWN_UNITS, TritonAttentionBackend

    backend = TritonAttentionBackend()
    cpu, gpu = torch.device("cpu"), torch.device("meta")
    assert backend.kv_splits(1, 4, cpu) == 2 * UNKNOWN_UNITS // 4  # the interpreter: a few runs at batch 1
    assert backend.kv_splits(UNKNOWN_UNITS, 4, cpu) == 1  # enough programs already
    backend._units[gpu] = 132  # an H100's SMs: two programs each
    assert backend.kv_splits(1, 4, gpu) == MAX_SPLITS  # 4 programs: as many runs as allowed
    assert backend.kv_splits(2, 32, gpu) == 8  # 264 / 64 = 4.1 -> 5 -> the next power of two
    assert backend.kv_splits(64, 32, gpu) == 1
    backend.split_kv = False
    assert backend.kv_splits(1, 4, cpu) == 1


@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("split_kv", [True, False], ids=["split", "one-pass"])
def test_decode_planned_as_the_cuda_graph_runner_plans_it(window, split_kv) -> None:
    """int64 lengths and rows straight from the device buffers (the sliding-window branch included)."""
    ref, out = _both_backends((4, 2), "decode_ragged", window, graph_plan=True, split_kv=split_kv)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", ["mixed", "span_masks", "decode_ragged"])
def test_float16_matches_torch_native_in_float32(case) -> None:
    """float16 inputs: the extend kernel's dots take them as loaded, accumulating in float32; the result is
    within float16 rounding of the float32 reference over the same rounded inputs."""
    ref, out = _both_backends((4, 2), case, 4, dtype=torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_tiny_qwen2_with_the_triton_backend_matches_hf(tmp_path) -> None:
    """Prefill logits and greedy tokens of a tiny Qwen2 (head_dim 24, GQA) on the triton backend equal HF's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tessera.models.registry import load_model
    from tests.models.paged_driver import check_text_prefill_and_decode

    cfg = Qwen2Config(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, torch.float32, device=DEVICE, attention_backend="triton")
    hf.to(DEVICE)
    ids = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(1))
    check_text_prefill_and_decode(hf, ours, ids, 6)
