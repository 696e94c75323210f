"""Qwen3VLProcessor against transformers' Qwen3VLProcessor: input_ids (videos as timestamped frame groups),
placeholder runs, pixels, grids and M-RoPE positions (HF's get_rope_index); the preprocessing-cache path,
caller-supplied input_ids and the processor_output / precomputed_embedding formats expand videos as HF does."""

from __future__ import annotations

import pytest
import torch

from tessera.multimodal.media import VideoClip
from tessera.multimodal.processors.base import ProcessorOutput
from tessera.multimodal.processors.qwen3_vl import frame_timestamps
from tests.models.qwen3_vl_testing import (
    CHECKPOINT_SPEC,
    tiny_qwen3_vl_processor_and_config,
)

from . import processor_checks
from .processor_checks import assert_frame_runs_match_hf
from .conftest import (
    chat_text,
    encode_mp4,
    encode_png,
    processor_factory,
    scene_frames,
    scene_image,
)


@pytest.fixture(scope="module")
def hf_pair():
    return tiny_qwen3_vl_processor_and_config()


@pytest.fixture
def make(hf_pair):
    with processor_factory(*hf_pair) as factory:
        yield factory


def chat(hf_pair, parts: list[str]) -> str:
    return chat_text(hf_pair[0], parts)


def hf_reference(hf_pair, prompt: str, images=(), clips: tuple[VideoClip, ...] = ()):
    kwargs = {"text": [prompt], "return_tensors": "pt"}
    if images:
        kwargs["images"] = list(images)
    if clips:
        kwargs["videos"] = [c.frames for c in clips]
        kwargs["videos_kwargs"] = {"do_sample_frames": False, "video_metadata": [
            {"fps": c.fps, "total_num_frames": c.total_num_frames, "frames_indices": c.sampled_indices}
            for c in clips]}
    return hf_pair[0](**kwargs)


def hf_rope_index(config, ref) -> tuple[torch.Tensor, int]:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return processor_checks.hf_rope_index(Qwen3VLModel, config, ref)


def assert_matches_hf(out: ProcessorOutput, ref, config) -> None:
    assert_frame_runs_match_hf(out, ref, config, hf_rope_index)


SIZES = [(20, 20), (64, 64), (128, 512), (512, 128), (333, 251), (1000, 90)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(hf_pair, make, size):
    img = scene_image(sum(size), size)
    prompt = chat(hf_pair, ["image", "What color is the circle?"])
    out = make().process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_reference(hf_pair, prompt, images=[img]), hf_pair[1])


def test_images_and_videos_with_timestamps(hf_pair, make):
    """Two images and two videos: an mp4 (its own fps; frames sampled by our loader) and a list of frames (no
    fps: HF times them at 24 fps), then the same request again from the preprocessing cache."""
    images = [scene_image(1, (300, 200)), scene_image(2, (90, 400))]
    mp4 = encode_mp4([f.resize((120, 90)) for f in scene_frames(3)], fps=10)
    frames = [f.resize((64, 96)) for f in scene_frames(4)][:5]  # odd: the last group repeats its last frame
    prompt = chat(hf_pair, ["image", "video", "then", "image", "video", "Describe."])
    proc = make(mm_process_config={"video": {"num_frames": 6}}, cache_size_bytes=1 << 26)
    loaded = proc.load_mm_data_sync(image_data=images, video_data=[mp4, frames])
    clips = tuple(loaded.videos)
    assert clips[0].fps == 10 and clips[1].fps is None
    ref = hf_reference(hf_pair, prompt, images=images, clips=clips)
    out = proc.process_and_combine_mm_data(prompt, None, loaded)
    assert_matches_hf(out, ref, hf_pair[1])
    text = hf_pair[0].tokenizer.decode(out.input_ids)
    stamps = frame_timestamps(clips[0].sampled_indices, 10, 2)
    assert all(f"<{s:.1f} seconds><|vision_start|>" in text for s in stamps) and "<0.2 seconds>" in text
    # Cache hit: our own expansion (no HF call) gives the same ids, items and positions.
    hits = proc.preprocess_cache_hits
    again = proc.process(prompt=prompt, image_data=images, video_data=[mp4, frames])
    assert proc.preprocess_cache_hits == hits + 4
    assert again.input_ids == out.input_ids
    assert [i.offsets for i in again.mm_inputs.items] == [i.offsets for i in out.mm_inputs.items]
    assert [i.hash for i in again.mm_inputs.items] == [i.hash for i in out.mm_inputs.items]
    assert torch.equal(again.mm_inputs.mrope_positions, out.mm_inputs.mrope_positions)


