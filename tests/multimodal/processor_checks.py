"""Checks the image processors' tests (InternVL, Llama-4, Pixtral) run alike over a complete tiny checkpoint:
its fixtures, the preprocessing cache with a per-request process config, and text-only prompts and refusals; and
the output check of the processors that lay videos out frame by frame (Qwen3-VL, Cosmos3-Edge), and what the
M-RoPE processors' tests (Qwen3-VL, GLM-4V) compare with HF: the items' grids and pixels, and transformers' rope
index."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tessera.messages.items import Modality

from .conftest import chat_text, encode_png, load_processor_and_config, processor_factory, scene_image


def checkpoint_fixtures(make_checkpoint: Callable[[Path], Path], name: str) -> tuple[Any, Any]:
    """(ckpt, make_processor) fixtures: the (HF processor, config) of `make_checkpoint(dir)`, built once per
    module, and a processor factory whose processors are closed after each test."""
    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        return load_processor_and_config(make_checkpoint(tmp_path_factory.mktemp(name)))

    @pytest.fixture
    def make_processor(ckpt):
        with processor_factory(*ckpt) as make:
            yield make

    return ckpt, make_processor


def check_cache_hits_and_process_config(hf_processor, make_processor, assert_matches: Callable[[Any, Any], None],
                                        images: list, partly: list, image_config: dict, chat=chat_text) -> None:
    """Two images through a processor with a preprocessing cache match HF's; the same request again takes both
    from the cache and `partly` (one of them and a new image) one; `image_config` as the request's
    mm_process_config reaches the image processor (and the hash) and gives fewer tokens."""
    prompt = chat(hf_processor, ["image", "Compare with", "image", "now."])
    proc = make_processor(cache_size_bytes=1 << 26)
    first = proc.process(prompt=prompt, image_data=images)
    assert_matches(first, hf_processor(text=[prompt], images=images, return_tensors="pt"))
    again = proc.process(prompt=prompt, image_data=images)
    part = proc.process(prompt=prompt, image_data=partly)
    assert proc.preprocess_cache_hits == 3
    assert again.input_ids == first.input_ids
    assert [i.hash for i in again.mm_inputs.items] == [i.hash for i in first.mm_inputs.items]
    assert_matches(part, hf_processor(text=[prompt], images=partly, return_tensors="pt"))
    fewer = make_processor(mm_process_config={"image": image_config}).process(prompt=prompt, image_data=images)
    assert_matches(fewer, hf_processor(text=[prompt], images=images, images_kwargs=image_config, return_tensors="pt"))
    assert len(fewer.input_ids) < len(first.input_ids)
    assert fewer.mm_inputs.items[0].hash != first.mm_inputs.items[0].hash


def check_text_only_and_refusals(hf_processor, make_processor, bad_processor_output: dict, bad_message: str,
                                 video_prompt: str | None, chat=chat_text) -> None:
    """Text alone gives the tokenizer's ids; more images than the limit, fewer images than placeholders, a
    video (where `video_prompt` is given) and `bad_processor_output` are refused by name."""
    proc = make_processor(limit_mm_per_request={"image": 1})
    assert proc.process(prompt="hello there").input_ids == hf_processor.tokenizer("hello there")["input_ids"]
    img = scene_image(7, (64, 64))
    with pytest.raises(ValueError, match="too many image items"):
        proc.process(prompt=chat(hf_processor, ["image", "image", "?"]), image_data=[img, img])
    with pytest.raises(ValueError, match="image placeholder"):
        proc.process(prompt=chat(hf_processor, ["image", "image", "?"]), image_data=[img])
    if video_prompt is not None:
        with pytest.raises(ValueError, match="does not accept video"):
            proc.process(prompt=video_prompt, video_data=[[img, img]])
    with pytest.raises(ValueError, match=bad_message):
        proc.process(prompt=chat(hf_processor, ["image", "?"]),
                     image_data=[{"format": "processor_output", **bad_processor_output}])
    assert Modality.IMAGE in proc.supported_modalities


def check_single_image(hf_processor, make_processor, size: tuple[int, int], assert_matches: Callable[[Any, Any], None],
                       chat=chat_text) -> Any:
    """One PNG-encoded image of `size` (width, height) matches HF's processor on the decoded image. Returns our
    output, the processor and the image."""
    img = scene_image(sum(size), size)
    prompt = chat(hf_processor, ["image", "What is this?"])
    proc = make_processor()
    out = proc.process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches(out, hf_processor(text=[prompt], images=[img], return_tensors="pt"))
    return out, proc, img


def check_formats_agree(proc, prompt: str, images: list, raw, others: list) -> None:
    """Our output for `others` (the same request as processor output or precomputed embeddings) and for the
    prompt's tokenized ids (one placeholder per image) has `raw`'s ids and offsets."""
    from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=images)
    for out in (*others, from_ids):
        assert out.input_ids == raw.input_ids
        assert [i.offsets for i in out.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]


def hf_rope_index(model_cls: type, config: Any, ref: Any) -> tuple[Any, int]:
    """transformers' `model_cls.get_rope_index` (Qwen3VLModel, Glm4vModel: it reads only the config) on the HF
    processor's output `ref`: (positions [3, L], delta)."""
    import types

    fake = types.SimpleNamespace(
        config=config, get_vision_position_ids=lambda *a, **k: model_cls.get_vision_position_ids(None, *a, **k))
    pos, delta = model_cls.get_rope_index(fake, ref["input_ids"], ref["mm_token_type_ids"],
                                          image_grid_thw=ref.get("image_grid_thw"),
                                          video_grid_thw=ref.get("video_grid_thw"))
    return pos[:, 0], int(delta.reshape(-1)[0])


