"""M-RoPE positions equal transformers' Qwen2VLModel.get_rope_index for one sequence."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from tessera.multimodal.mrope import VisionSpan, compute_mrope_positions

from .conftest import scene_frames, scene_image
from .test_mm_qwen_processor import chat_prompt, hf_reference


class _HFRopeOracle:
    """HF's rope-index methods without building the model (they only read the config)."""

    get_rope_index = Qwen2VLModel.get_rope_index
    get_vision_position_ids = Qwen2VLModel.get_vision_position_ids

    def __init__(self, config):
        self.config = config


def _hf_positions(skeleton, ref) -> tuple[torch.Tensor, int]:
    positions, deltas = _HFRopeOracle(skeleton.config).get_rope_index(
        ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
        image_grid_thw=ref.get("image_grid_thw"), video_grid_thw=ref.get("video_grid_thw"),
    )
    return positions[:, 0], int(deltas[0, 0])


CASES = {
    "one_image": (["image", "What is it?"], [(333, 251)], []),
    "images_of_many_shapes": (["image", "a", "image", "b", "image", "?"], [(640, 480), (57, 999), (20, 20)], []),
    "long_video_t_exceeds_hw": (["video", "Which way?"], [], [(16, 56, 56)]),
    "mixed": (["image", "video", "x", "image", "video", "?"], [(200, 500), (90, 90)], [(4, 160, 120), (9, 90, 300)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_match_hf(skeleton, make_processor, case):
    parts, image_sizes, video_specs = CASES[case]
    images = [scene_image(i, s) for i, s in enumerate(image_sizes)]
    videos = [[f.resize((w, h)) for f in (scene_frames(i) * 4)[:n]] for i, (n, w, h) in enumerate(video_specs)]
    prompt = chat_prompt(skeleton, parts)
    out = make_processor().process(prompt=prompt, image_data=images, video_data=videos)
    ref = hf_reference(skeleton, prompt, images=images, videos=videos)
    assert out.input_ids == ref["input_ids"][0].tolist()
    expected, delta = _hf_positions(skeleton, ref)
    assert out.mm_inputs.mrope_positions.dtype == torch.long
    assert out.mm_inputs.mrope_positions.shape == (3, len(out.input_ids))
    assert torch.equal(out.mm_inputs.mrope_positions, expected)
    assert out.mm_inputs.mrope_position_delta == delta


def test_text_only_and_span_errors():
    positions, delta = compute_mrope_positions(5, [], spatial_merge_size=2)
    assert torch.equal(positions, torch.arange(5).expand(3, 5)) and delta == 0
    # A lone 2x4 (merged 1x2) image after one text token: positions 1..2 on w, next text at 1 + 2.
    positions, delta = compute_mrope_positions(4, [VisionSpan(1, (1, 2, 4))], spatial_merge_size=2)
    assert positions.tolist() == [[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]] and delta == 0
    with pytest.raises(ValueError, match="overlaps or exceeds"):
        compute_mrope_positions(2, [VisionSpan(1, (1, 2, 4))], spatial_merge_size=2)
    with pytest.raises(ValueError, match="not divisible"):
        compute_mrope_positions(9, [VisionSpan(0, (1, 3, 4))], spatial_merge_size=2)


@pytest.fixture(scope="module")
def qwen25(skeleton, tmp_path_factory):
    """The demo skeleton re-labelled as Qwen2.5-VL (same tokenizer and image processor)."""
    import json
    import shutil

    from transformers import AutoProcessor, Qwen2_5_VLConfig

    path = tmp_path_factory.mktemp("demo-vl-25")
    for f in skeleton.path.iterdir():
        shutil.copy(f, path / f.name)
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["processor_class"] = "Qwen2_5_VLProcessor"
        (path / name).write_text(json.dumps(cfg))
    c = skeleton.config
    config = Qwen2_5_VLConfig(
        vision_config={"spatial_merge_size": 2, "patch_size": 14, "temporal_patch_size": 2, "tokens_per_second": 2},
        image_token_id=c.image_token_id, video_token_id=c.video_token_id,
        vision_start_token_id=c.vision_start_token_id, vision_end_token_id=c.vision_end_token_id,
    )
    return AutoProcessor.from_pretrained(path), config


def test_qwen25_time_scaled_positions_match_hf(skeleton, qwen25):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from tessera.multimodal.media import MediaLimits, load_video
    from tests.multimodal.processor_registry import create_processor

    from .conftest import encode_mp4

    hf_processor, config = qwen25
    proc = create_processor(hf_processor, config, mm_process_config={"video": {"num_frames": 4}},
                            limits=MediaLimits.offline())
    # 4 of 32 frames at 10 fps: 1.25 sampled fps, 1.6 s per grid, temporal step 2 * 1.6 = 3.2.
    mp4 = encode_mp4([f.resize((112, 84)) for f in (scene_frames(9) * 8)[:32]], fps=10)
    image = scene_image(1, (100, 60))
    prompt = chat_prompt(skeleton, ["video", "image", "Which way?"])
    out = proc.process(prompt=prompt, image_data=[image], video_data=[mp4])
    clip = load_video(mp4, limits=MediaLimits.offline(), num_frames=4)
    ref = hf_processor(text=[prompt], images=[image], videos=[clip.frames], return_tensors="pt",
                       videos_kwargs={"do_sample_frames": False, "video_metadata": [
                           {"fps": 10.0, "total_num_frames": clip.total_num_frames,
                            "frames_indices": clip.sampled_indices}]})
    assert float(ref["second_per_grid_ts"][0]) == pytest.approx(2 / clip.sampled_fps)

    class Oracle:
        get_rope_index = Qwen2_5_VLModel.get_rope_index
        get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

        def __init__(self, cfg):
            self.config = cfg

    expected, delta = Oracle(config).get_rope_index(
        ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"], second_per_grid_ts=ref["second_per_grid_ts"])
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(out.mm_inputs.mrope_positions, expected[:, 0])
    assert out.mm_inputs.mrope_position_delta == int(delta[0, 0])
    (s, e), = out.mm_inputs.items[0].offsets
    steps = out.mm_inputs.mrope_positions[0, s:e].unique().diff()
    assert steps.numel() > 0 and bool((steps > 1).all())  # frames spaced by real time, not by one
    proc.close()


def test_a_segment_across_the_prompt_end_continues_at_index_plus_delta() -> None:
    from tests.models.mrope_reference import text_mrope_positions

    from tessera.multimodal.mrope import segment_mrope_positions

    prompt, delta = compute_mrope_positions(6, [VisionSpan(1, (1, 4, 4))], spatial_merge_size=2)
    assert delta == -2
    seg = segment_mrope_positions(3, 9, 6, prompt, delta)
    assert torch.equal(seg, torch.cat([prompt[:, 3:], text_mrope_positions(6, 3, delta)], dim=1))
    assert torch.equal(segment_mrope_positions(7, 8, 6, prompt, delta), text_mrope_positions(7, 1, delta))
    # A text prompt (no positions from the processor): its index on all three axes.
    assert segment_mrope_positions(1, 4, 3, None, 0).tolist() == [[1, 2, 3]] * 3
