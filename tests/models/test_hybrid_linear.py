"""Hybrid linear attention (Gated DeltaNet + gated full attention) against transformers: Qwen3-Next text (MoE
with a shared expert, partial RoPE) and Qwen3.5-MoE with an image, over the paged driver and its state pool;
the torch gated delta rule (chunked across prefill chunks = token by token = transformers'); a reused request
row starts from a clean state. Qwen3.5 dense runs in the family parity suite (qwen3_5_testing.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.models.fixture_checks import MIN_MARGIN, hf_generate, hf_stepped_greedy
from tests.models.paged_driver import PagedKV, Step, decode_greedy, make_batch

VOCAB, CHUNK = 128, 32


def _tiny_qwen3_next(path):
    from transformers import Qwen3NextForCausalLM

    from tests.models.fixture_checks import save_random_model
    from tests.models.qwen3_5_testing import make_hybrid_can_fail_, tiny_qwen3_next_config

    return save_random_model(path, Qwen3NextForCausalLM, tiny_qwen3_next_config(VOCAB), 3,
                             lambda m: make_hybrid_can_fail_(m, 3))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    from tessera.models.qwen3_next import Qwen3NextForCausalLM
    from tessera.models.registry import load_model

    path = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    hf = _tiny_qwen3_next(path)
    ours, _ = load_model(path, torch.float32)
    assert isinstance(ours, Qwen3NextForCausalLM)
    assert ours.kv_layout.num_layers == 1 and ours.state_layout.num_layers == 3  # K/V of the full layer only
    return hf, ours


def _hf_generate(hf, ids: torch.Tensor, num_new: int) -> list[int]:
    """transformers' greedy generate; the explicit mask keeps prompt tokens equal to pad id 0 attended."""
    return hf_generate(hf, {"input_ids": ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long)},
                       num_new)


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill_in_chunks(model, kv: PagedKV, row: int, ids: torch.Tensor) -> torch.Tensor:
    """The prompt in CHUNK-token forwards (state carried across them); its last logits [1, V]."""
    with torch.inference_mode():
        for lo in range(0, len(ids), CHUNK):
            hi = min(lo + CHUNK, len(ids))
            logits = model(make_batch(kv, [Step(row, ids[lo:hi], torch.arange(lo, hi))]), kv.pool)
    return logits


def test_qwen3_next_prefill_chunks_and_decode_match_hf(qwen3_next):
    hf, ours = qwen3_next
    ids = _prompt(45, 1)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0]
    kv = PagedKV(ours.lm_config, page_size=4)
    row = kv.new_request()
    with torch.inference_mode():
        whole = ours(make_batch(kv, [Step(row, ids, torch.arange(len(ids)), all_logits=True)]), kv.pool)
    torch.testing.assert_close(whole, ref, atol=1e-4, rtol=0)
    want, margin = hf_stepped_greedy(hf, {"input_ids": ids[None]}, 8)
    assert margin > MIN_MARGIN and want == _hf_generate(hf, ids, 8)
    assert len(set(want)) > 2, "a repeated token cannot tell states apart"
    kv = PagedKV(ours.lm_config, page_size=4)
    row = kv.new_request()
    logits = _prefill_in_chunks(ours, kv, row, ids)  # 32 + 13 tokens
    torch.testing.assert_close(logits[-1], ref[-1], atol=1e-4, rtol=0)
    assert decode_greedy(ours, kv, [row], logits, 8) == [want]