def matching_grid_items(out: Any, ref: Any) -> list[tuple[Modality, Any, list]]:
    """HF's ids, and per modality our items' grids and pixels equal to HF's: (modality, item, (t, h, w)) of each
    item, each with num_tokens t * h * w / 4."""
    import torch

    assert out.input_ids == ref["input_ids"][0].tolist()
    found = []
    for modality, pixel_key, grid_key in ((Modality.IMAGE, "pixel_values", "image_grid_thw"),
                                          (Modality.VIDEO, "pixel_values_videos", "video_grid_thw")):
        items = [i for i in out.mm_inputs.items if i.modality is modality]
        if grid_key not in ref:
            assert not items
            continue
        assert torch.equal(torch.cat([i.model_specific_data[grid_key] for i in items]), ref[grid_key])
        assert torch.equal(torch.cat([i.feature for i in items]), ref[pixel_key])
        for item, (t, h, w) in zip(items, ref[grid_key].tolist()):
            assert item.num_tokens == t * h * w // 4
            found.append((modality, item, (t, h, w)))
    return found


def assert_frame_runs_match_hf(out, ref, config, rope_index: Callable[[Any, Any], tuple[Any, int]]) -> None:
    """Our output `out` equals HF's processor output `ref` where videos are timestamped frame runs (Qwen3-VL,
    Cosmos3-Edge): the same ids, grids and pixel rows; an image is one placeholder run and a video one per frame
    (group), each inside <vision_start>/<vision_end>; positions and delta equal `rope_index(config, ref)`."""
    import torch

    for modality, item, (t, _, _) in matching_grid_items(out, ref):
        token = config.image_token_id if modality is Modality.IMAGE else config.video_token_id
        assert len(item.offsets) == (1 if modality is Modality.IMAGE else t)
        for s, e in item.offsets:
            assert set(out.input_ids[s:e]) == {token}
            assert (out.input_ids[s - 1], out.input_ids[e]) == (config.vision_start_token_id,
                                                                config.vision_end_token_id)
    positions, delta = rope_index(config, ref)
    assert torch.equal(out.mm_inputs.mrope_positions, positions) and out.mm_inputs.mrope_position_delta == delta