def test_video_hash_covers_timestamps(hf_pair, make):
    """The same frames taken from another part of the source expand to other timestamp text."""
    frames = [f.resize((64, 64)) for f in scene_frames(5)][:4]
    early = VideoClip(frames, fps=4.0, total_num_frames=40, sampled_indices=[0, 1, 2, 3])
    late = VideoClip(frames, fps=4.0, total_num_frames=40, sampled_indices=[20, 21, 22, 23])
    prompt = chat(hf_pair, ["video", "?"])
    proc = make(cache_size_bytes=1 << 26)
    outs = [proc.process(prompt=prompt, video_data=[clip]) for clip in (early, late)]
    assert outs[0].mm_inputs.items[0].hash != outs[1].mm_inputs.items[0].hash
    for out, clip in zip(outs, (early, late)):
        assert_matches_hf(out, hf_reference(hf_pair, prompt, clips=(clip,)), hf_pair[1])


def test_input_formats_give_hf_ids(hf_pair, make):
    """Unexpanded input_ids with raw media, processor_output dicts (with and without video_timestamps) and
    precomputed embeddings hidden x (1 + DeepStack levels) wide all give HF's ids and positions."""
    image = scene_image(6, (160, 96))
    clip = VideoClip([f.resize((64, 64)) for f in scene_frames(7)][:4], fps=2.0, total_num_frames=4,
                     sampled_indices=[0, 1, 2, 3])
    prompt = chat(hf_pair, ["image", "video", "What happens?"])
    ref = hf_reference(hf_pair, prompt, images=[image], clips=(clip,))
    proc = make()
    raw_from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=[image], video_data=[clip])
    assert_matches_hf(raw_from_ids, ref, hf_pair[1])
    stamps = frame_timestamps(clip.sampled_indices, clip.fps, 2)
    image_dict = {"format": "processor_output", "pixel_values": ref["pixel_values"],
                  "image_grid_thw": ref["image_grid_thw"]}
    video_dict = {"format": "processor_output", "pixel_values_videos": ref["pixel_values_videos"],
                  "video_grid_thw": ref["video_grid_thw"], "video_timestamps": stamps}
    processed = proc.process(prompt=prompt, image_data=[image_dict], video_data=[video_dict])
    assert_matches_hf(processed, ref, hf_pair[1])
    # Without timestamps a video is timed as HF times frames it has no metadata for.
    untimed = proc.process(prompt=prompt, image_data=[image_dict],
                           video_data=[{k: v for k, v in video_dict.items() if k != "video_timestamps"}])
    hf_untimed = hf_pair[0](text=[prompt], images=[image], videos=[clip.frames], return_tensors="pt",
                            videos_kwargs={"do_sample_frames": False})
    assert untimed.input_ids == hf_untimed["input_ids"][0].tolist() != processed.input_ids

    width = CHECKPOINT_SPEC.hidden * (1 + len(CHECKPOINT_SPEC.deepstack))
    n_img, n_vid = int(ref["image_grid_thw"].prod() // 4), int(ref["video_grid_thw"].prod() // 4)
    pre = proc.process(input_ids=ref["input_ids"][0].tolist(),
                       image_data=[{"format": "precomputed_embedding", "feature": torch.randn(n_img, width),
                                    "image_grid_thw": ref["image_grid_thw"]}],
                       video_data=[{"format": "precomputed_embedding", "feature": torch.randn(n_vid, width),
                                    "video_grid_thw": ref["video_grid_thw"], "video_timestamps": stamps}])
    assert pre.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(pre.mm_inputs.mrope_positions, hf_rope_index(hf_pair[1], ref)[0])
    with pytest.raises(ValueError, match=f"rows of {width} values"):
        proc.process(input_ids=ref["input_ids"][0].tolist(),
                     image_data=[{"format": "precomputed_embedding", "feature": torch.randn(n_img, 64),
                                  "image_grid_thw": ref["image_grid_thw"]}])


def test_text_only_and_contiguous_video_refused(hf_pair, make):
    proc = make()
    out = proc.process(prompt="hello there")
    assert out.input_ids == hf_pair[0].tokenizer("hello there")["input_ids"] and out.mm_inputs.items == []
    grid = torch.tensor([[2, 4, 4]])  # 2 frame groups of 4 tokens, given as one run (Qwen2-VL's layout)
    config = hf_pair[1]
    ids = [1, config.vision_start_token_id, *[config.video_token_id] * 8, config.vision_end_token_id]
    with pytest.raises(ValueError, match="2 placeholder runs of 4 tokens"):
        proc.process(input_ids=ids, video_data=[{"format": "processor_output", "video_grid_thw": grid,
                                                 "pixel_values_videos": torch.zeros(32, 1536)}])


def test_deferred_images_match_eager(hf_pair, make):
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat(hf_pair, ["image", "Describe."])
    assert_deferred_matches_eager(make, prompt, [(32, 32), (33, 95), (300, 200), (700, 90)])


def test_qwen3_vl_moe_config_takes_the_same_processor():
    """A Qwen3-VL-MoE checkpoint (its config class, its family row) is processed as HF's Qwen3VLProcessor does."""
    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor
    from tests.models.qwen3_vl_moe_testing import CHECKPOINT_SPEC as MOE_SPEC

    pair = tiny_qwen3_vl_processor_and_config(MOE_SPEC)
    assert type(pair[1]).__name__ == "Qwen3VLMoeConfig"
    images = [scene_image(3, (200, 120))]
    frames = [f.resize((64, 96)) for f in scene_frames(6)][:4]
    prompt = chat(pair, ["image", "video", "Describe."])
    with processor_factory(*pair) as make:
        proc = make()
        assert type(proc) is Qwen3VLProcessor
        loaded = proc.load_mm_data_sync(image_data=images, video_data=[frames])
        out = proc.process_and_combine_mm_data(prompt, None, loaded)
    assert_matches_hf(out, hf_reference(pair, prompt, images=images, clips=tuple(loaded.videos)), pair[1])


def test_qwen3_5_config_takes_the_same_processor():
    """A Qwen3.5 checkpoint (its config, whose tower has no DeepStack) is processed as HF's Qwen3VLProcessor does;
    its embeddings are hidden_size wide."""
    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor
    from tests.models.qwen3_5_testing import tiny_qwen3_5_processor_and_config

    pair = tiny_qwen3_5_processor_and_config()
    assert type(pair[1]).__name__ == "Qwen3_5Config"
    images = [scene_image(3, (200, 120))]
    frames = [f.resize((64, 96)) for f in scene_frames(6)][:4]
    prompt = chat(pair, ["image", "video", "Describe."])
    with processor_factory(*pair) as make:
        proc = make()
        assert type(proc) is Qwen3VLProcessor and proc.embed_dim == pair[1].text_config.hidden_size
        loaded = proc.load_mm_data_sync(image_data=images, video_data=[frames])
        out = proc.process_and_combine_mm_data(prompt, None, loaded)
    assert_matches_hf(out, hf_reference(pair, prompt, images=images, clips=tuple(loaded.videos)), pair[1])
