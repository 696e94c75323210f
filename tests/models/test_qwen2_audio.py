"""Parity of our paged Qwen2-Audio with transformers on tiny random checkpoints.

Two checkpoints: Whisper's 30 s encoder input with GQA, and a 10 s encoder input with MHA (nothing may
assume 3000 mel frames); and the shipped demo-asr (6 s encoder input, trained weights). Inputs come from our processor (its parity with HF's is tested in
tests/multimodal/test_mm_qwen_audio_processor.py) and are fed to HF unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from paged_driver import PagedKV, Step, make_batch
from safetensors.torch import save_file

from tessera.config import ASSETS_DIR
from tessera.models.qwen2_audio import Qwen2AudioForConditionalGeneration, audio_output_len
from tessera.models.registry import load_model
from tessera.multimodal.media import MediaLimits
from tessera.multimodal.processors.base import ProcessorOutput
from tests.multimodal.processor_registry import create_processor
from tests.audio_testing import INSTRUCTION, build_tiny_audio_checkpoint, noise, speechlike, tone

ATOL = 1e-4


@dataclass
class AudioCase:
    name: str
    path: str
    hf: torch.nn.Module
    ours: Qwen2AudioForConditionalGeneration
    processor: object  # our QwenAudioProcessor
    hf_processor: object


@pytest.fixture(scope="module", params=["whisper30_gqa", "chunk10_mha", "demo_asr"])
def audio_case(request, tmp_path_factory) -> AudioCase:
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration as HFModel

    path = ASSETS_DIR / "demo-asr" if request.param == "demo_asr" else tmp_path_factory.mktemp(request.param)
    if request.param == "demo_asr":
        pass
    elif request.param == "whisper30_gqa":
        build_tiny_audio_checkpoint(path, num_kv_heads=2)
    else:
        build_tiny_audio_checkpoint(path, num_kv_heads=4, hidden=48, layers=3, chunk_length=10, seed=1)
    hf = HFModel.from_pretrained(path).eval()
    ours, config = load_model(path, torch.float32)
    hf_processor = AutoProcessor.from_pretrained(path)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    yield AudioCase(request.param, str(path), hf, ours, processor, hf_processor)
    processor.close()


def make_prompt(case: AudioCase, clips: list) -> ProcessorOutput:
    content = [{"type": "audio"}] * len(clips) + [{"type": "text", "text": INSTRUCTION}]
    text = case.hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)
    return case.processor.process(prompt=text, audio_data=clips)


def hf_inputs(out: ProcessorOutput) -> dict:
    items = out.mm_inputs.items
    return dict(input_ids=torch.tensor([out.input_ids]),
                input_features=torch.stack([it.feature for it in items]),
                feature_attention_mask=torch.cat([it.model_specific_data["feature_attention_mask"] for it in items]))


def prefill_step(model, row: int, out: ProcessorOutput, **kw) -> Step:
    ids = torch.tensor(out.input_ids)
    with torch.inference_mode():
        embeds = model.get_audio_feature(out.mm_inputs.items)
    rows = torch.cat([torch.arange(s, e) for it in out.mm_inputs.items for s, e in it.offsets])
    return Step(row, ids, torch.arange(len(ids)), rows, torch.cat(embeds), **kw)


def new_kv(model, page_size: int = 1) -> PagedKV:
    return PagedKV(model.lm_config, page_size=page_size, num_pages=2048 // page_size, max_context_len=2048)


CLIPS = {
    "one_tone": lambda: [tone(2.5)],
    "noise_then_speechlike": lambda: [noise(7.3, seed=1), speechlike(4.1, seed=2)],
    "longer_than_the_encoder_window": lambda: [speechlike(34.0, seed=3)],  # truncated, as HF does
}


@pytest.mark.parametrize("clips", list(CLIPS))
def test_prefill_logits_match_hf(audio_case, clips):
    out = make_prompt(audio_case, CLIPS[clips]())
    model, kv = audio_case.ours, new_kv(audio_case.ours)
    with torch.inference_mode():
        ours = model(make_batch(kv, [prefill_step(model, kv.new_request(), out, all_logits=True)]), kv.pool)
        ref = audio_case.hf(**hf_inputs(out)).logits[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_audio_items_share_one_encoder_call_and_keep_their_lengths(audio_case, monkeypatch):
    clips = [tone(1.0), noise(5.5, seed=4), tone(3.2, freq=300)]
    out = make_prompt(audio_case, clips)
    model, calls = audio_case.ours, []
    tower = model.audio_tower
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(a[0].shape[0]) or _f(*a, **k))
    with torch.inference_mode():
        together = model.get_audio_feature(out.mm_inputs.items)
        alone = [model.get_audio_feature([it])[0] for it in out.mm_inputs.items]
    assert calls == [3, 1, 1, 1], "all audio items of a step must go through the encoder in one call"
    hop = audio_case.hf_processor.feature_extractor.hop_length
    assert [e.shape[0] for e in together] == [audio_output_len(len(c) // hop) for c in clips]
    for a, b in zip(together, alone):  # batching must not mix items (padding is masked per item)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf_generate(audio_case, page_size):
    out = make_prompt(audio_case, [speechlike(3.0, seed=5), tone(1.5, freq=600)])
    num_new = 10
    with torch.inference_mode():
        ref = audio_case.hf.generate(**hf_inputs(out), max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
    ref_tokens = ref[0, len(out.input_ids):].tolist()
    model, kv = audio_case.ours, new_kv(audio_case.ours, page_size)
    row = kv.new_request()
    tokens = []
    with torch.inference_mode():
        logits = model(make_batch(kv, [prefill_step(model, row, out)]), kv.pool)
        for _ in range(num_new):
            tokens.append(int(logits[-1].argmax()))
            step = Step(row, torch.tensor([tokens[-1]]), torch.tensor([kv.lens[row]]))
            logits = model(make_batch(kv, [step]), kv.pool)
    assert tokens == ref_tokens


def test_chunked_prefill_through_the_audio_span_matches_hf(audio_case):
    out = make_prompt(audio_case, [tone(0.8)])
    model, kv = audio_case.ours, new_kv(audio_case.ours, page_size=4)
    full = prefill_step(model, kv.new_request(), out)
    (start, end), = out.mm_inputs.items[0].offsets
    chunk, logits = 9, []
    with torch.inference_mode():
        for c in range(0, len(out.input_ids), chunk):
            e = min(c + chunk, len(out.input_ids))
            lo, hi = max(c, start), min(e, end)
            rows = torch.arange(lo, hi) - c if lo < hi else None
            embeds = full.mm_embeds[lo - start: hi - start] if lo < hi else None
            step = Step(full.row, full.input_ids[c:e], full.positions[c:e], rows, embeds, all_logits=True)
            logits.append(model(make_batch(kv, [step]), kv.pool))
        ref = audio_case.hf(**hf_inputs(out)).logits[0]
    assert any(start < c < end for c in range(0, len(out.input_ids), chunk)), "a chunk boundary must cut the span"
    torch.testing.assert_close(torch.cat(logits), ref, atol=ATOL, rtol=0)


def test_transformers_in_memory_weight_names_load_too(audio_case, tmp_path):
    """A checkpoint written from HF's state_dict (model.language_model.*, model.audio_tower.*, lm_head.*)."""
    state = {k: v.contiguous() for k, v in audio_case.hf.state_dict().items()}
    assert any(k.startswith("model.audio_tower.") for k in state)
    (tmp_path / "config.json").write_bytes((Path(audio_case.path) / "config.json").read_bytes())
    save_file(state, str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path, torch.float32)
    out = make_prompt(audio_case, [tone(1.2)])
    results = []
    for m in (model, audio_case.ours):
        kv = new_kv(m)
        with torch.inference_mode():
            results.append(m(make_batch(kv, [prefill_step(m, kv.new_request(), out, all_logits=True)]), kv.pool))
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def test_language_model_only_has_no_encoder(audio_case):
    model, _ = load_model(audio_case.path, torch.float32, language_model_only=True)
    assert model.audio_tower is None and model.multi_modal_projector is None
    assert not any(n.startswith(("audio_tower.", "multi_modal_projector.")) for n in model.state_dict())
    out = make_prompt(audio_case, [tone(0.5)])
    with pytest.raises(RuntimeError, match="language_model_only"):
        model.get_audio_feature(out.mm_inputs.items)


