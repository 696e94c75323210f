"""Parity of our paged Qwen2-VL with transformers on tiny random configs (GQA untied, MHA tied)."""

from __future__ import annotations

import pytest
import torch
from qwen2_vl_testing import build_prompt, hf_positions, prompt_mm_embeds
from paged_driver import PagedKV, Step, make_batch

from tessera.messages.items import Modality
from tests.models.mrope_reference import decode_mrope_positions

ATOL = 1e-4
PROMPTS = {
    "text": [12],
    "one_image": [5, ("image", (1, 4, 6)), 4],
    "two_images": [3, ("image", (1, 4, 6)), 2, ("image", (1, 2, 4)), 3],
    "video": [4, ("video", (2, 4, 4)), 3],
    "image_and_long_video": [2, ("image", (1, 2, 2)), 1, ("video", (6, 2, 2)), 3],  # video t > h, w
}


def hf_logits(hf, prompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**prompt.hf_inputs()).logits[0]


def prefill_step(case, row, prompt, **kw) -> Step:
    """The whole prompt as one extend step: HF's M-RoPE positions, our media embeddings."""
    positions, _ = hf_positions(case.hf, prompt)
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    return Step(row, prompt.input_ids, positions, rows, embeds, **kw)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(vl_case, prompt_name):
    prompt = build_prompt(PROMPTS[prompt_name], seed=1)
    kv = PagedKV(vl_case.ours.lm_config)
    with torch.inference_mode():
        fb = make_batch(kv, [prefill_step(vl_case, kv.new_request(), prompt, all_logits=True)])
        ours = vl_case.ours(fb, kv.pool)
    torch.testing.assert_close(ours, hf_logits(vl_case.hf, prompt), atol=ATOL, rtol=0)


def test_vision_features_match_hf_and_are_batched(vl_case, monkeypatch):
    prompt = build_prompt(PROMPTS["two_images"], seed=2)
    calls = []
    tower = vl_case.ours.visual
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        ours = vl_case.ours.get_image_feature(prompt.items)
        hf_out = vl_case.hf.model.get_image_features(prompt.pixels(Modality.IMAGE), prompt.grids(Modality.IMAGE))
        ref = hf_out.pooler_output
    assert len(calls) == 1, "all items of a step must go through the vision tower in one call"
    assert [o.shape[0] for o in ours] == [6, 2]
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf_generate(vl_case, page_size):
    assert _greedy_tokens(vl_case, page_size) == _hf_greedy_tokens(vl_case)


@pytest.mark.parametrize("stack", [False, True], ids=["layers", "stack"])
def test_greedy_decode_through_the_cpu_gemv_kernel_matches_hf(vl_case, stack, monkeypatch):
    """The tiny fixture's weights are below the kernel's size threshold; lowered to 0, every decode projection
    (one row) runs through tessera/platform/csrc/cpu_gemv.c: called layer by layer, or by the decode stack's
    one C call per step (layers/decode_stack.py), which runs its products there whatever their size."""
    from tessera.layers import cpu_gemv
    from tessera.platform import cpu_kernels

    if not cpu_kernels.available("gemv"):
        pytest.skip("no C compiler: the kernel is never built")
    calls, stacks = [], []
    real, real_call = cpu_gemv.gemv, cpu_kernels.call
    monkeypatch.setenv("TESSERA_DECODE_STACK", "1" if stack else "0")
    monkeypatch.setattr(cpu_gemv, "GEMV_MIN_WEIGHT", 0)
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, w, b=None: calls.append(1) or real(x, w, b))
    monkeypatch.setattr(cpu_kernels, "call", lambda name, *a: stacks.append(name == "decode_stack") or real_call(name, *a))
    assert _greedy_tokens(vl_case, 1) == _hf_greedy_tokens(vl_case)
    if stack:  # 11 decode steps after the prefill, each one call; the LM head stays in Python
        assert sum(stacks) >= 11 and len(calls) >= 11
    else:
        assert not any(stacks)
        assert len(calls) >= 12 * 2 * 4  # 12 decode steps x 2 layers x (qkv, o, gate_up, down), + the LM head


