"""Parity of our paged Qwen2.5-VL with transformers on tiny random checkpoints (GQA untied, MHA tied).

Images span several vision attention windows (window = 2 or 3 merged tokens per side, some grids not a
multiple of it); videos carry second_per_grid_ts, so their temporal M-RoPE positions are spaced by
tokens_per_second x seconds per grid. Our positions come from the processor's finalize, HF's from
get_rope_index; our media embeddings from our encoders; everything runs over the paged KV test driver.
"""

from __future__ import annotations

import pytest
import torch
from mrope_vlm_testing import (
    MRopeCase,
    check_chunked_prefill,
    check_fixture_can_fail,
    check_greedy_decode,
    check_prefill_logits,
    check_prefix_cache_hit,
    check_processor_output_matches_hf,
    check_two_requests_in_one_batch,
    prompt_mm_embeds,
)
from qwen2_5_vl_testing import (
    SPECS,
    TOKENS_PER_SECOND,
    build_prompt,
    build_tiny_qwen2_5_vl,
    hf_generate,
    load_hf_reference,
    make_tiny_qwen2_5_vl_checkpoint,
    our_positions,
)

from tessera.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tessera.models.registry import load_model
from tessera.messages.items import Modality

PROMPTS = {
    "text": [12],
    "square_image": [5, ("image", (1, 8, 8)), 4],  # 4x4 merged: 4 windows (gqa), 1 padded window (mha)
    "nonsquare_image": [3, ("image", (1, 6, 14)), 2],  # 3x7 merged: windows padded on both axes
    "two_images": [3, ("image", (1, 8, 12)), 2, ("image", (1, 4, 6)), 3],
    "video": [4, ("video", (4, 4, 6), 0.75), 3],  # temporal step 2 x 0.75 = 1.5 positions per grid
    "image_and_long_video": [2, ("image", (1, 2, 2)), 1, ("video", (6, 4, 4), 1.25), 3],  # step 2.5, t > h, w
}
DECODE_PROMPT = [3, ("image", (1, 8, 12)), 2, ("video", (4, 4, 6), 0.75), 4]


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> MRopeCase:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"qwen2_5_vl_{spec.name}")
    hf = build_tiny_qwen2_5_vl(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, Qwen2_5_VLForConditionalGeneration)
    assert config.mrope_section == spec.mrope_section and config.tie_word_embeddings == spec.tie
    # The fixture must be able to fail: image embeddings are text-sized, greedy output depends on the image
    # and on the text, is not one repeated token, and its choices are not float noise.
    _, embeds = prompt_mm_embeds(ours, build_prompt(DECODE_PROMPT, seed=0))
    ratio = float(embeds.pow(2).mean().sqrt() / ours.model.embed_tokens.weight.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    check_fixture_can_fail(hf, lambda: build_prompt(DECODE_PROMPT, seed=0), hf_generate)
    return MRopeCase(spec.name, hf, ours, our_positions)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    check_prefill_logits(case, build_prompt(PROMPTS[prompt_name], seed=1))


def test_video_positions_are_time_scaled():
    """Temporal rows step by floor(i * tokens_per_second * second_per_grid_ts), as HF's get_rope_index (the
    parity itself is asserted in every prefill_step)."""
    prompt = build_prompt([2, ("video", (6, 2, 2), 1.25), 1])
    positions, delta = our_positions(prompt)
    (s, e), = prompt.items[0].offsets
    frame_starts = positions[0, s:e].unique() - positions[0, s]
    assert frame_starts.tolist() == [int(i * TOKENS_PER_SECOND * 1.25) for i in range(6)]
    # Text after the video resumes after its spatial extent, not its temporal one.
    assert positions[0, e] == positions[0, s] + 1 and delta == int(positions.max()) + 1 - len(prompt)


def test_vision_features_match_hf_in_one_tower_call(case, monkeypatch):
    prompt = build_prompt([2, ("image", (1, 8, 12)), 1, ("image", (1, 6, 14)), 1, ("video", (2, 4, 6), 1.0)], seed=2)
    calls = []
    tower = case.ours.visual
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    images = [it for it in prompt.items if it.modality == Modality.IMAGE]
    with torch.inference_mode():
        ours = case.ours.get_image_feature(images)
        ours_video = case.ours.get_video_feature([prompt.items[2]])
        ref = case.hf.model.get_image_features(prompt.pixels(Modality.IMAGE), prompt.grids(Modality.IMAGE))
        ref_video = case.hf.model.get_video_features(prompt.pixels(Modality.VIDEO), prompt.grids(Modality.VIDEO))
    assert len(calls) == 2, "all images of a step go through the vision tower in one call (videos in another)"
    assert [o.shape[0] for o in ours] == [24, 21]
    for o, r in zip(ours + ours_video, ref.pooler_output + ref_video.pooler_output):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(case, page_size):
    check_greedy_decode(case, build_prompt(DECODE_PROMPT, seed=3), num_new=10, page_size=page_size)


def test_two_requests_in_one_batch_match_hf(case):
    """Two prompts prefilled in one forward, then decoded together (one batched step per token)."""
    prompts = [build_prompt(PROMPTS["two_images"], seed=4), build_prompt(PROMPTS["image_and_long_video"], seed=5)]
    check_two_requests_in_one_batch(case, prompts, num_new=6)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_hf(case, page_size):
    """Chunks of 7 tokens; the image spans rows 6..29 and the video 33..44, so chunk boundaries 7, 14, 21, 28
    and 35, 42 fall inside media spans."""
    prompt = build_prompt([5, ("image", (1, 8, 12)), 1, ("video", (2, 4, 6), 0.75), 4], seed=6)
    check_chunked_prefill(case, prompt, page_size, chunk=7)


@pytest.mark.parametrize("page_size,shared", [(1, 22), (4, 12)])
def test_prefix_cache_hit_matches_hf(case, page_size, shared):
    """B shares A's prompt up to its text suffix: B reuses A's KV slots for the first `shared` tokens (all of
    the image and <vision_end> with page_size 1; a page-aligned cut inside the image span with page_size 4),
    extends only the rest (with the rest of the image's embedding rows), and both then decode in one batch."""
    spec = [4, ("image", (1, 8, 8)), 6]  # image rows 5..20, <vision_end> at 21
    a = build_prompt(spec, seed=7)
    b = build_prompt(spec, seed=7)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    assert torch.equal(a.input_ids[:22], b.input_ids[:22]) and not torch.equal(a.input_ids, b.input_ids)
    check_prefix_cache_hit(case, a, b, shared, page_size, num_new=4)


def test_same_seed_same_bytes(tmp_path):
    paths = [tmp_path / "one", tmp_path / "two"]
    for p in paths:
        build_tiny_qwen2_5_vl(p, SPECS["gqa"])
    for name in ("model.safetensors", "config.json"):
        assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), name