def test_bad_items_are_refused_with_the_item_named(audio_case):
    model = audio_case.ours
    item = make_prompt(audio_case, [tone(0.5)]).mm_inputs.items[0]
    good_feature = item.feature
    item.feature = good_feature[:, :-2]
    with pytest.raises(ValueError, match="item 0: audio feature has shape"):
        model.get_audio_feature([item])
    item.feature = good_feature
    mask = item.model_specific_data.pop("feature_attention_mask")
    with pytest.raises(ValueError, match="lacks 'feature_attention_mask'"):
        model.get_audio_feature([item])
    item.model_specific_data["feature_attention_mask"] = torch.zeros_like(mask)
    with pytest.raises(ValueError, match="marks no frame"):
        model.get_audio_feature([item])
    item.model_specific_data["feature_attention_mask"] = mask
    item.offsets = [(item.offsets[0][0], item.offsets[0][1] - 1)]
    with pytest.raises(ValueError, match="offsets cover"):
        model.get_audio_feature([item])


def test_precomputed_embeddings_skip_the_encoder(audio_case, monkeypatch):
    model = audio_case.ours
    out = make_prompt(audio_case, [tone(0.7), noise(1.9, seed=6)])
    with torch.inference_mode():
        full = model.get_audio_feature(out.mm_inputs.items)
        first = out.mm_inputs.items[0]
        first.precomputed_embedding, first.feature = full[0].clone(), None
        calls = []
        monkeypatch.setattr(model.audio_tower, "forward",
                            lambda *a, _f=model.audio_tower.forward, **k: calls.append(a[0].shape[0]) or _f(*a, **k))
        mixed = model.get_audio_feature(out.mm_inputs.items)
    assert calls == [1]
    for a, b in zip(mixed, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
