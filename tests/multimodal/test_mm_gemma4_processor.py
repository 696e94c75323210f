"""Gemma4Processor against HF's Gemma4Processor: input_ids, soft-token runs, patch rows and positions of images
of several aspect ratios and of a video, from the HF call, from the preprocessing cache and from given input_ids;
the processor_output and precomputed_embedding formats; refusals; and our model on our processor's output against HF's model on HF's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.models.families import get_family
from tessera.multimodal.processors.gemma4 import POSITION_IDS, Gemma4Processor
from tests.models.gemma4_testing import POOL, make_tiny_gemma4_checkpoint

from .conftest import chat_text, processor_factory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4_processor"))


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture()
def make(checkpoint, hf_processor):
    from transformers import AutoConfig

    with processor_factory(hf_processor, AutoConfig.from_pretrained(checkpoint)) as factory:
        yield factory


def image(h: int, w: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def assert_matches_hf(out, ref, hf_processor) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    images = [i for i in items if i.modality.value == "image"]
    for j, item in enumerate(images):
        n = item.num_tokens * POOL ** 2
        assert torch.equal(item.feature, ref["pixel_values"][j, :n])
        assert torch.equal(item.model_specific_data[POSITION_IDS], ref["image_position_ids"][j, :n])
        assert (ref["image_position_ids"][j, n:] == -1).all()
    types = ref["mm_token_type_ids"][0]
    covered = sorted(p for item in items for s, e in item.offsets for p in range(s, e))
    assert covered == torch.nonzero(types).flatten().tolist()  # every soft token in exactly one item run


def test_registry_and_family(checkpoint):
    family = get_family("Gemma4ForConditionalGeneration")
    assert family.bidirectional_mm_spans and family.processor_class() is Gemma4Processor


@pytest.mark.parametrize("sizes", [[(40, 120)], [(64, 64), (90, 30)], [(20, 20), (200, 50), (33, 91)]])
def test_image_parity_with_hf(make, hf_processor, sizes):
    proc = make(cache_size_bytes=1 << 26)
    images = [image(h, w, i) for i, (h, w) in enumerate(sizes)]
    text = chat_text(hf_processor, ["image"] * len(images) + ["What is this?"])
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    tokens = hf_processor.image_processor(images, return_tensors="pt")["num_soft_tokens_per_image"]
    assert [i.num_tokens for i in make().process(prompt=text, image_data=images).mm_inputs.items] == tokens.tolist()
    assert_matches_hf(proc.process(prompt=text, image_data=images), ref, hf_processor)
    again = proc.process(prompt=text, image_data=images)  # features from the cache, the prompt expanded here
    assert proc.preprocess_cache_hits == len(images)
    assert_matches_hf(again, ref, hf_processor)
    from_ids = proc.process(input_ids=hf_processor.tokenizer(text)["input_ids"], image_data=images)
    assert_matches_hf(from_ids, ref, hf_processor)


def test_mm_process_config_sets_the_soft_token_budget(make, hf_processor):
    """--mm-process-config {"image": {"max_soft_tokens": 140}}: twice the checkpoint's budget, as HF's
    images_kwargs give it; the budget is part of the item's hash (the cache never mixes budgets)."""
    images = [image(40, 120, 1)]
    text = chat_text(hf_processor, ["image", "What is this?"])
    ref = hf_processor(text=[text], images=images, return_tensors="pt", images_kwargs={"max_soft_tokens": 140})
    small = make().process(prompt=text, image_data=images)
    large = make(mm_process_config={"image": {"max_soft_tokens": 140}}).process(prompt=text, image_data=images)
    assert_matches_hf(large, ref, hf_processor)
    assert large.mm_inputs.items[0].num_tokens > 70 >= small.mm_inputs.items[0].num_tokens
    assert large.mm_inputs.items[0].hash != small.mm_inputs.items[0].hash


def test_video_parity_with_hf(make, hf_processor):
    from tessera.multimodal.media import VideoClip

    frames = [image(48, 64, 10 + i) for i in range(3)]
    clip = VideoClip(frames, fps=2.0, total_num_frames=6, sampled_indices=[0, 2, 4])
    proc = make()
    text = chat_text(hf_processor, ["video", "What happens?"])
    loaded = proc.load_mm_data_sync()
    loaded.videos.append(clip)
    out = proc.process_and_combine_mm_data(text, None, loaded)
    ref = hf_processor(text=[text], videos=[frames], return_tensors="pt", videos_kwargs={
        "do_sample_frames": False, "video_metadata": [{"fps": 2.0, "total_num_frames": 6, "frames_indices": [0, 2, 4]}]})
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert "00:02" in hf_processor.tokenizer.decode(out.input_ids)  # frame 4 at 2 fps
    (item,) = out.mm_inputs.items
    n = item.num_tokens // 3 * POOL ** 2
    assert len(item.offsets) == 3 and torch.equal(item.feature, ref["pixel_values_videos"][:, :n])
    covered = sorted(p for s, e in item.offsets for p in range(s, e))
    assert covered == torch.nonzero(ref["mm_token_type_ids"][0]).flatten().tolist()