# ---------------------------------------------------------------- a complete checkpoint and the real processor

def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_qwen2_5_vl_checkpoint: AutoProcessor loads a Qwen2_5_VLProcessor, our processor (through the
    registry) gives HF's input_ids, pixels and time-scaled positions, and our model's logits and greedy tokens
    on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLProcessor

    from tessera.multimodal.media import MediaLimits, VideoClip
    from tessera.multimodal.processors.qwen_vl import QwenVLProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_qwen2_5_vl_checkpoint(tmp_path / "ckpt", num_kv_heads=4, hidden=48, layers=3, heads=4,
                                           tie=True, vision_depth=3, fullatt_block_indexes=(0,), seed=3)
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, Qwen2_5_VLProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, QwenVLProcessor) and processor.tokens_per_second == TOKENS_PER_SECOND

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (84, 140, 3), dtype=np.uint8))  # non-square: 6x10 patches
    frames = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(4)]
    clip = VideoClip(frames, fps=3.0, total_num_frames=8, sampled_indices=[0, 2, 4, 6])  # 1.5 fps sampled
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is shown here?"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=[image], video_data=[clip])
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=[image], videos=[frames], return_tensors="pt", videos_kwargs={
        "do_sample_frames": False,
        "video_metadata": [{"fps": 3.0, "total_num_frames": 8, "frames_indices": [0, 2, 4, 6]}]})
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert ref["image_grid_thw"].tolist() == [[1, 6, 10]]
    assert float(ref["second_per_grid_ts"][0]) == pytest.approx(2 / 1.5)
    image_item, video_item = out.mm_inputs.items
    torch.testing.assert_close(image_item.feature, ref["pixel_values"], atol=0, rtol=0)
    torch.testing.assert_close(video_item.feature, ref["pixel_values_videos"], atol=0, rtol=0)
    ref_inputs = {k: ref[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                                      "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")}
    ref_pos, ref_delta = hf.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"], second_per_grid_ts=ref["second_per_grid_ts"])
    assert torch.equal(out.mm_inputs.mrope_positions, ref_pos[:, 0])
    assert out.mm_inputs.mrope_position_delta == int(ref_delta.reshape(-1)[0])

    check_processor_output_matches_hf(hf, ours, out, ref_inputs, num_new=6)