def test_qwen3_next_mixed_batch_and_reused_row_match_hf(qwen3_next):
    """A decoding request and a prefilling one (32-token chunks) share forwards; then a third request takes the
    first one's freed row (its state slot) and still gets HF's tokens: the slot starts clean."""
    hf, ours = qwen3_next
    a, b, c = _prompt(36, 2), _prompt(70, 3), _prompt(40, 4)
    want = [_hf_generate(hf, p, 6) for p in (a, b, c)]
    kv = PagedKV(ours.lm_config, page_size=4, max_reqs=2)
    ra, rb = kv.new_request(), kv.new_request()
    got_a = []
    logits_a = _prefill_in_chunks(ours, kv, ra, a)
    with torch.inference_mode():
        for lo in range(0, len(b), CHUNK):  # b's chunks ride along a's decode steps
            hi = min(lo + CHUNK, len(b))
            got_a.append(int(logits_a[-1].argmax()))
            out = ours(make_batch(kv, [Step(ra, torch.tensor([got_a[-1]]), torch.tensor([kv.lens[ra]])),
                                        Step(rb, b[lo:hi], torch.arange(lo, hi))]), kv.pool)
            logits_a = out[:1]
    rest = decode_greedy(ours, kv, [ra, rb], torch.cat([logits_a, out[1:]]), 6 - len(got_a))
    assert got_a + rest[0][: 6 - len(got_a)] == want[0]
    assert rest[1][:6 - len(got_a)] == want[1][:6 - len(got_a)]
    kv.req_pool.free(ra)  # a finishes: its row (and state slot) is reused by c
    rc = kv.new_request()
    kv.pages[rc], kv.lens[rc] = [], 0
    assert rc == ra and kv.pool.state.recurrent[:, rc].abs().sum() > 0  # the old state is still there...
    logits_c = _prefill_in_chunks(ours, kv, rc, c)  # ...and the first chunk's step zeroes it
    assert decode_greedy(ours, kv, [rc], logits_c, 6) == [want[2]]


def test_chunked_rule_equals_token_by_token_and_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from tessera.layers.gated_delta import chunked_rule, recurrent_rule

    g = torch.Generator().manual_seed(0)
    t, hk, hv, d = 100, 2, 4, 16
    q, k = torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    v, decay, beta = torch.randn(t, hv, d, generator=g), -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    ref, ref_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = torch.zeros(hv, d, d)
    out = torch.cat([chunked_rule(q[s], k[s], v[s], decay[s], beta[s], state) for s in (slice(0, 37), slice(37, t))])
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=0)
    state = torch.zeros(1, hv, d, d)
    steps = [recurrent_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], state) for i in range(t)]
    torch.testing.assert_close(torch.cat(steps), ref[0], atol=1e-5, rtol=0)


def test_qwen3_5_moe_with_an_image_matches_hf(tmp_path):
    from tessera.layers.moe import SharedExpertMoE
    from tessera.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration
    from tests.models import qwen3_5_testing as q35
    from tests.models import qwen3_vl_testing as q3
    from tests.models.family_parity import our_greedy, our_logits

    case, _ = q3.Qwen3VLCase.load(q35.SPECS["moe"], tmp_path, q35.build_tiny_qwen3_5,
                                  Qwen3_5MoeForConditionalGeneration)
    assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in case.ours.model.layers)
    prompt = case.prompt(q3.PROMPTS["square_image"], seed=1)
    # The decoder on HF's own image features (the towers' ~1e-6 float32 differences, which the family suite checks,
    # reach ~1e-4 through these random layers), prefilled in 7-token chunks.
    item = prompt.items[0]
    with torch.inference_mode():
        features = case.hf.model.get_image_features(item.feature, item.model_specific_data["image_grid_thw"])
        pooled = features.pooler_output
    pooled = pooled[0] if isinstance(pooled, (list, tuple)) else pooled
    torch.testing.assert_close(q3.logits_with_embeds(case, prompt, pooled), case.hf_logits(prompt), atol=1e-4, rtol=0)
    torch.testing.assert_close(our_logits(case, prompt, chunk=7), case.hf_logits(prompt), atol=3e-4, rtol=0)
    want, margin = case.hf_greedy(prompt, 6)
    assert margin > MIN_MARGIN
    assert our_greedy(case, [prompt], 6, 4)[0] == [want]


