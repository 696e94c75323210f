"""`--dtype auto` follows the checkpoint, the Engine reports what it resolved to, and a bfloat16 checkpoint matches
transformers computing the same math. On a CPU the weights stay bfloat16 and everything else computes in float32
(Platform.computes_16bit, layers/half_linear.py); on CUDA weights, KV pool, decode and vision tower are bfloat16
with a float32 sampler."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.platform.device import compute_dtype, resolve_device
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.hf_reference import chat_prompt, hf_greedy_distributions

pytestmark = pytest.mark.cuda  # on a GPU machine: the CUDA engine in bfloat16 (the Triton path), against HF

COMPUTE = compute_dtype(torch.bfloat16, resolve_device("auto"))  # what the engine computes a bf16 model in
# Chosen-token logprobs and the prefill's top 20 against HF's, per compute dtype. float32 (a CPU): measured
# 7.9e-6 / 7.2e-6 apart (the same float32 products, summed in another order). bfloat16: measured 6e-4 / 0.02 on
# this fixture; rotary angles computed in bf16 (HF computes them in float32) moved them by 0.16 / 0.43, a float32
# vision tower by 0.06, while HF bf16 vs HF float32 differ by 0.03-0.13, so these separate a bf16 path that
# follows HF's casts from one that does not.
# On a CPU, prefill products in bf16 (TESSERA_BF16_COMPUTE=1, the default where the CPU has AVX512-BF16/AMX)
# round x to bf16 beside float32 everything else: measured 0.018 / 0.041 from HF's float32 here.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.02, 0.05)}[COMPUTE]
BF16_PRODUCTS_TOLERANCE = (0.05, 0.1)
# CPU: float32 products (the float32 contract) and bf16 products; CUDA computes in bf16 without the switch.
MODES = ["float32-products", "bf16-products"] if COMPUTE == torch.float32 else ["cuda"]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), num_kv_heads=2)
    Qwen2VLForConditionalGeneration.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=MODES)
def bf16_engine(request, bf16_checkpoint):
    with pytest.MonkeyPatch.context() as mp:
        if request.param != "cuda":  # read by the scheduler process at start
            mp.setenv("TESSERA_BF16_COMPUTE", "1" if request.param == "bf16-products" else "0")
        with tessera.Engine(model_path=str(bf16_checkpoint), max_total_tokens=2048, show_progress=False) as engine:
            yield request.param, engine


def test_dtype_auto_keeps_a_bfloat16_checkpoint_in_bfloat16(bf16_engine, scene_images) -> None:
    mode, engine = bf16_engine
    info = engine.get_server_info()
    assert info["server_args"]["dtype"] == "auto"
    assert info["dtype"] == info["effective"]["dtype"] == "bfloat16"
    assert info["effective"]["compute_dtype"] == str(COMPUTE).removeprefix("torch.")
    if mode == "float32-products":
        assert info["effective"]["linear_kernel"].startswith("bfloat16 weights, float32 compute: C kernel gemv_bf16")
    elif mode == "bf16-products":
        assert info["effective"]["linear_kernel"].endswith("more rows: x rounded to bfloat16, oneDNN bf16 matmul")
    assert info["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert info["server_args"]["attention_backend"] == "auto"
    assert info["attention_backend"] == ("triton" if torch.cuda.is_available() else "torch_native")
    # Decode CUDA graphs: buckets up to max_running_requests on CUDA, none elsewhere.
    assert list(info["effective"]["cuda_graph_batch_sizes"]) == ([1, 2, 4, 8] + list(range(16, 65, 8))
                                                           if torch.cuda.is_available() else [])
    assert info["effective"]["cuda_graph_status"] == ("captured" if torch.cuda.is_available() else "off: device cpu")
    assert info["max_total_tokens"] == 2048 and info["stats"]["kv_total_tokens"] == 2048
    # The KV pool is in the compute dtype (read from its buffers): 2 (K, V) x layers x KV heads x head dim x bytes.
    assert info["effective"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * COMPUTE.itemsize
    prompt = engine.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": "Hi"}]}])
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                          image_data=scene_images[0])
    assert out["meta_info"]["completion_tokens"] == 4


def test_bfloat16_matches_hf_computing_the_same(bf16_checkpoint, bf16_engine, scene_images) -> None:
    """Same bf16 weights on both sides, HF loaded in the engine's compute dtype. On a CPU that is float32: HF
    upcasts the bf16 weights exactly, so it computes the very products our kernels compute from the 16-bit
    weights, and any difference beyond float32 summation order is ours. HF in bfloat16 would round every
    activation to bf16 where we do not: its distance from us (0.03-0.13 in logprobs) would measure bf16's
    rounding, not our path. Tolerances: TOLERANCE."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(bf16_checkpoint)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(bf16_checkpoint, dtype=COMPUTE).eval()
    assert hf.dtype == COMPUTE
    mode, engine = bf16_engine
    chosen_tol, top_tol = BF16_PRODUCTS_TOLERANCE if mode == "bf16-products" else TOLERANCE
    # Image prompts: their greedy outputs are stable under bf16 rounding here (a text-only prompt of this
    # random model has near-tied logits and splits from HF's within a few tokens whatever the engine does).
    cases = [(chat_prompt(processor, 1, "What color is the circle?"), [scene_images[0]]),
             (chat_prompt(processor, 2, "Describe."), scene_images[1:3])]
    n, top = 12, 20
    want = []
    for prompt, images in cases:
        ids, dists, _ = hf_greedy_distributions(hf, processor, prompt, images, max_new_tokens=n)
        first = dists[0].topk(top)
        want.append((ids, [d[t].item() for d, t in zip(dists, ids)],
                     dict(zip(first.indices.tolist(), first.values.tolist()))))
    assert want[0][0] != want[1][0], "degenerate fixture: both prompts give the same tokens"
    outs = engine.generate([p for p, _ in cases], {"temperature": 0, "max_new_tokens": n, "ignore_eos": True,
                                                        "top_logprobs_num": top},
                                image_data=[imgs for _, imgs in cases], return_logprob=True)
    for (ids, logprobs, first_top), out in zip(want, outs):
        assert out["output_ids"] == ids
        ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < chosen_tol
        # The prefill's last-position distribution: our top 20 against HF's logprobs of the same tokens.
        ours_top = {t: lp for lp, t, *_ in out["meta_info"]["output_top_logprobs"][0]}
        assert set(ours_top) == set(first_top)
        assert max(abs(ours_top[t] - first_top[t]) for t in first_top) < top_tol
        # Softmax and logprobs are taken in float32 (from bf16 logits on CUDA, as HF's generate does): logprobs
        # computed in bf16 would all be bf16 numbers (8-bit mantissa).
        assert any(torch.tensor(lp).to(torch.bfloat16).item() != lp for lp in ours)


def test_explicit_float32_overrides_the_checkpoint(bf16_checkpoint) -> None:
    with tessera.Engine(model_path=str(bf16_checkpoint), dtype="float32", max_total_tokens=1024,
                        show_progress=False) as engine:
        info = engine.get_server_info()
        assert info["dtype"] == "float32"
        assert info["effective"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