def _greedy_prompt():
    return build_prompt([3, ("image", (1, 4, 6)), 2, ("video", (2, 2, 4)), 4], seed=3)


def _hf_greedy_tokens(vl_case, num_new: int = 12) -> list[int]:
    prompt = _greedy_prompt()
    with torch.inference_mode():
        ref = vl_case.hf.generate(**prompt.hf_inputs(), max_new_tokens=num_new, do_sample=False, pad_token_id=0)
    return ref[0, prompt.input_ids.shape[0]:].tolist()


def _greedy_tokens(vl_case, page_size: int, num_new: int = 12) -> list[int]:
    prompt = _greedy_prompt()
    model, kv = vl_case.ours, PagedKV(vl_case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    _, delta = hf_positions(vl_case.hf, prompt)
    tokens = []
    with torch.inference_mode():
        logits = model(make_batch(kv, [prefill_step(vl_case, row, prompt)]), kv.pool)
        for _ in range(num_new):
            tok = int(logits[-1].argmax())
            tokens.append(tok)
            step = Step(row, torch.tensor([tok]), decode_mrope_positions(kv.lens[row], delta))
            logits = model(make_batch(kv, [step]), kv.pool)
    return tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_full_prefill(vl_case, page_size):
    # Image span covers rows 6..29: chunk boundaries 7, 14, 21, 28 fall inside it.
    prompt = build_prompt([5, ("image", (1, 8, 12)), 6], seed=4)
    model, kv = vl_case.ours, PagedKV(vl_case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    positions, _ = hf_positions(vl_case.hf, prompt)
    rows, embeds = prompt_mm_embeds(model, prompt)
    item_start = prompt.items[0].offsets[0][0]
    out = []
    with torch.inference_mode():
        for c in range(0, prompt.input_ids.shape[0], 7):
            e = min(c + 7, prompt.input_ids.shape[0])
            in_chunk = (rows >= c) & (rows < e)
            local_rows = rows[in_chunk] - c
            # The chunk's embedding rows are the matching slice of the item's embedding.
            chunk_embeds = embeds[rows[in_chunk] - item_start] if in_chunk.any() else None
            step = Step(row, prompt.input_ids[c:e], positions[:, c:e],
                        local_rows if in_chunk.any() else None, chunk_embeds, all_logits=True)
            out.append(model(make_batch(kv, [step]), kv.pool))
    torch.testing.assert_close(torch.cat(out), hf_logits(vl_case.hf, prompt), atol=ATOL, rtol=0)


def _decode_alone(case, prompt, num_decode: int) -> list[torch.Tensor]:
    """Prefill then num_decode greedy steps for one request alone; returns logits of each step's last token."""
    model, kv = case.ours, PagedKV(case.ours.lm_config)
    row = kv.new_request()
    _, delta = hf_positions(case.hf, prompt)
    logits = [model(make_batch(kv, [prefill_step(case, row, prompt)]), kv.pool)[-1]]
    for _ in range(num_decode):
        step = Step(row, logits[-1].argmax().reshape(1), decode_mrope_positions(kv.lens[row], delta))
        logits.append(model(make_batch(kv, [step]), kv.pool)[-1])
    return logits


def test_mixed_batch_matches_separate_runs(vl_case):
    model = vl_case.ours
    pa = build_prompt([4, ("image", (1, 4, 6)), 5], seed=5)
    pb = build_prompt([2, ("video", (2, 4, 4)), 7], seed=6)
    with torch.inference_mode():
        ref_a, ref_b = _decode_alone(vl_case, pa, 2), _decode_alone(vl_case, pb, 1)

        kv = PagedKV(model.lm_config, page_size=4)
        ra, rb = kv.new_request(), kv.new_request()
        _, da = hf_positions(vl_case.hf, pa)
        _, db = hf_positions(vl_case.hf, pb)
        la = model(make_batch(kv, [prefill_step(vl_case, ra, pa)]), kv.pool)[-1]
        # Step 1: A decodes while B prefills, in one batch (B first, so A's decode row is not row 0).
        step_a = Step(ra, la.argmax().reshape(1), decode_mrope_positions(kv.lens[ra], da))
        out = model(make_batch(kv, [prefill_step(vl_case, rb, pb), step_a]), kv.pool)
        lb, la2 = out[0], out[1]
        # Step 2: both decode: one batched SDPA over different KV lengths (padding mask).
        step_a = Step(ra, la2.argmax().reshape(1), decode_mrope_positions(kv.lens[ra], da))
        step_b = Step(rb, lb.argmax().reshape(1), decode_mrope_positions(kv.lens[rb], db))
        la3, lb2 = model(make_batch(kv, [step_a, step_b]), kv.pool)
    for got, want in [(la, ref_a[0]), (la2, ref_a[1]), (la3, ref_a[2]), (lb, ref_b[0]), (lb2, ref_b[1])]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_custom_masks(vl_case):
    prompt = build_prompt([4, ("image", (1, 4, 6)), 5], seed=7)
    model = vl_case.ours
    n = prompt.input_ids.shape[0]
    s, e = prompt.items[0].offsets[0]

    def run(mask):
        kv = PagedKV(model.lm_config)
        with torch.inference_mode():
            step = prefill_step(vl_case, kv.new_request(), prompt, all_logits=True, custom_mask=mask)
            return model(make_batch(kv, [step]), kv.pool)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    base = run(None)
    torch.testing.assert_close(run(causal), base, atol=1e-6, rtol=0)
    bidir = causal.clone()
    bidir[s:e, s:e] = True
    changed = run(bidir)
    torch.testing.assert_close(changed[:s], base[:s], atol=1e-6, rtol=0)  # tokens before the span cannot see it
    assert (changed[s:] - base[s:]).abs().max() > 1e-3


def test_scatter_count_mismatch_raises(vl_case):
    prompt = build_prompt([3, ("image", (1, 2, 4)), 2], seed=8)
    model = vl_case.ours
    kv = PagedKV(model.lm_config)
    step = prefill_step(vl_case, kv.new_request(), prompt)
    step.mm_embeds = step.mm_embeds[:-1]
    fb = make_batch(kv, [step])
    with pytest.raises(ValueError, match="mm_embed_rows"), torch.inference_mode():
        model(fb, kv.pool)



def test_precomputed_embeddings_skip_the_tower(vl_case, monkeypatch):
    prompt = build_prompt(PROMPTS["two_images"], seed=11)
    model = vl_case.ours
    with torch.inference_mode():
        full = model.get_image_feature(prompt.items)
        first = prompt.items[0]
        first.precomputed_embedding, first.feature = full[0].clone(), None
        calls = []
        monkeypatch.setattr(model.visual, "forward",
                            lambda *a, _f=model.visual.forward, **k: calls.append(a[0].shape[0]) or _f(*a, **k))
        mixed = model.get_image_feature(prompt.items)
    assert calls == [prompt.items[1].feature.shape[0]]  # only the pixel item went through the tower
    for a, b in zip(mixed, full):  # the second image alone vs batched: only float reordering differs
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_item_shape_errors_name_the_item(vl_case):
    item = build_prompt([1, ("image", (1, 2, 4)), 1]).items[0]
    item.feature = item.feature[:-1]
    with pytest.raises(ValueError, match="item 0: feature has 7 patch rows"):
        vl_case.ours.get_image_feature([item])
    item = build_prompt([1, ("image", (1, 2, 4)), 1]).items[0]
    item.offsets = [(2, 5)]
    with pytest.raises(ValueError, match="offsets cover 3 tokens"):
        vl_case.ours.get_image_feature([item])
