"""Parity of every family's paged model with transformers on tiny random checkpoints, one suite for all.

The families differ only in their fixtures (family_parity.FamilyFixture rows in their *_testing modules): how a
checkpoint is built and checked to be able to fail, how a prompt is laid out, and which prompts each test
runs. Every test here runs for every spec of every family: prefill logits in fp32, greedy decode over paged KV,
requests of different lengths in one batch, chunked prefill, a prefix-cache hit, the media towers called once a
step, the language model alone, deterministic checkpoints and embeddings (pooled final hidden states); then each
family's own checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

from tessera.models.registry import load_model
from tests.models import (
    cosmos3_testing,
    gemma3_testing,
    gemma4_testing,
    glm4v_testing,
    internvl_testing,
    kimi_k25_testing,
    llama4_testing,
    llava_next_testing,
    llava_testing,
    pixtral_testing,
    qwen2_5_vl_testing,
    qwen3_5_testing,
    qwen3_vl_moe_testing,
    qwen3_vl_testing,
)
from tests.models.family_parity import ATOL, FamilyCase, FamilyFixture, hf_last_hidden, media_embeds, our_greedy, \
    our_logits, our_pooled, prefix_hit
from tests.models.fixture_checks import MIN_MARGIN, top2_margin

FAMILIES: dict[str, FamilyFixture] = {
    "cosmos3_edge": cosmos3_testing.EDGE_FIXTURE,
    "cosmos3_omni": cosmos3_testing.OMNI_FIXTURE,
    "gemma3": gemma3_testing.FIXTURE,
    "gemma4": gemma4_testing.FIXTURE,
    "glm4v": glm4v_testing.FIXTURE,
    "glm4v_moe": glm4v_testing.MOE_FIXTURE,
    "internvl": internvl_testing.FIXTURE,
    "kimi_k25": kimi_k25_testing.FIXTURE,
    "llama4": llama4_testing.FIXTURE,
    "llava": llava_testing.FIXTURE,
    "llava_next": llava_next_testing.FIXTURE,
    "pixtral": pixtral_testing.FIXTURE,
    "qwen2_5_vl": qwen2_5_vl_testing.FIXTURE,
    "qwen3_5": qwen3_5_testing.FIXTURE,
    "qwen3_vl": qwen3_vl_testing.FIXTURE,
    "qwen3_vl_moe": qwen3_vl_moe_testing.FIXTURE,
}


def each_case(extra: Callable[[FamilyFixture], Iterable] = lambda fx: [None]) -> list:
    """pytest params (case key, x) for every family spec and every x of `extra(row)`, ids family-spec[-x]."""
    return [pytest.param(f"{family}-{spec}", x, id=f"{family}-{spec}" + ("" if x is None else f"-{x}"))
            for family, fx in FAMILIES.items() for spec in fx.specs for x in extra(fx)]


@pytest.fixture(scope="module")
def built_cases() -> dict[str, FamilyCase]:
    return {}


@pytest.fixture
def case(request, built_cases, tmp_path_factory) -> FamilyCase:
    """The family spec's case, built once per module run: pytest would rebuild a module-scoped fixture whenever
    the test's other parameters change, because every (case, x) pair is its own parameter set."""
    key = request.param
    if key not in built_cases:
        family, spec = key.split("-", 1)
        built_cases[key] = FAMILIES[family].load_case(spec, tmp_path_factory.mktemp(key))
        built_cases[key].row = FAMILIES[family]
    return built_cases[key]


