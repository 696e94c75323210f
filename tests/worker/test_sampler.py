"""Sampler: greedy exactness, filters, penalties (checked numerically), seeds, logprobs, and
empirical distributions under fixed seeds (deterministic, so never flaky)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatchInfo,
    apply_penalties,
    mix_seed,
)
from tessera.messages.sampling import SamplingParams


def make_info(
    params: list[SamplingParams],
    vocab_size: int,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplingBatchInfo:
    for p in params:
        p.normalize().verify(vocab_size)
    return SamplingBatchInfo.build(
        params,
        vocab_size,
        output_ids=output_ids if output_ids is not None else [[] for _ in params],
        prompt_ids=prompt_ids if prompt_ids is not None else [[] for _ in params],
        eos_token_ids=eos_token_ids,
    )


def sample_many(probs: list[float], num_samples: int, seed: int = 0, **kwargs: object) -> torch.Tensor:
    """Draw num_samples tokens from one distribution by batching num_samples identical rows."""
    logits = torch.tensor(probs, dtype=torch.float32).log().expand(num_samples, -1).contiguous()
    params = SamplingParams(**kwargs).normalize()
    params.verify(len(probs))
    empty: list[list[int]] = [[] for _ in range(num_samples)]
    info = SamplingBatchInfo.build([params] * num_samples, len(probs), output_ids=empty, prompt_ids=empty)
    return Sampler(seed=seed)(logits, info).next_token_ids


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
# 99.9th percentile of chi-square with 5 degrees of freedom.
CHI2_5DF_P999 = 20.52


def test_greedy_is_exact_argmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 3
    out = Sampler(seed=1)(logits, make_info([SamplingParams(temperature=0) for _ in range(16)], 300))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_stay_exact_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0 if i % 2 else 1.3, top_p=0.9, seed=i if i < 4 else None) for i in range(8)]
    out = Sampler(seed=2)(logits, make_info(params, 200))
    greedy_rows = torch.arange(1, 8, 2)
    assert torch.equal(out.next_token_ids[greedy_rows], logits.argmax(-1)[greedy_rows])
    # The sampled rows really sample: with 200 near-flat logits they almost surely differ from argmax.
    assert not torch.equal(out.next_token_ids[0::2], logits.argmax(-1)[0::2])


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, frequency_penalty=0.5) for _ in range(2)]
    Sampler(seed=0)(logits, make_info(params, 50, output_ids=[[1, 2], [3]], prompt_ids=[[4], [5]]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_degenerate_filters_equal_greedy(kwargs: dict[str, object]) -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3)) * 2
    info = make_info([SamplingParams(temperature=1.5, **kwargs) for _ in range(64)], 500)
    for seed in range(5):
        assert torch.equal(Sampler(seed=seed)(logits, info).next_token_ids, logits.argmax(-1))


def test_unfiltered_sampling_matches_the_softmax() -> None:
    tokens = sample_many(PROBS, 40_000)
    assert chi_square(tokens, PROBS) < CHI2_5DF_P999
    # The statistic can fail: the same samples are far from a uniform distribution.
    assert chi_square(tokens, [1 / 6] * 6) > 100 * CHI2_5DF_P999


def test_seeded_rows_follow_the_softmax() -> None:
    # One generator per row (seed = row index): the per-row path must be as unbiased as the batched one.
    num_rows = 4_000
    logits = torch.tensor(PROBS).log().expand(num_rows, -1).contiguous()
    info = make_info([SamplingParams(seed=i) for i in range(num_rows)], len(PROBS))
    assert chi_square(Sampler(seed=0)(logits, info).next_token_ids, PROBS) < CHI2_5DF_P999


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.6), [0, 1]),  # mass before token 1 is 0.4 < 0.6; before token 2 it is 0.65
        (dict(top_p=0.7), [0, 1, 2]),
        (dict(min_p=0.5), [0, 1]),  # threshold 0.5 * 0.4 = 0.2
        (dict(min_p=0.2), [0, 1, 2, 3]),  # threshold 0.08
        # top-p applies to the top-k renormalised mass: [0.4, 0.25] -> [0.615, 0.385], so 0.6 keeps one
        # token (top-p over the full mass, SGLang's order, would keep two, as top_p=0.6 alone does).
        (dict(top_k=2, top_p=0.6), [0]),
        (dict(top_k=2, top_p=0.65), [0, 1]),
        (dict(top_k=3, min_p=0.5), [0, 1]),
    ],
)
def test_filters_keep_the_right_tokens_with_renormalised_mass(kwargs: dict[str, object], kept: list[int]) -> None:
    tokens = sample_many(PROBS, 20_000, **kwargs)
    observed = frequencies(tokens, len(PROBS))
    expected = torch.zeros(len(PROBS), dtype=torch.float64)
    expected[kept] = torch.tensor([PROBS[i] for i in kept], dtype=torch.float64)
    expected /= expected.sum()
    assert set(tokens.unique().tolist()) == set(kept)
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_temperature_sharpens_and_flattens() -> None:
    base = torch.tensor(PROBS).log()
    top_share = {}
    for temperature in (0.5, 1.0, 2.0):
        tokens = sample_many(PROBS, 30_000, temperature=temperature)
        expected = torch.softmax(base / temperature, -1).double()
        assert torch.allclose(frequencies(tokens, len(PROBS)), expected, atol=0.012)
        top_share[temperature] = float((tokens == 0).double().mean())
    assert top_share[0.5] > top_share[1.0] + 0.1 > top_share[2.0] + 0.2


def test_frequency_and_presence_penalties_are_exact() -> None:
    vocab = 12
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    info = make_info(params, vocab, output_ids=[[3, 3, 5, 3], [3, 5]], prompt_ids=[[7], [7]])
    expected = logits.clone()
    expected[0, 3] -= 0.5 * 3 + 0.25
    expected[0, 5] -= 0.5 * 1 + 0.25
    # Prompt tokens are not penalised (OpenAI semantics), and row 1 has no penalty at all.
    assert torch.allclose(apply_penalties(logits, info), expected, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    vocab = 10
    logits = torch.tensor([[2.0, -2.0, 1.0, -0.5, 3.0, 0.0, 0.7, -1.0, 0.2, 0.1]])
    # Token 10**9 stands for a multimodal pad value outside the vocab: it must be ignored.
    info = make_info(
        [SamplingParams(repetition_penalty=2.0)], vocab, output_ids=[[1, 4]], prompt_ids=[[0, 3, 10**9, 0]]
    )
    expected = logits.clone()
    expected[0, [0, 4]] /= 2.0
    expected[0, [1, 3]] *= 2.0
    assert torch.allclose(apply_penalties(logits, info), expected)


def test_penalties_compose_repetition_first() -> None:
    logits = torch.tensor([[4.0, -1.0, 0.5, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)]
    info = make_info(params, 4, output_ids=[[0, 0]], prompt_ids=[[1]])
    # token 0: 4 / 2 - (1 * 2 + 0.5) = -0.5 ; token 1 (prompt only): -1 * 2 = -2
    assert torch.allclose(apply_penalties(logits, info), torch.tensor([[-0.5, -2.0, 0.5, 0.0]]))


def test_penalties_steer_greedy_and_logprobs() -> None:
    vocab = 8
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0, -1.0, 0.5, 0.2, 0.1]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.2, logprobs=True, top_logprobs_num=3)]
    info = make_info(params, vocab, output_ids=[[0]], prompt_ids=[[]])
    out = Sampler()(logits, info)
    assert out.next_token_ids.tolist() == [1]  # 5.0 - 0.2 < 4.9
    penalised = logits.clone()
    penalised[0, 0] -= 0.2
    assert torch.allclose(out.logprobs, torch.log_softmax(penalised, -1)[0, [1]])


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 8.0, 2.0]])  # eos = 2, stop id = 4
    def greedy(num_generated: int, **kwargs: object) -> int:
        params = [SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[4], **kwargs)]
        info = make_info(params, 6, output_ids=[[1] * num_generated], eos_token_ids=(2,))
        return int(Sampler()(logits, info).next_token_ids[0])

    assert greedy(0) == 5 and greedy(2) == 5
    assert greedy(3) == 2
    assert greedy(0, ignore_eos=True) == 2  # EOS does not finish such a request, so it is not banned


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    vocab = 1000
    gen = torch.Generator().manual_seed(5)
    row_logits = torch.randn(vocab, generator=gen) * 0.5
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(step: int, batch: str) -> int:
        if batch == "alone":
            params, logits, row = [seeded], row_logits[None], 0
        else:
            # Neighbours that trigger the filter stage, penalties and greedy rows; global seed differs.
            others = [SamplingParams(top_k=5), SamplingParams(temperature=0), SamplingParams(seed=9, min_p=0.1)]
            params = [others[0], others[1], seeded, others[2]]
            logits = torch.cat([torch.randn(2, vocab, generator=gen), row_logits[None], torch.randn(1, vocab, generator=gen)])
            row = 2
        info = make_info(params, vocab, output_ids=[[7] * step for _ in params])
        sampler = Sampler(seed=0 if batch == "alone" else 99)
        return int(sampler(logits, info).next_token_ids[row])

    alone = [run(step, "alone") for step in range(25)]
    assert alone == [run(step, "alone") for step in range(25)]
    assert alone == [run(step, "batched") for step in range(25)]
    assert len(set(alone)) > 15  # steps get unrelated streams, not one repeated draw


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(2, 1000)
    info = make_info([SamplingParams(seed=1), SamplingParams(seed=2)], 1000)
    tokens = Sampler()(logits, info).next_token_ids
    assert tokens[0] != tokens[1]
    assert mix_seed(1, 0) != mix_seed(1, 1) != mix_seed(2, 0)
    assert 0 <= mix_seed(-5, 10**6) < 2**63


def test_unseeded_rows_reproducible_under_a_sampler_seed() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(6))
    info = make_info([SamplingParams(top_p=0.95) for _ in range(32)], 100)
    assert torch.equal(Sampler(seed=7)(logits, info).next_token_ids, Sampler(seed=7)(logits, info).next_token_ids)
    assert not torch.equal(Sampler(seed=7)(logits, info).next_token_ids, Sampler(seed=8)(logits, info).next_token_ids)


def test_logprobs_are_log_softmax_before_temperature_and_filters() -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8)) * 2
    params = [
        SamplingParams(temperature=0.3, top_k=4, logprobs=True, top_logprobs_num=5),
        SamplingParams(temperature=0, top_logprobs_num=2),
        SamplingParams(temperature=1.7, top_p=0.5),
    ]
    out = Sampler(seed=0)(logits, make_info(params, vocab))
    reference = torch.log_softmax(logits, -1)
    assert isinstance(out, SamplerOutput)
    assert torch.allclose(out.logprobs, reference.gather(1, out.next_token_ids[:, None]).squeeze(1), atol=1e-6)
    assert out.top_logprob_ids.shape == (3, 5) and out.top_logprob_values.shape == (3, 5)
    values = out.top_logprob_values
    assert bool((values[:, :-1] >= values[:, 1:]).all()), "top logprobs must be sorted descending"
    assert torch.equal(out.top_logprob_ids, reference.topk(5, -1).indices)
    assert torch.allclose(values, reference.gather(1, out.top_logprob_ids), atol=1e-6)
    assert math.isclose(float(values[1, 0]), float(reference[1].max()), abs_tol=1e-6)


def test_bf16_logits_are_accepted() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    out = Sampler()(logits, make_info([SamplingParams(temperature=0) for _ in range(4)], 64))
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1))


def test_plain_sampling_allocates_no_vocab_sized_state() -> None:
    info = make_info([SamplingParams(), SamplingParams(temperature=0)], 50)
    assert info.output_token_counts is None and info.seen_token_mask is None and info.banned_token_mask is None
    assert not info.need_filter and not info.return_logprob and info.has_greedy and not info.is_all_greedy
    assert info.top_ks.tolist() == [50, 50] and info.temperatures.tolist() == [[1.0], [1.0]]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    top_k=st.integers(1, 30),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.1, 3.0),
)
def test_sampled_token_always_survives_the_filters(seed: int, top_k: int, top_p: float, temperature: float) -> None:
    vocab = 30
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p) for _ in range(4)]
    tokens = Sampler(seed=seed)(logits, make_info(params, vocab)).next_token_ids
    probs = torch.softmax(logits / temperature, -1)
    for row in range(4):
        order = probs[row].argsort(descending=True).tolist()
        top = probs[row][order[:top_k]]
        before = (torch.cumsum(top, 0) - top) / top.sum()
        allowed = {order[j] for j in range(top_k) if j == 0 or before[j] < top_p - 1e-5}
        # Tokens within float error of the top-p boundary may go either way.
        boundary = {order[j] for j in range(top_k) if abs(float(before[j]) - top_p) <= 1e-5}
        assert int(tokens[row]) in allowed | boundary


def test_logit_bias_is_added_before_the_min_tokens_ban() -> None:
    vocab = 8
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(logit_bias={"2": 3.5, 6: -100}, min_new_tokens=1), SamplingParams()]
    info = make_info(params, vocab, eos_token_ids=(6,))
    out = apply_penalties(logits, info)
    assert out[0, 2] == pytest.approx(float(logits[0, 2]) + 3.5)
    assert out[0, 6] == float("-inf")  # the ban still wins over any bias
    assert torch.equal(out[1], logits[1])  # rows without a bias are untouched
    forced = make_info([SamplingParams(temperature=0, logit_bias={4: 100})], vocab)
    assert Sampler()(logits[:1], forced).next_token_ids.tolist() == [4]


@pytest.mark.parametrize("bias,needle", [({10: 1.0}, "logit_bias keys"), ({1: 101}, "logit_bias values"),
                                         ({"x": 1.0}, "logit_bias keys"), ([1], "logit_bias must be a map")])
def test_logit_bias_is_verified(bias, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(logit_bias=bias).normalize().verify(8)


def test_sampling_knobs_match_the_params() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                                                              frequency_penalty=0.5, presence_penalty=-0.25,
                                                              repetition_penalty=1.3)]
    info = make_info(params, 32)
    assert info.temperatures.tolist() == [[1.0], [pytest.approx(0.7)]] and info.temperatures.shape == (2, 1)
    assert info.top_ps.tolist() == [1.0, pytest.approx(0.9)] and info.top_ks.tolist() == [32, 5]
    assert info.top_ks.dtype == torch.int64 and info.is_greedy.tolist() == [True, False]
    assert info.min_ps.tolist() == [0.0, pytest.approx(0.05)]
    assert info.frequency_penalties.tolist() == [0.0, 0.5] and info.presence_penalties.tolist() == [0.0, -0.25]
    assert info.repetition_penalties.tolist() == [1.0, pytest.approx(1.3)]