def test_state_pool_is_sized_from_the_memory_budget(caplog):
    """Request rows always get a slot; prefix-cache snapshots get the states' share of the KV budget."""
    from tessera.cache.kv_pool import kv_pool_tokens, size_pools
    from tessera.cache.state_pool import STATE_TO_KV_MEMORY_RATIO, LinearStateLayout, split_budget
    from tessera.config import ServerArgs

    layout = LinearStateLayout(num_layers=3, conv_dim=64, conv_kernel=4, num_heads=4, key_dim=8, value_dim=8)
    per_slot = layout.bytes_per_request(torch.bfloat16)
    assert per_slot == 3 * (64 * 3 * 2 + 4 * 8 * 8 * 4)
    assert split_budget(100 * per_slot, per_slot, 10, kv_fixed=True) == int(100 * STATE_TO_KV_MEMORY_RATIO)
    assert split_budget(100 * per_slot, per_slot, 10, kv_fixed=False) == int(100 * 0.9 / 1.9) - 10
    assert split_budget(per_slot, per_slot, 10, kv_fixed=False) == 0  # rows first, whatever the budget
    args = ServerArgs(model_path="demo-vl", max_running_requests=4, page_size=4)
    tokens, pool = size_pools(args, 256, lambda: None, 0, 4096, (layout, torch.bfloat16, "cpu"))
    budget = 16384 * 256  # the CPU floor of KV tokens, shared with the states
    assert pool is not None and pool.rows == 6 and pool.nbytes == pool.slots * per_slot
    assert pool.snapshot_range == (6, split_budget(budget, per_slot, 6, kv_fixed=False)) and pool.slots > 6
    assert tokens % 4 == 0 and tokens * 256 + pool.nbytes <= budget
    # --max-total-tokens keeps the KV pool's size; the states come on top. No radix cache: no snapshots.
    fixed, pool = size_pools(args.replace(max_total_tokens=1000), 256, lambda: None, 0, 4096,
                             (layout, torch.bfloat16, "cpu"))
    assert fixed == 1000 and pool is not None and pool.snapshot_range[1] == split_budget(1000 * 256, per_slot, 6, True)
    _, pool = size_pools(args.replace(disable_radix_cache=True), 256, lambda: None, 0, 4096,
                         (layout, torch.bfloat16, "cpu"))
    assert pool is not None and pool.slots == 6
    # A budget with no room for snapshots says so: 8 MiB on a device, 3 MiB states.
    wide = LinearStateLayout(num_layers=3, conv_dim=64, conv_kernel=4, num_heads=64, key_dim=64, value_dim=64)
    with caplog.at_level(logging.WARNING, logger="tessera.cache"):
        _, pool = size_pools(args, 2**20, lambda: (14 * 2**20, 40 * 2**20), 0, 4096, (wide, torch.bfloat16, "cpu"))
    assert pool is not None and pool.slots == 6 and "prefix cache never hits" in caplog.text
    assert size_pools(args, 256, lambda: None, 0, 4096)[1] is None
    # A device: the state pool is allocated first, and the KV pool gets what the device has left after it (here
    # the second reading shows 12 MiB fewer free).
    mib = 2**20
    readings = iter([(30 * mib, 40 * mib), (18 * mib, 40 * mib)])
    tokens, pool = size_pools(args, 1024, lambda: next(readings), 0, 4096, (layout, torch.bfloat16, "cpu"))
    budget = kv_pool_tokens(args, 1024, (30 * mib, 40 * mib)) * 1024  # 0.85 of 40 MiB less the 10 in use
    assert pool is not None and pool.snapshot_range[1] == split_budget(budget, per_slot, 6, kv_fixed=False) > 0
    assert tokens == kv_pool_tokens(args, 1024, (18 * mib, 40 * mib))


@pytest.mark.parametrize("spec", ["dense", "moe"])
def test_qwen3_5_text_only_matches_hf(spec, tmp_path):
    """Qwen3.5's text model saved alone (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM): prefill logits and greedy
    decode equal HF's."""
    import transformers

    from tessera.models.registry import load_model
    from tests.models import qwen3_5_testing as q35
    from tests.models.fixture_checks import save_random_model
    from tests.models.paged_driver import check_text_prefill_and_decode

    config = q35.tiny_qwen3_5_text_config(q35.SPECS[spec])
    hf = save_random_model(tmp_path, getattr(transformers, config.architectures[0]), config, 7,
                           lambda m: q35.make_hybrid_can_fail_(m, 7))
    ours, _ = load_model(tmp_path, torch.float32)
    assert type(ours).__name__ == config.architectures[0]
    _, tokens = check_text_prefill_and_decode(hf, ours, _prompt(40, 5), 6)
    assert len(set(tokens)) > 2
