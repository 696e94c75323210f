"""Parity of our paged Qwen3-VL with transformers on tiny random checkpoints (GQA untied with two DeepStack
levels, MHA tied with one; head_dim set apart from hidden // heads).

Videos are laid out as Qwen3-VL's processor lays them out (one placeholder run per frame group, separated by
timestamp text), so positions treat each group as its own grid. Our positions come from the Qwen3-VL
processor's position code, HF's from get_rope_index; our media embeddings (main + DeepStack levels) from our
encoders; everything runs over the paged KV test driver.
"""

from __future__ import annotations

import pytest
import torch
from mrope_vlm_testing import (
    ATOL,
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
from paged_driver import PagedKV, Step, make_batch
from qwen3_vl_testing import (
    SPECS,
    Prompt,
    build_prompt,
    build_tiny_qwen3_vl,
    hf_generate,
    load_hf_reference,
    make_tiny_qwen3_vl_checkpoint,
    our_positions,
)

from tessera.layers.rotary import RotaryEmbedding
from tessera.models.mm_embed import EmbeddingCountError
from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration
from tessera.models.registry import load_model
from tessera.messages.items import Modality

PROMPTS = {
    "text": [12],
    "square_image": [5, ("image", (1, 8, 8)), 4],
    "nonsquare_image": [3, ("image", (1, 6, 14)), 2],
    "two_images": [3, ("image", (1, 8, 12)), 2, ("image", (1, 4, 6)), 3],
    "video": [4, ("video", (3, 4, 6)), 3],
    "image_and_video": [2, ("image", (1, 2, 2)), 1, ("video", (4, 4, 4)), 3],
}
DECODE_PROMPT = [3, ("image", (1, 8, 12)), 2, ("video", (2, 4, 6)), 4]


def _logits(case_ours, prompt: Prompt, embeds: torch.Tensor | None = None) -> torch.Tensor:
    positions, _ = our_positions(prompt)
    rows, ours_embeds = prompt_mm_embeds(case_ours, prompt)
    kv = PagedKV(case_ours.lm_config)
    step = Step(kv.new_request(), prompt.input_ids, positions, rows, ours_embeds if embeds is None else embeds,
                all_logits=True)
    with torch.inference_mode():
        return case_ours(make_batch(kv, [step]), kv.pool)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> MRopeCase:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"qwen3_vl_{spec.name}")
    hf = build_tiny_qwen3_vl(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, Qwen3VLForConditionalGeneration)
    assert config.mrope_section == spec.mrope_section and config.head_dim == spec.head_dim
    assert ours.num_deepstack_levels == len(spec.deepstack)
    # The fixture must be able to fail: media embeddings (main and every DeepStack level) are text-sized, a
    # dropped DeepStack level moves the logits far beyond the tolerance, greedy output depends on the image and
    # on the text, is not one repeated token, and its choices are not float noise.
    base = build_prompt(DECODE_PROMPT, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    text_rms = ours.model.embed_tokens.weight.pow(2).mean().sqrt()
    for level in embeds.split(spec.hidden, dim=-1):
        ratio = float(level.pow(2).mean().sqrt() / text_rms)
        assert 0.5 < ratio < 2, f"media embeddings are {ratio:.2f}x the text embeddings' RMS"
    no_deepstack = embeds.clone()
    no_deepstack[:, spec.hidden:] = 0
    assert (_logits(ours, base, no_deepstack) - _logits(ours, base)).abs().max() > 100 * ATOL
    check_fixture_can_fail(hf, lambda: build_prompt(DECODE_PROMPT, seed=0), hf_generate)
    return MRopeCase(spec.name, hf, ours, our_positions)


def test_interleaved_mrope_matches_hf_rotary():
    """Our interleaved frequency-to-row map gives transformers' Qwen3VLTextRotaryEmbedding cos/sin (the
    real 128-dim [24, 20, 20] layout and a tiny one); the consecutive (Qwen2-VL) layout does not."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    positions = torch.randint(0, 500, (3, 17), generator=torch.Generator().manual_seed(0))
    for head_dim, section in ((128, [24, 20, 20]), (16, [2, 3, 3]), (20, [4, 3, 3])):
        cfg = Qwen3VLTextConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4, rope_parameters={
            "rope_type": "default", "rope_theta": 5e5, "mrope_section": section, "mrope_interleaved": True})
        ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[:, None])
        for interleaved in (True, False):
            cos, sin = RotaryEmbedding(head_dim, 5e5, section, mrope_interleaved=interleaved).get_cos_sin(
                positions, torch.float32)
            same = torch.equal(torch.cat([cos, cos], -1), ref_cos[0]) and torch.equal(torch.cat([sin, sin], -1),
                                                                                         ref_sin[0])
            assert same == interleaved, (head_dim, interleaved)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    check_prefill_logits(case, build_prompt(PROMPTS[prompt_name], seed=1))


def test_vision_features_match_hf_in_one_tower_call(case, monkeypatch):
    """Each item's embedding is HF's pooler output followed by its DeepStack features, level by level."""
    prompt = build_prompt([2, ("image", (1, 8, 12)), 1, ("image", (1, 6, 14)), 1, ("video", (2, 4, 6))], seed=2)
    calls = []
    tower = case.ours.visual
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    images = [it for it in prompt.items if it.modality == Modality.IMAGE]
    with torch.inference_mode():
        ours = case.ours.get_image_feature(images) + case.ours.get_video_feature([prompt.items[2]])
        refs = [case.hf.model.get_image_features(prompt.pixels(Modality.IMAGE), prompt.grids(Modality.IMAGE)),
                case.hf.model.get_video_features(prompt.pixels(Modality.VIDEO), prompt.grids(Modality.VIDEO))]
    assert len(calls) == 2, "all images of a step go through the vision tower in one call (videos in another)"
    ref_items = [torch.cat([main, *levels], dim=-1) for ref in refs
                 for main, *levels in zip(ref.pooler_output, *ref.deepstack_features)]
    assert [o.shape for o in ours] == [r.shape for r in ref_items]
    assert ours[0].shape == (24, case.ours.mm_embed_width)
    for o, r in zip(ours, ref_items):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


def test_embedding_width_is_checked(case):
    prompt = build_prompt(PROMPTS["square_image"], seed=1)
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    with pytest.raises(EmbeddingCountError, match="DeepStack"):
        _logits(case.ours, prompt, embeds[:, : case.ours.config.hidden_size])


def test_greedy_decode_matches_hf(case, page_size=4):
    check_greedy_decode(case, build_prompt(DECODE_PROMPT, seed=3), num_new=10, page_size=page_size)


def test_two_requests_in_one_batch_match_hf(case):
    """Two prompts of different lengths prefilled in one forward (DeepStack rows of both), then decoded
    together."""
    prompts = [build_prompt(PROMPTS["two_images"], seed=4), build_prompt(PROMPTS["image_and_video"], seed=5)]
    check_two_requests_in_one_batch(case, prompts, num_new=6)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_hf(case, page_size):
    """Chunks of 7 tokens; the image spans rows 6..29 and the video's frame groups 35..40 and 45..50, so
    chunk boundaries fall inside the image and inside a frame group (DeepStack rows split across chunks)."""
    prompt = build_prompt([5, ("image", (1, 8, 12)), 1, ("video", (2, 4, 6)), 4], seed=6)
    check_chunked_prefill(case, prompt, page_size, chunk=7)


@pytest.mark.parametrize("page_size,shared", [(1, 22), (4, 12)])
def test_prefix_cache_hit_matches_hf(case, page_size, shared):
    """B shares A's prompt up to its text suffix: B reuses A's KV slots for the first `shared` tokens (all of
    the image with page_size 1; a page-aligned cut inside the image with page_size 4), extends the rest (with
    the rest of the image's rows and DeepStack levels), and both then decode in one batch."""
    spec = [4, ("image", (1, 8, 8)), 6]  # image rows 5..20, <vision_end> at 21
    a, b = build_prompt(spec, seed=7), build_prompt(spec, seed=7)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    check_prefix_cache_hit(case, a, b, shared, page_size, num_new=4)


# ---------------------------------------------------------------- a complete checkpoint and the real processor

def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_qwen3_vl_checkpoint: AutoProcessor loads a Qwen3VLProcessor; our processor (through the
    registry) gives HF's input_ids (timestamped frame groups), pixels and positions; our model's logits and
    greedy tokens on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor, Qwen3VLProcessor

    from tessera.multimodal.media import MediaLimits, VideoClip
    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor as OurProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_qwen3_vl_checkpoint(tmp_path / "ckpt")
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, Qwen3VLProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, OurProcessor)

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (96, 160, 3), dtype=np.uint8))  # non-square: 6x10 patches
    frames = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(4)]
    clip = VideoClip(frames, fps=3.0, total_num_frames=8, sampled_indices=[0, 2, 4, 6])
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
    assert "<0.3 seconds>" in hf_processor.tokenizer.decode(out.input_ids)  # frames 0 and 2 at 3 fps
    assert ref["image_grid_thw"].tolist() == [[1, 6, 10]] and ref["video_grid_thw"][0, 0] == 2
    image_item, video_item = out.mm_inputs.items
    assert len(video_item.offsets) == 2  # one run per frame group
    torch.testing.assert_close(image_item.feature, ref["pixel_values"], atol=0, rtol=0)
    torch.testing.assert_close(video_item.feature, ref["pixel_values_videos"], atol=0, rtol=0)
    ref_inputs = {k: ref[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                                      "pixel_values_videos", "video_grid_thw")}
    ref_pos, ref_delta = hf.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"])
    assert torch.equal(out.mm_inputs.mrope_positions, ref_pos[:, 0])
    assert out.mm_inputs.mrope_position_delta == int(ref_delta.reshape(-1)[0])

    check_processor_output_matches_hf(hf, ours, out, ref_inputs, num_new=6)