@pytest.mark.parametrize("case,prompt_name", each_case(lambda fx: fx.prompts), indirect=["case"])
def test_prefill_logits_match_hf(case, prompt_name):
    prompt = case.prompt(case.row.prompts[prompt_name], seed=1)
    ref = case.hf_logits(prompt)
    torch.testing.assert_close(our_logits(case, prompt), ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


@pytest.mark.parametrize("case,page_size", each_case(lambda fx: fx.decode_page_sizes), indirect=["case"])
def test_greedy_decode_matches_hf(case, page_size):
    fx = case.row
    prompt = case.build(fx.decode)
    ref, margin = case.hf_greedy(prompt, fx.decode_new)
    assert margin > MIN_MARGIN
    assert our_greedy(case, [prompt], fx.decode_new, page_size)[0] == [ref]


@pytest.mark.parametrize("case,_", each_case(), indirect=["case"])
def test_requests_of_mixed_lengths_in_one_batch_match_hf(case, _):
    """Prompts with and without media prefilled in one forward (last logits HF's), then decoded together."""
    prompts = [case.build(p) for p in case.row.batch]
    refs = [case.hf_greedy(p, 6) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    tokens, logits = our_greedy(case, prompts, 6, page_size=4)
    for p, lo in zip(prompts, logits):
        torch.testing.assert_close(lo, case.hf_logits(p)[-1], atol=ATOL, rtol=0)
    assert tokens == [t for t, _ in refs]


@pytest.mark.parametrize("case,i", each_case(lambda fx: range(len(fx.chunked))), indirect=["case"])
def test_chunked_prefill_matches_hf(case, i):
    """Chunks smaller than an image, so chunk boundaries fall inside media spans (or, where a family keeps
    spans whole, chunks stop before them)."""
    c = case.row.chunked[i]
    prompt = case.build(c)
    chunk = c.chunk(case.spec)
    assert any(it.num_tokens > chunk for it in prompt.items), "the chunk must be smaller than an image"
    torch.testing.assert_close(our_logits(case, prompt, c.page_size, chunk), case.hf_logits(prompt), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("case,cut", each_case(lambda fx: fx.prefix_cuts), indirect=["case"])
def test_prefix_cache_hit_matches_hf(case, cut):
    """B repeats A's media and differs in its trailing text: B reuses A's KV for a page-aligned prefix (the
    family's cut: after the media or inside them), extends the rest, and both then decode in one batch."""
    fx = case.row
    page_size, shared_of = fx.prefix_cuts[cut]
    a, b = case.build(fx.prefix), case.build(fx.prefix)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    shared = shared_of(case, a)
    assert torch.equal(a.input_ids[:shared], b.input_ids[:shared]) and not torch.equal(a.input_ids, b.input_ids)
    refs = [case.hf_greedy(p, 4) for p in (a, b)]
    assert min(m for _, m in refs) > MIN_MARGIN
    logits, tokens = prefix_hit(case, a, b, shared, page_size, 4)
    torch.testing.assert_close(logits, case.hf_logits(b)[shared:], atol=ATOL, rtol=0)
    assert tokens == [t for t, _ in refs]


@pytest.mark.parametrize("case,_", each_case(), indirect=["case"])
def test_media_features_match_hf_in_one_tower_call_per_modality(case, _, monkeypatch):
    items = [it for p in case.row.tower for it in case.build(p).items]
    calls = []
    tower = getattr(case.ours, case.tower_attr)
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        ours = media_embeds(case.ours, items)
        refs = case.hf_media_features(items)
    assert len(calls) == len({it.modality for it in items}), "all items of a modality go through one tower call"
    assert [o.shape[0] for o in ours] == [it.num_tokens for it in items]
    torch.testing.assert_close(torch.cat(ours), torch.cat(refs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case,_", each_case(lambda fx: [None] if fx.text else []), indirect=["case"])
def test_language_model_only_loads_without_the_tower(case, _):
    ours, _ = load_model(case.path, torch.float32, language_model_only=True)
    assert getattr(ours, case.tower_attr) is None and ours.encoders() == {}
    prompt = case.build(case.row.text)
    ref = case.hf_logits(prompt)
    torch.testing.assert_close(our_logits(case, prompt, model=ours), ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_seed_same_bytes(family, tmp_path):
    fx = FAMILIES[family]
    paths = [tmp_path / "one", tmp_path / "two"]
    for p in paths:
        fx.build(p, fx.bytes_spec or fx.specs[0])
    for name in ("model.safetensors", "config.json"):
        assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), name


@pytest.mark.parametrize("case,check", each_case(lambda fx: fx.checks), indirect=["case"])
def test_family_specific(case, check, monkeypatch):
    """The family's own checks on its case (its fixture module says what each proves)."""
    case.row.checks[check](case, monkeypatch)


@pytest.mark.parametrize("case,_", each_case(), indirect=["case"])
def test_pooled_hidden_states_match_hf(case, _):
    """Embeddings: the final hidden states (ForwardBatch.hidden_indices) pooled last / mean / first token and
    normalised as worker/pooling.py does, prefilled whole and in chunks, give HF's base model's."""
    prompt = case.prompt(next(iter(case.row.prompts.values())), seed=1)
    hidden = hf_last_hidden(case, prompt)
    # HF's hidden_states[-1] is the base model's output after its final norm: its LM head gives HF's logits.
    torch.testing.assert_close(case.ours.lm_head(hidden), case.hf_logits(prompt), atol=ATOL, rtol=0)
    refs = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}
    assert float(torch.nn.functional.cosine_similarity(refs["last"], refs["mean"], dim=0)) < 0.999
    for method, ref in refs.items():
        ref = torch.nn.functional.normalize(ref, dim=-1)
        for chunk in (None, max(2, len(prompt) // 3)):
            ours = our_pooled(case, prompt, method, chunk)
            assert float(torch.nn.functional.cosine_similarity(ours, ref, dim=0)) >= 0.99999, (method, chunk)
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