def test_text_only_and_other_formats(make, hf_processor):
    proc = make()
    text = chat_text(hf_processor, ["Hello"])
    assert proc.process(prompt=text).input_ids == hf_processor(text=[text])["input_ids"][0]
    images = [image(40, 120, 1), image(64, 64, 2)]
    text = chat_text(hf_processor, ["image", "image", "Compare."])
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    fields = dict(hf_processor.image_processor(images, return_tensors="pt"))
    as_output = proc.process(prompt=text, image_data=[{"format": "processor_output", **fields}])
    assert_matches_hf(as_output, ref, hf_processor)
    tokens = fields["num_soft_tokens_per_image"].tolist()
    hidden = proc.embed_dim
    feature = torch.randn(sum(tokens), hidden)
    for given in ({"feature": feature, "num_soft_tokens_per_image": tokens}, {"feature": list(feature.split(tokens))}):
        as_embedding = proc.process(prompt=text, image_data=[{"format": "precomputed_embedding", **given}])
        assert as_embedding.input_ids == ref["input_ids"][0].tolist()
        assert torch.equal(torch.cat([i.precomputed_embedding for i in as_embedding.mm_inputs.items]), feature)


def test_refusals(make, hf_processor):
    proc = make()
    with pytest.raises(ValueError, match="image"):
        proc.process(prompt=chat_text(hf_processor, ["image", "image", "x"]), image_data=[image(40, 40)])
    with pytest.raises(ValueError, match="precomputed"):  # rows of the wrong width
        proc.process(prompt=chat_text(hf_processor, ["image", "x"]),
                     image_data=[{"format": "precomputed_embedding", "feature": torch.zeros(5, 8)}])
    with pytest.raises(ValueError, match="pixel_values"):
        proc.process(prompt=chat_text(hf_processor, ["image", "x"]), image_data=[{
            "format": "processor_output", "pixel_values": torch.zeros(1, 8, 27),
            "image_position_ids": torch.zeros(1, 9, 2), "num_soft_tokens_per_image": torch.tensor([2])}])


def test_model_on_our_processor_output_matches_hf(checkpoint, hf_processor):
    """Two images of other aspect ratios through our processor and model give HF's logits and greedy tokens on
    HF's processor output and model."""
    from tests.models.family_parity import check_processed_prompt_matches_hf, load_real_processor, process_two_images
    from tests.models.gemma4_testing import Gemma4Case, Prompt, load_hf_reference

    case, processor, hf_proc = load_real_processor(checkpoint, load_hf_reference, Gemma4Case)
    out, ref = process_two_images(processor, hf_proc, ["image", "Compare", "image", "these."])
    prompt = Prompt(torch.tensor(out.input_ids), out.mm_inputs.items)
    check_processed_prompt_matches_hf(case, prompt, dict(ref), num_new=6)


def test_missing_vision_config_is_one_clear_error(checkpoint, tmp_path):
    import json
    import shutil

    from tessera.models.registry import load_model

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config.pop("vision_config")
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vision_config"):
        load_model(broken, torch.float32)


def test_audio_parity_with_hf_and_the_model_on_it(checkpoint, hf_processor, make):
    """Two audios of other lengths and an image: our ids, item runs and log-mel frames equal HF's processor's, and
    our model on our output gives HF's logits and greedy tokens on HF's (the audio spans causal)."""
    from tests.models.family_parity import check_processed_prompt_matches_hf, load_real_processor
    from tests.models.gemma4_testing import Gemma4Case, Prompt, load_hf_reference

    rng = np.random.default_rng(3)
    audios = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (11_000, 5_200)]
    images = [image(40, 70, 4)]
    text = chat_text(hf_processor, ["Listen: <|audio|> and <|image|> then <|audio|> What do you hear?"])
    ref = hf_processor(text=[text], images=images, audio=audios, return_tensors="pt")
    proc = make(cache_size_bytes=1 << 26)
    for _ in range(2):  # the HF call, then features from the preprocessing cache
        out = proc.process(prompt=text, image_data=images, audio_data=audios)
        assert out.input_ids == ref["input_ids"][0].tolist()
        sounds = [i for i in out.mm_inputs.items if i.modality.value == "audio"]
        for j, item in enumerate(sounds):
            frames = int(ref["input_features_mask"][j].sum())
            assert torch.equal(item.feature, ref["input_features"][j, :frames])
        covered = sorted(p for item in out.mm_inputs.items for s, e in item.offsets for p in range(s, e))
        assert covered == torch.nonzero(ref["mm_token_type_ids"][0]).flatten().tolist()
    case, processor, _ = load_real_processor(checkpoint, load_hf_reference, Gemma4Case)
    ours = processor.process(prompt=text, image_data=images, audio_data=audios)
    processor.close()
    check_processed_prompt_matches_hf(case, Prompt(torch.tensor(ours.input_ids), ours.mm_inputs.items), dict(ref))
