"""The Triton MoE kernel (layers/moe_triton.py) against the torch grouped path (layers/moe.py) in float32, both
routing-weight placements, decode-sized and prefill-sized block plans, an expert without tokens. On a CPU the
kernel runs in Triton's interpreter, in a subprocess; on a GPU, on the device."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_device import DEVICE, RUNS_KERNELS, run_interpreted
from tests.layers.test_moe import random_moe

pytestmark = pytest.mark.cuda
needs_kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.skipif(RUNS_KERNELS, reason="the kernels run in this process")
def test_under_the_triton_interpreter() -> None:
    out = run_interpreted(__file__)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout.splitlines()[-1].split("passed")[0]


@needs_kernels
def test_blocks_are_aligned_per_expert() -> None:
    from tessera.layers.moe_triton import align_blocks

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    sorted_pairs, block_expert = align_blocks(ids, 4, 4)
    # Expert 0: pairs 1, 4; expert 1: pair 3; expert 2: pairs 0, 2, 5; each padded to 4 with 6 (= num_pairs).
    assert sorted_pairs.tolist()[:12] == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:3] == [0, 1, 2] and set(block_expert.tolist()[3:]) == {-1}


@needs_kernels
@pytest.mark.parametrize("weights_on_input", [False, True], ids=["weights-on-output", "weights-on-input"])
@pytest.mark.parametrize("num_tokens,top_k", [(3, 2), (70, 2)])  # block_m 16 (decode), 64 (prefill)
def test_triton_experts_match_the_torch_path(weights_on_input, num_tokens, top_k) -> None:
    from tessera.layers.decoder import GatedActivation
    from tessera.layers.moe import grouped_experts
    from tessera.layers.moe_triton import triton_grouped_experts

    # Odd sizes: H and 2I not multiples of the blocks; the last expert gets no tokens.
    x, w13, w2, ids, weights = random_moe(num_tokens, 5, 40, 36, top_k, seed=1)
    want = grouped_experts(x, w13, w2, ids, weights, "silu", weights_on_input=weights_on_input)
    act = GatedActivation("silu")
    args = [t.to(DEVICE) for t in (x, w13, w2, ids, weights)]
    got = triton_grouped_experts(*args, act, weights_on_input)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
